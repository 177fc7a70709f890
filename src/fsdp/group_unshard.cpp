// A parameter group's storage: unshard (all-gather into the module's own tensors) and
// reshard (free them, or keep a post-forward share), and the storage-state machine.
#include <ATen/ATen.h>

#include <functional>

#include "collectives.h"
#include "comm_context.h"
#include "group.h"
#include "hp/core/error.h"
#include "hp/core/trace.h"

namespace hp {

using detail::OwnedBuffer;
using detail::ShardState;
using detail::TrainingState;

namespace detail {
const char* to_string(ShardState s) {
  switch (s) {
    case ShardState::kSharded: return "sharded";
    case ShardState::kPostForwardShare: return "post-forward share";
    case ShardState::kGathering: return "gathering";
    case ShardState::kUnsharded: return "unsharded";
  }
  return "?";
}
}  // namespace detail

void FSDPModule::State::move_to(ShardState to) {
  const ShardState from = storage;
  bool legal = false;
  switch (from) {
    case ShardState::kSharded: legal = to == ShardState::kGathering || to == ShardState::kUnsharded; break;
    case ShardState::kPostForwardShare: legal = to == ShardState::kGathering || to == ShardState::kSharded; break;
    case ShardState::kGathering: legal = to == ShardState::kUnsharded; break;
    case ShardState::kUnsharded: legal = to == ShardState::kSharded || to == ShardState::kPostForwardShare; break;
  }
  HP_CHECK(legal, "fully_shard(", label, "): internal error: its parameters went from ", detail::to_string(from),
           " to ", detail::to_string(to));
  // Freeing the parameters under a running forward leaves it reading freed storage.
  HP_CHECK(!(from == ShardState::kUnsharded && training == TrainingState::kForward), "fully_shard(", label,
           "): its parameters cannot go from ", detail::to_string(from), " to ", detail::to_string(to),
           " in training state ", detail::to_string(training),
           ": its forward is still running (reshard() called from inside it?)");
  storage = to;
}

void FSDPModule::State::begin_unshard(bool backward, bool behind_reductions) {
  if (unsharded() || gathering()) return;
  if (aliased() || params.empty()) {  // nothing to gather (a root whose children own every parameter)
    move_to(ShardState::kUnsharded);
    return;
  }
  // Collectives must reach each communicator in the same order on every rank: whatever
  // prefetch was held back goes first (this module's own, perhaps, over the group it would
  // have used at a gradient hook), as it would have without the holding back. (A gather
  // behind the reductions is itself one of those, issued in their order.)
  if (!behind_reductions) detail::issue_deferred_prefetches(/*wait=*/true);
  if (gathering()) return;
  // Post-forward shards serve only the backward of their own iteration: another gather (a
  // forward, an explicit unshard, a later step's prefetch) may come after an optimizer step.
  if (!backward || pass == nullptr || post_fwd_iteration != pass->id) drop_post_forward_share();
  trace::Span span("unshard " + label, "fsdp");
  const at::ScalarType cd = dt.all_gather;
  const int64_t es = c10::elementSize(cd);
  ag_works.clear();
  post_gather_fused = false;
  lazy_gather = false;
  if (storage == ShardState::kPostForwardShare) {
    // From the post-forward shards, over the smaller group. The ops own the buffer now
    // (views of it when per parameter) and free it as they complete.
    HP_INTERNAL_ASSERT(!behind_reductions, "fully_shard(", label, "): a gather behind reductions from ",
                       detail::to_string(storage));
    for (auto& p : params) p.param.allocate(p.plan.padded_numel() * es);
    const int64_t g = post_group->size();
    if (opts.comm_fusion) {
      ag_out = OwnedBuffer::empty({g * post_total}, cd, device);
      ag_works.push_back(post_group->all_gather(ag_out.tensor(), post_fwd.hand_to_op()));
      post_gather_fused = true;
    } else {
      at::Tensor buf = post_fwd.hand_to_op();
      for (size_t i = 0; i < params.size(); ++i) {
        const int64_t len = params[i].plan.padded_numel() / g;
        ag_works.push_back(post_group->all_gather(params[i].param.raw({params[i].plan.padded_numel()}, cd),
                                                  buf.narrow(0, post_offsets[i], len)));
      }
    }
    move_to(ShardState::kGathering);
    return;
  }
  // From the real shards. Each op's output (the parameters' storage, and the fused buffer)
  // is made by `make`: here and now, or, behind reduce-scatters in flight on the same
  // communicator (comm_context.h), by the op as it starts, once they have completed and
  // freed their inputs.
  auto issue = [&](std::function<at::Tensor()> make, const at::Tensor& in) {
    ag_works.push_back(behind_reductions ? shard->all_gather_into_new(std::move(make), in)
                                         : shard->all_gather(make(), in));
  };
  if (opts.comm_fusion) {
    std::vector<at::Tensor> padded;
    for (const auto& p : params) padded.push_back(p.padded.tensor());
    ag_in = detail::fused_gather_input(padded, layout, cd);
    const int64_t n = shards() * layout.total;
    issue(
        [this, n, es, cd] {
          for (auto& p : params) p.param.allocate(p.plan.padded_numel() * es);
          ag_out = OwnedBuffer::empty({n}, cd, device);
          return ag_out.tensor();
        },
        ag_in.tensor());
  } else {
    // A forward's gather under wait_per_submodule: each parameter is waited for when its
    // submodule is called (finish_param); the edges into its gradient accumulator now tell
    // a read before that.
    lazy_gather = opts.wait_per_submodule && !backward && !behind_reductions && at::GradMode::is_enabled();
    for (auto& p : params) {
      p.gather_pending = lazy_gather;
      if (lazy_gather) p.uses_at_gather = p.accumulator ? p.accumulator.use_count() : 0;
      at::Tensor in = p.padded.tensor().view(-1);
      if (in.scalar_type() != cd) in = in.to(cd);
      const detail::UnshardedParam* param = &p.param;
      const int64_t numel = p.plan.padded_numel();
      issue(
          [param, numel, es, cd] {
            param->allocate(numel * es);
            return param->raw({numel}, cd);
          },
          in);
    }
  }
  move_to(ShardState::kGathering);
}

void FSDPModule::State::drop_post_forward_share() {
  if (storage != ShardState::kPostForwardShare) return;
  post_fwd.release();
  move_to(ShardState::kSharded);
}

namespace {
// Where parameter p is waited for under wait_per_submodule, for errors.
std::string waited_in(const detail::ParamInfo& p, const std::vector<std::string>& submodules) {
  return p.submodule < 0 ? std::string("the module's own start")
                         : "submodule " + submodules[static_cast<size_t>(p.submodule)];
}

// A parameter whose gather is pending is read before its wait when an autograd edge into
// its gradient accumulator appeared since the gather was issued.
bool read_early(const detail::ParamInfo& p) {
  return p.gather_pending && p.accumulator && p.accumulator.use_count() > p.uses_at_gather;
}
}  // namespace

std::string FSDPModule::State::read_before_gather(int only) const {
  std::string names;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if ((only >= 0 && static_cast<int>(i) != only) || !read_early(p)) continue;
    names += detail::str_cat(names.empty() ? "" : ", ", "'", p.name, "' (waited for at ", waited_in(p, submodules), ")");
  }
  return names;
}

void FSDPModule::State::check_not_read_early(const std::string& names) const {
  HP_CHECK(names.empty(), "fully_shard(", label, ") with wait_per_submodule: parameter(s) ", names,
           " read before that wait, while the all-gather was in flight (or read without the submodule's call); ",
           "use a submodule's parameters only in or after hp::call(submodule, inputs...), or set ",
           "wait_per_submodule false");
}

void FSDPModule::State::finish_param(size_t i) {
  detail::ParamInfo& p = params[i];
  if (!gathering() || !lazy_gather || !p.gather_pending) return;
  const std::string read = read_before_gather(static_cast<int>(i));
  {
    trace::Span wait("wait all_gather " + label + " " + p.name, "wait");
    ag_works[i].wait();
  }
  p.gather_pending = false;
  check_not_read_early(read);
}

void FSDPModule::State::finish_submodule(int k) {
  if (!gathering() || !lazy_gather) return;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].submodule == k) finish_param(i);
  }
}

void FSDPModule::State::finish_unshard() {
  if (!gathering()) return;
  {
    trace::Span wait("wait all_gather " + label, "wait");
    for (auto& w : ag_works) w.wait();
  }
  ag_works.clear();
  if (lazy_gather) {
    for (auto& p : params) p.gather_pending = false;
    lazy_gather = false;
  }
  trace::Span copy("copy out all_gather " + label, "fsdp");
  if (post_gather_fused) {
    const int64_t g = post_group->size();
    std::vector<at::Tensor> dests;
    for (const auto& p : params) dests.push_back(p.param.raw({g, p.plan.padded_numel() / g}, dt.all_gather));
    detail::copy_out_gathered(ag_out.tensor().view({g, post_total}), post_offsets, dests);
    ag_out.release();
    post_gather_fused = false;
  } else if (opts.comm_fusion) {
    std::vector<at::Tensor> dests;
    for (const auto& p : params) dests.push_back(p.param.raw({shards(), p.plan.shard_numel()}, dt.all_gather));
    detail::copy_out_gathered(ag_out.tensor().view({shards(), layout.total}), layout.offsets, dests);
    ag_in.release();
    ag_out.release();
  }
  move_to(ShardState::kUnsharded);
}

void FSDPModule::State::do_reshard() {
  kept_for_backward = false;
  finish_unshard();
  drop_post_forward_share();
  if (!unsharded() || aliased()) return;
  move_to(ShardState::kSharded);
  for (auto& p : params) p.param.free();
}

void FSDPModule::State::reshard_after_forward_now() {
  // Without grad mode no backward follows: nothing to keep the group's shares for.
  if (post_group && at::GradMode::is_enabled()) {
    reshard_to_group();
  } else {
    do_reshard();
  }
}

// After forward with a group size: keep this rank's slice of each unsharded parameter
// (its index in the group picks the slice), then free the unsharded storage.
void FSDPModule::State::reshard_to_group() {
  kept_for_backward = false;
  finish_unshard();
  if (!unsharded() || aliased()) return;
  const int64_t g = post_group->size(), j = post_group->rank();
  OwnedBuffer keep = OwnedBuffer::empty({post_total}, dt.all_gather, device);
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t len = params[i].plan.padded_numel() / g;
    keep.tensor().narrow(0, post_offsets[i], len)
        .copy_(params[i].param.raw({g, len}, dt.all_gather)[j]);
  }
  move_to(ShardState::kPostForwardShare);
  for (auto& p : params) p.param.free();
  post_fwd = std::move(keep);
  post_fwd_iteration = pass->id;
}

}  // namespace hp
