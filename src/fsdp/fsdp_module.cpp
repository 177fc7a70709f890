// The public handle: its verbs and runtime controls, each a call into the group's state.
#include "comm_context.h"
#include "group.h"
#include "hp/core/error.h"
#include "hp/mesh/parameter_spec.h"

namespace hp {

FSDPModule::FSDPModule(std::unique_ptr<State> s) : state_(std::move(s)) {}
FSDPModule::~FSDPModule() {
  if (state_) detail::forget_group(*state_);
}

std::vector<at::Tensor> FSDPModule::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : state_->params) out.push_back(p.sharded);
  return out;
}

std::vector<ShardedTensor> FSDPModule::state_dict() const {
  std::vector<ShardedTensor> out;
  const State& s = *state_;
  for (const auto& p : s.params) {
    std::vector<int64_t> shape = p.shape.empty() ? std::vector<int64_t>{1} : p.shape;
    const DimSplit rows{s.shard_dim, s.shards(), s.shard->rank()};
    // A tensor-parallel piece: its rows split again, inside the piece's box of the global tensor.
    c10::optional<ShardSpec> piece = parameter_spec(p.param.tensor());
    ShardSpec spec = piece ? split_further(*piece, 0, rows) : make_shard_spec(shape, {{rows}});
    out.push_back(ShardedTensor{p.name, p.sharded, p.shape, p.plan.row_offset, std::move(spec)});
  }
  return out;
}

const GroupDtypes& FSDPModule::dtypes() const { return state_->dt; }

std::vector<at::Tensor> FSDPModule::main_grads() const {
  std::vector<at::Tensor> out;
  for (const auto& p : state_->params) out.push_back(p.main_grad.tensor());
  return out;
}
torch::nn::Module& FSDPModule::module() const { return *state_->module; }

namespace {
template <typename F>
void for_self_and_nested(detail::GroupState& s, bool recurse, F f) {
  f(s);
  if (recurse) {
    for (auto* n : s.nested) f(*n);
  }
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.requires_sync = on; });
}
void FSDPModule::set_requires_all_reduce(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.requires_all_reduce = on; });
}
void FSDPModule::set_reshard_after_backward(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.reshard_after_backward = on; });
}
void FSDPModule::set_reshard_after_forward(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.reshard_after_forward = on; });
}
void FSDPModule::set_is_last_backward(bool last) {
  for_self_and_nested(*state_, true, [&](State& s) { s.is_last_backward = last; });
}
void FSDPModule::set_gradient_divide_factor(double factor) {
  HP_CHECK(factor >= 0, "gradient divide factor ", factor, " must be positive (0 = average)");
  for_self_and_nested(*state_, true, [&](State& s) { s.divide_factor = factor; });
}
void FSDPModule::set_reduce_op(ReduceOp op) {
  HP_CHECK(op == ReduceOp::AVG || op == ReduceOp::SUM, "fully_shard reduces gradients with avg or sum, not ",
           to_string(op));
  for_self_and_nested(*state_, true, [&](State& s) { s.reduce_op = op; });
}
void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPHandle>& modules) {
  state_->fwd_prefetch.assign(modules.begin(), modules.end());
}
void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPHandle>& modules) {
  state_->bwd_prefetch.assign(modules.begin(), modules.end());
}
void FSDPModule::unshard(bool async) {
  state_->begin_unshard();
  if (!async) state_->finish_unshard();
}
void FSDPModule::wait_for_unshard() { state_->finish_unshard(); }
void FSDPModule::reshard() { state_->do_reshard(); }
bool FSDPModule::is_unsharded() const { return state_->unsharded(); }
bool FSDPModule::unshard_in_flight() const { return state_->gathering(); }
bool FSDPModule::gradients_in_flight() const { return !state_->pending.empty(); }

void FSDPModule::reduce_grads() {
  State& s = *state_;
  HP_CHECK(s.pass == nullptr || !s.pass->callback_queued, "reduce_grads() on ", s.label,
           " inside a backward of its forward; call it after backward() returns (its gradient hooks reduce ",
           "during backward when gradient sync is on)");
  const bool sync = s.requires_sync;
  s.requires_sync = true;
  try {
    s.post_backward(/*again=*/true);
  } catch (...) {
    s.requires_sync = sync;
    throw;
  }
  s.requires_sync = sync;
}

void FSDPModule::finalize_backward() {
  HP_CHECK(state_->pass == nullptr || !state_->pass->callback_queued, "finalize_backward() on ", state_->label,
           " inside a backward of its forward; the end of backward finalizes by itself");
  detail::finish_reductions();
}

}  // namespace hp
