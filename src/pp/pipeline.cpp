#include "hp/pp/pipeline.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <set>

#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"
#include "pipeline_impl.h"

namespace hp::pp {

namespace {

constexpr int kMaxDims = 8;
constexpr int64_t kHeaderLen = 2 + kMaxDims;  // dtype, ndim, dims
constexpr int64_t kFailedStage = -1;          // in the dtype slot: the stage before failed

// The shape and dtype of a stage's output, sent ahead of its first activation.
at::Tensor encode_header(int stage, const at::Tensor& out, const at::TensorOptions& where) {
  HP_CHECK(out.dim() <= kMaxDims, "Pipeline: stage ", stage, "'s output has ", out.dim(), " dims (at most ", kMaxDims,
           " supported)");
  at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
  auto* p = h.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(out.scalar_type());
  p[1] = out.dim();
  for (int64_t d = 0; d < out.dim(); ++d) p[2 + d] = out.size(d);
  return h.to(where.device());
}

}  // namespace

Pipeline::Impl::Impl(const Schedule& schedule, std::vector<PipelineStage> stages, CommPtr group, PipelineLoss loss,
                     const PipelineOptions& options)
    : stages_(std::move(stages)), group_(std::move(group)), loss_(std::move(loss)), options_(options) {
  HP_CHECK(group_ != nullptr, "Pipeline: no pp group");
  HP_CHECK(schedule.ranks == group_->size(), "Pipeline: the schedule is for ", schedule.ranks,
           " ranks, the pp group '", group_->name(), "' has ", group_->size());
  rank_ = group_->rank();
  for (const auto& list : schedule.actions) {
    for (const auto& a : list) split_ = split_ || a.kind == ActionKind::kBackwardInput;
  }
  std::set<int> mine;
  for (const auto& st : stages_) {
    HP_CHECK(st.stage >= 0 && st.stage < schedule.stages, "Pipeline: stage ", st.stage, " is not one of the schedule's ",
             schedule.stages);
    HP_CHECK(schedule.rank_of(st.stage) == rank_, "Pipeline: stage ", st.stage, " runs on pp rank ",
             schedule.rank_of(st.stage), ", this is pp rank ", rank_);
    HP_CHECK(mine.insert(st.stage).second, "Pipeline: stage ", st.stage, " given twice");
    HP_CHECK(st.forward != nullptr, "Pipeline: stage ", st.stage, " has no forward");
    HP_CHECK(!split_ || st.module != nullptr, "Pipeline: stage ", st.stage,
             " has no module: a schedule with split backwards (I, W) needs each stage's module");
    if (st.module) {
      for (const auto& m : st.module->modules(/*include_self=*/true)) {
        if (auto h = fsdp_handle(*m)) fsdp_[st.stage].push_back(h);
        if (split_) watch_weights(*m);
      }
      auto params = st.module->parameters(/*recurse=*/true);
      if (!params.empty() && device_.is_cpu()) device_ = params[0].device();
    }
  }
  // The headers and the few control values move on the CPU where the backend can (mpi),
  // else on the stages' device (nccl moves device tensors only).
  control_ = at::TensorOptions().device(group_->control_device());
  for (int s : schedule.stages_of(rank_)) {
    HP_CHECK(mine.count(s), "Pipeline: the schedule runs stage ", s, " on pp rank ", rank_, ", which was not given");
  }
  HP_CHECK(!holds_stage(schedule.stages - 1) || loss_ != nullptr, "Pipeline: pp rank ", rank_,
           " holds the last stage but no loss function was given");
  // Every rank must run the same lowered schedule: fully_shard verbs where any rank has them.
  at::Tensor any = at::full({1}, fsdp_.empty() ? 0 : 1, control_.dtype(at::kInt));
  group_->all_reduce(any, {ReduceOp::MAX}).wait();
  schedule_ = lower(schedule, LowerOptions{any.item<int>() == 1});
  // One communicator per ordered pair of neighbouring pp ranks (stage s talks only to s - 1
  // and s + 1): its sender only sends on it, its receiver only receives, so a receive posted
  // early waits on its own link without holding up anything else. Made by splitting the pp
  // group, the same list of pairs on every rank.
  const int p = schedule_.ranks;
  std::set<std::pair<int, int>> pairs;
  for (int a = 0; a < p && p > 1; ++a) {
    pairs.insert({a, (a + 1) % p});
    pairs.insert({(a + 1) % p, a});
  }
  for (const auto& [from, to] : pairs) {
    const bool member = rank_ == from || rank_ == to;
    CommOptions o;
    o.name = group_->name() + " " + std::to_string(from) + "->" + std::to_string(to);
    CommPtr c = group_->split(member ? 1 : -1, rank_ == from ? 0 : 1, o);  // the sender is rank 0 of it
    if (rank_ == from) send_link_[to] = c;
    if (rank_ == to) recv_link_[from] = c;
  }
}

Pipeline::Impl::~Impl() {
  for (HookHandle h : hooks_) remove_forward_hooks(h);
}

Pipeline::Pipeline(const Schedule& schedule, std::vector<PipelineStage> stages, CommPtr group, PipelineLoss loss,
                   const PipelineOptions& options)
    : impl_(std::make_unique<Impl>(schedule, std::move(stages), std::move(group), std::move(loss), options)) {}
Pipeline::~Pipeline() = default;
at::Tensor Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) { return impl_->step(inputs, targets); }
at::Tensor Pipeline::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  return impl_->evaluate(inputs, targets);
}
const Schedule& Pipeline::schedule() const { return impl_->schedule_; }
bool Pipeline::holds_stage(int stage) const { return impl_->holds_stage(stage); }
int Pipeline::rank() const { return impl_->rank_; }

bool Pipeline::Impl::holds_stage(int s) const {
  return std::any_of(stages_.begin(), stages_.end(), [&](const PipelineStage& st) { return st.stage == s; });
}

PipelineStage& Pipeline::Impl::stage(int s) {
  for (auto& st : stages_) {
    if (st.stage == s) return st;
  }
  HP_INTERNAL_ASSERT(false, "stage ", s, " not held (validated schedule)");
  return stages_.front();
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> Pipeline::Impl::micro_batches(const at::Tensor& inputs,
                                                                                    const at::Tensor& targets,
                                                                                    const char* caller) {
  HP_CHECK(!broken_, "Pipeline::", caller, ": an earlier step failed part way; its transfers may still be posted on ",
           "the links and fully_shard's settings changed, so this pipeline cannot run again (build a new one)");
  const int m = schedule_.microbatches;
  auto split = [&](const at::Tensor& t, const char* what) {
    std::vector<at::Tensor> out;
    if (!t.defined()) return out;
    HP_CHECK(t.dim() >= 1 && t.size(0) % m == 0, "Pipeline::", caller, ": ", what, " of ",
             t.dim() >= 1 ? t.size(0) : 0, " rows does not split into ", m, " equal micro-batches");
    return t.split(t.size(0) / m);
  };
  auto in_mb = split(inputs, "inputs");
  auto tgt_mb = split(targets, "targets");
  HP_CHECK(!holds_stage(0) || !in_mb.empty(), "Pipeline::", caller, ": pp rank ", rank_,
           " holds the first stage and needs the inputs");
  HP_CHECK(!holds_stage(schedule_.stages - 1) || !tgt_mb.empty(), "Pipeline::", caller, ": pp rank ", rank_,
           " holds the last stage and needs the targets");
  if (!shapes_checked_) {
    check_shapes(in_mb, tgt_mb);
    shapes_checked_ = true;
  }
  loss_sum_ = at::Tensor();
  input_meta_.clear();
  header_sent_.clear();
  return {std::move(in_mb), std::move(tgt_mb)};
}

void Pipeline::Impl::abandon() {
  broken_ = true;
  stop_recording();
  weight_grads_.clear();
  module_outputs_.clear();
  sends_.clear();
  pending_input_.clear();
  pending_grad_.clear();
  input_.clear();
  output_.clear();
  grad_output_.clear();
}

at::Tensor Pipeline::Impl::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const auto [in_mb, tgt_mb] = micro_batches(inputs, targets, "step");
  const auto& list = schedule_.actions[rank_];
  try {
    for (size_t i = 0; i < list.size();) {
      const Action& a = list[i];
      if (a.is_comm()) {
        run_transfer(a);
      } else if (a.paired && i + 1 < list.size() && list[i + 1].is_compute()) {
        run_pair(a, list[i + 1], in_mb, tgt_mb);
        ++i;
      } else if (a.is_compute()) {
        run_compute(a, in_mb, tgt_mb);
      } else {
        run_fsdp(a);
      }
      ++i;
    }
    for (auto& w : sends_) w.wait();
  } catch (...) {
    abandon();
    throw;
  }
  sends_.clear();
  HP_INTERNAL_ASSERT(input_.empty() && output_.empty() && grad_output_.empty() && weight_grads_.empty() &&
                         module_outputs_.empty(),
                     "pipeline step ended with tensors of unfinished micro-batches");
  return loss_sum_;
}

at::Tensor Pipeline::Impl::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  const auto [in_mb, tgt_mb] = micro_batches(inputs, targets, "evaluate");
  const int m = schedule_.microbatches, last = schedule_.stages - 1;
  at::NoGradGuard no_grad;
  try {
    for (int s : schedule_.stages_of(rank_)) {
      auto handles = fsdp_.find(s);
      if (handles != fsdp_.end()) {
        for (auto& h : handles->second) {
          h->set_reshard_after_forward(false, /*recurse=*/false);
          h->unshard(/*async=*/true);
        }
        for (auto& h : handles->second) h->wait_for_unshard();
      }
      for (int j = 0; j < m; ++j) {
        const Key k{s, j};
        at::Tensor in;
        if (s == 0) {
          in = in_mb[static_cast<size_t>(j)];
        } else {
          if (!holds_stage(s - 1)) {
            run_transfer(Action{s, ActionKind::kRecvForward, j});
            await(pending_input_, k, /*make_leaf=*/false);
          }
          auto it = input_.find(k);
          HP_INTERNAL_ASSERT(it != input_.end(), "no input for stage ", s, " micro-batch ", j);
          in = it->second;
          input_.erase(it);
        }
        at::Tensor out;
        {
          trace::Span span("pp evaluate " + Action{s, ActionKind::kForward, j}.to_string(), "compute");
          try {
            out = stage(s).forward(in);
          } catch (const std::exception& e) {
            throw Error(detail::str_cat("Pipeline: stage ", s, "'s forward of micro-batch ", j,
                                        " (evaluate) failed on its input of shape ", in.sizes(), ": ", e.what()));
          }
        }
        if (s == last) {
          at::Tensor l = loss_(out, tgt_mb[static_cast<size_t>(j)]) / m;
          HP_CHECK(l.numel() == 1, "Pipeline: the loss of stage ", s, " micro-batch ", j, " has ", l.numel(),
                   " elements, not one");
          loss_sum_ = loss_sum_.defined() ? loss_sum_ + l : l;
        } else if (holds_stage(s + 1)) {
          input_[Key{s + 1, j}] = out;
        } else {
          output_[k] = out;
          run_transfer(Action{s, ActionKind::kSendForward, j});
          output_.erase(k);
        }
      }
      if (handles != fsdp_.end()) {
        for (auto& h : handles->second) {
          h->reshard();
          h->set_reshard_after_forward(true, /*recurse=*/false);  // as the step's REDUCE_GRAD leaves it
        }
      }
    }
    for (auto& w : sends_) w.wait();
  } catch (...) {
    abandon();
    throw;
  }
  sends_.clear();
  HP_INTERNAL_ASSERT(input_.empty() && output_.empty(), "pipeline evaluation ended with unused activations");
  return loss_sum_;
}

Pipeline::Impl::Meta Pipeline::Impl::decode_header(const at::Tensor& header) {
  const at::Tensor h = header.cpu();
  const auto* p = h.data_ptr<int64_t>();
  if (p[0] == kFailedStage) return Meta{at::kFloat, {}, /*failed=*/true};
  return Meta{static_cast<at::ScalarType>(p[0]), std::vector<int64_t>(p + 2, p + 2 + p[1])};
}

// Before the first step, micro-batch 0 goes through every stage once without gradients, in
// stage order, each stage handing its output's shape to the next, which runs on zeros of that
// shape (the last one also runs the loss on the targets). A stage that does not fit the one
// before it fails here, before any transfer of the step; the stages after it are told to skip,
// and every rank learns the outcome in one collective, so none is left waiting for a transfer
// that will never come. Nothing of the check stays: the generator and the stage modules'
// buffers (running statistics, MoE load counts) are put back as they were.
void Pipeline::Impl::check_shapes(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) {
  trace::Span span("pp shape check", "compute");
  const int last = schedule_.stages - 1;
  PointToPointOptions o;
  o.tag = 0;  // every message of the check is received before the step's first one
  std::map<int, at::Tensor> local_header;  // of stages whose next stage is here too
  std::vector<Work> sends;
  std::string error;
  int failed = -1;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor rng_state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_state = gen.get_state();
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // each buffer, and its value now
  for (const auto& st : stages_) {
    if (st.module == nullptr) continue;
    for (const auto& b : st.module->buffers(/*recurse=*/true)) {
      if (b.defined()) buffers.emplace_back(b, b.clone());
    }
  }
  {
    at::NoGradGuard no_grad;
    for (int s : schedule_.stages_of(rank_)) {
      at::Tensor in;
      bool skip = false;
      if (s == 0) {
        in = inputs[0];
      } else {
        at::Tensor h;
        if (holds_stage(s - 1)) {
          h = local_header.at(s - 1);
        } else {
          h = at::empty({kHeaderLen}, control_.dtype(at::kLong));
          recv_link_.at(schedule_.rank_of(s - 1))->recv(h, 0, o).wait();
        }
        const Meta m = decode_header(h);
        skip = m.failed;
        if (!skip) in = at::zeros(m.shape, at::TensorOptions().dtype(m.dtype).device(device_));
      }
      at::Tensor out;
      if (!skip) {
        try {
          if (s == last && stage(s).targets) stage(s).targets(targets[0]);
          out = stage(s).forward(in);
        } catch (const std::exception& e) {
          failed = s;
          error = detail::str_cat("Pipeline: stage ", s, "'s forward of micro-batch 0 failed on its input of shape ",
                                  in.sizes(), " (", in.scalar_type(), ")",
                                  s > 0 ? detail::str_cat(", stage ", s - 1, "'s output") : std::string(),
                                  ", in the shape check before the first step: ", e.what());
        }
        if (failed < 0 && s == last) {
          try {
            loss_(out, targets[0]);
          } catch (const std::exception& e) {
            failed = s;
            error = detail::str_cat("Pipeline: the loss of the last stage's output of shape ", out.sizes(),
                                    " and targets of shape ", targets[0].sizes(),
                                    " failed in the shape check before the first step: ", e.what());
          }
        }
      }
      if (s == last) continue;
      const at::Tensor marker = at::full({kHeaderLen}, kFailedStage, control_.dtype(at::kLong));
      at::Tensor h = marker;
      if (failed != s && !skip) {
        try {
          h = encode_header(s, out, control_);  // raises for an output it cannot describe
        } catch (const std::exception& e) {
          failed = s;
          error = e.what();
        }
      }
      if (holds_stage(s + 1)) {
        local_header[s] = h;
      } else {
        sends.push_back(send_link_.at(schedule_.rank_of(s + 1))->send(h, 1, o));
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng_state);
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [b, was] : buffers) b.copy_(was);
  }
  for (auto& w : sends) w.wait();
  at::Tensor worst = at::full({1}, failed, control_.dtype(at::kInt));
  group_->all_reduce(worst, {ReduceOp::MAX}).wait();
  const int bad = worst.item<int>();
  if (bad < 0) return;
  HP_CHECK(error.empty(), error);
  HP_CHECK(false, "Pipeline: stage ", bad, " (pp rank ", schedule_.rank_of(bad), ") failed in the shape check before ",
           "the first step; that rank's error names the shapes");
}

void Pipeline::Impl::run_transfer(const Action& a) {
  const Key k{a.stage, a.microbatch};
  const int peer = schedule_.rank_of(a.peer_stage());
  const int tag = transfer_tag(schedule_, a);
  PointToPointOptions o;
  o.tag = tag;
  switch (a.kind) {
    case ActionKind::kSendForward: {
      const CommPtr& link = send_link_.at(peer);
      at::Tensor out = output_.at(k).detach().contiguous();
      if (header_sent_.insert(a.stage).second) {
        // The header first, with the stage's first activation sent this step (the link carries
        // them in the order the receiver posts them, so that is also its first receive): the
        // receiver learns the shape and dtype of the stage's input.
        sends_.push_back(link->send(encode_header(a.stage, out, control_), 1, o));
      }
      sends_.push_back(link->send(out, 1, o));  // its tensor stays alive in the op
      break;
    }
    case ActionKind::kSendBackward: {
      auto in = input_.find(k);
      HP_INTERNAL_ASSERT(in != input_.end(), "no input to send the gradient of for ", a.to_string());
      at::Tensor g = in->second.grad();
      sends_.push_back(send_link_.at(peer)->send(g.defined() ? g.contiguous() : at::zeros_like(in->second), 1, o));
      input_.erase(in);
      break;
    }
    case ActionKind::kRecvForward: {
      const CommPtr& link = recv_link_.at(peer);
      if (!input_meta_.count(a.stage)) {  // the stage's first receive this step: the header first
        at::Tensor h = at::empty({kHeaderLen}, control_.dtype(at::kLong));
        {
          trace::Span span("pp wait header", "wait");
          link->recv(h, 0, o).wait();
        }
        input_meta_[a.stage] = decode_header(h);
      }
      auto meta = input_meta_.find(a.stage);
      HP_INTERNAL_ASSERT(meta != input_meta_.end(), "no header for ", a.to_string());
      at::Tensor buf = at::empty(meta->second.shape, at::TensorOptions().dtype(meta->second.dtype).device(device_));
      input_[k] = buf;
      pending_input_[k] = std::make_shared<Work>(link->recv(buf, 0, o));
      break;
    }
    case ActionKind::kRecvBackward: {
      const at::Tensor& out = output_.at(k);
      at::Tensor buf = at::empty(out.sizes(), out.options().requires_grad(false));
      grad_output_[k] = buf;
      pending_grad_[k] = std::make_shared<Work>(recv_link_.at(peer)->recv(buf, 0, o));
      break;
    }
    default:
      HP_INTERNAL_ASSERT(false, "not a transfer: ", a.to_string());
  }
}

void Pipeline::Impl::await(std::map<Key, std::shared_ptr<Work>>& pending, const Key& k, bool make_leaf) {
  auto it = pending.find(k);
  if (it == pending.end()) return;
  {
    trace::Span span("pp wait recv", "wait");
    it->second->wait();
  }
  pending.erase(it);
  if (make_leaf) {
    at::Tensor& t = input_.at(k);
    if (t.is_floating_point()) t.requires_grad_(true);
  }
}

void Pipeline::Impl::run_fsdp(const Action& a) {
  auto it = fsdp_.find(a.stage);
  if (it == fsdp_.end()) return;  // this stage has no fully_shard'ed modules (another rank's have)
  auto& handles = it->second;
  switch (a.kind) {
    case ActionKind::kUnshard:
      for (auto& h : handles) {
        h->set_reshard_after_forward(false, /*recurse=*/false);
        h->set_reshard_after_backward(false, /*recurse=*/false);
        h->set_requires_gradient_sync(false, /*recurse=*/false);
        h->unshard(/*async=*/true);
      }
      for (auto& h : handles) h->wait_for_unshard();
      break;
    case ActionKind::kReduceGrad:
      for (auto& h : handles) h->reduce_grads();
      for (auto& h : handles) {
        h->finalize_backward();
        h->set_requires_gradient_sync(true, /*recurse=*/false);
        h->set_reshard_after_backward(true, /*recurse=*/false);
        h->set_reshard_after_forward(true, /*recurse=*/false);
      }
      break;
    case ActionKind::kReshard:
      for (auto& h : handles) h->reshard();
      break;
    default:
      HP_INTERNAL_ASSERT(false, "not a fully_shard verb: ", a.to_string());
  }
}

}  // namespace hp::pp
