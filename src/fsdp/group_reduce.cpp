// A parameter group's gradients: the reduce-scatter over dp_shard (fused or per
// parameter), the all-reduce over dp_replicate, and leaving the results on the shards.
#include <ATen/ATen.h>

#include <memory>

#include "collectives.h"
#include "comm_context.h"
#include "group.h"
#include "hp/core/trace.h"

namespace hp {

using detail::GradFlags;
using detail::OwnedBuffer;
using detail::ParamInfo;
using detail::PendingReduce;

void FSDPModule::State::reduce_and_reshard() {
  issue_ready_all_reduces();
  const bool reshard_now = reshard_after_backward && is_last_backward;
  if (!has_grads()) {
    if (reshard_now) do_reshard();
    return;
  }
  trace::Span span("post_backward " + label, "fsdp");
  const at::ScalarType rd = dt.reduce;
  // The gradient of each parameter as a flat tensor (zeros when it got none), plus what
  // earlier no-sync micro-steps accumulated. Borrowed: read only.
  auto flat_grad = [&](ParamInfo& p) -> at::Tensor {
    at::Tensor g = p.param.tensor().grad();
    at::Tensor flat;
    if (g.defined()) flat = g.reshape({-1});
    if (p.unsharded_acc.defined()) {
      flat = flat.defined() ? p.unsharded_acc.tensor().add(flat) : p.unsharded_acc.tensor();
    }
    return flat;
  };
  if (!requires_sync) {
    for (auto& p : params) {
      if (!p.requires_grad || !p.param.tensor().grad().defined()) continue;
      if (!p.unsharded_acc.defined()) p.unsharded_acc = OwnedBuffer::zeros({p.plan.numel()}, dt.unsharded_accumulate, device);
      p.unsharded_acc.tensor().add_(p.param.tensor().grad().reshape({-1}));
      p.param.tensor().mutable_grad() = at::Tensor();  // drop our reference; autograd's tensor is not freed here
    }
    if (reshard_now) do_reshard();
    return;
  }
  const ReduceOp op = grad_reduce_op();
  const int n = shards();
  if (n == 1 && !hsdp()) {
    // A world of one data-parallel rank: the reduction is the cast to the reduce dtype.
    for (auto& p : params) {
      if (!p.requires_grad) continue;
      at::Tensor g = flat_grad(p);
      if (!g.defined()) continue;  // no gradient: .grad stays as one process leaves it
      apply_reduced(p, g.to(rd).view(p.sharded.sizes()));
      p.param.tensor().mutable_grad() = at::Tensor();  // drop our reference only
      p.unsharded_acc.release();
    }
    if (reshard_now) do_reshard();
    return;
  }
  // Which parameters got a gradient, reduced over the ranks ahead of the gradients.
  auto flags = std::make_shared<GradFlags>();
  {
    std::vector<int32_t> local(params.size(), 0);
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      local[i] = (p.requires_grad && (p.param.tensor().grad().defined() || p.unsharded_acc.defined())) ? 1 : 0;
    }
    flags->flags = at::tensor(local, at::kInt).to(device);
    flags->shard_w = shard->all_reduce(flags->flags, {ReduceOp::MAX});
  }
  if (opts.comm_fusion) {
    PendingReduce pr;
    pr.flags = flags;
    OwnedBuffer input = OwnedBuffer::zeros({n, layout.total}, rd, device);
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      if (!p.requires_grad) continue;
      at::Tensor g = flat_grad(p);
      if (g.defined()) detail::scatter_padded(input.tensor().narrow(1, layout.offsets[i], p.plan.shard_numel()), g);
      // Copied: let go of the gradient now, so the group's gradients and the fused
      // buffer coexist one parameter at a time rather than whole.
      p.param.tensor().mutable_grad() = at::Tensor();
      p.unsharded_acc.release();
    }
    pr.output = OwnedBuffer::empty({layout.total}, rd, device);
    pr.rs = shard->reduce_scatter(pr.output.tensor(), input.hand_to_op(), {op});
    pending.push_back(std::move(pr));
  } else {
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      if (!p.requires_grad) continue;
      PendingReduce pr;
      pr.param = static_cast<int>(i);
      pr.flags = flags;
      at::Tensor g = flat_grad(p);
      pr.output = OwnedBuffer::empty({p.plan.shard_numel()}, rd, device);
      if (g.defined() && !p.unsharded_acc.defined() && g.scalar_type() == rd && g.is_contiguous() &&
          p.plan.padded_numel() == p.plan.numel()) {
        // Already the reduce-scatter's input (right dtype, no padding): borrow it. It is
        // only read, and the op drops its reference when it completes.
        pr.rs = shard->reduce_scatter(pr.output.tensor(), g, {op});
      } else {
        OwnedBuffer input = OwnedBuffer::zeros({p.plan.padded_numel()}, rd, device);
        if (g.defined()) input.tensor().narrow(0, 0, p.plan.numel()).copy_(g);
        pr.rs = shard->reduce_scatter(pr.output.tensor(), input.hand_to_op(), {op});
      }
      pending.push_back(std::move(pr));
    }
  }
  for (auto& p : params) {
    if (!p.requires_grad) continue;
    p.param.tensor().mutable_grad() = at::Tensor();  // drop our reference only
    p.unsharded_acc.release();
  }
  detail::comm_context().reduce_order.push_back(this);
  if (!overlap()) {
    trace::Span wait("wait reduce_scatter " + label, "wait");
    for (auto& pr : pending) pr.rs.wait();
  }
  if (reshard_now) do_reshard();
}

// Folds the partial shards kept by steps without all-reduce into this reduction, then
// all-reduces it over dp_replicate.
void FSDPModule::State::issue_all_reduce(PendingReduce& pr) {
  if (pr.flags && !pr.flags->replicate_issued) {
    // Partials kept from steps without all-reduce count as gradients too (checked for the
    // whole group at its first all-reduce, before any of them is folded in).
    pr.flags->shard_w.wait();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].sharded_acc.defined()) pr.flags->flags[static_cast<int64_t>(i)].fill_(1);
    }
    pr.flags->replicate_w = replicate->all_reduce(pr.flags->flags, {ReduceOp::MAX});
    pr.flags->replicate_issued = true;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if ((pr.param >= 0 && pr.param != static_cast<int>(i)) || !p.sharded_acc.defined()) continue;
    at::Tensor seg = pr.param >= 0 ? pr.output.tensor()
                                   : pr.output.tensor().narrow(0, layout.offsets[i], p.plan.shard_numel());
    seg.add_(p.sharded_acc.tensor());
    p.sharded_acc.release();
  }
  pr.ar = replicate->all_reduce(pr.output.tensor(), {grad_reduce_op()});
  pr.ar_issued = true;
}

void FSDPModule::State::issue_ready_all_reduces() {
  detail::drain_reductions(detail::kReductionsInFlight - 1, /*finish=*/false);
}

// Leaves a reduced gradient (this rank's real rows, any dtype) on the sharded parameter:
// in its main gradient, or added to its .grad (a copy: `g` may be a borrowed tensor).
void FSDPModule::State::apply_reduced(ParamInfo& p, at::Tensor g) {
  if (divide_factor > 0) g = g / divide_factor;
  if (dt.main_grad) {
    at::Tensor cur = p.sharded.grad();
    if (!cur.defined() || !cur.is_same(p.grad_set) || cur._version() != p.grad_set_version) {
      p.main_grad.tensor().zero_();
    }
    p.main_grad.tensor().add_(g);
    // fp32 shards step with the main gradient itself; lower-precision shards get a
    // rounded copy (FP32MasterOptimizer steps fp32 masters with the main gradient).
    p.grad_set = p.sharded.scalar_type() == at::kFloat
                     ? p.main_grad.tensor()
                     : p.main_grad.tensor().to(p.sharded.scalar_type(), false, /*copy=*/true);
    p.sharded.mutable_grad() = p.grad_set;
    p.grad_set_version = p.grad_set._version();
  } else if (!p.sharded.grad().defined()) {
    p.sharded.mutable_grad() = g.to(dt.sharded_grad, /*non_blocking=*/false, /*copy=*/true);
  } else {
    p.sharded.mutable_grad().add_(g);
  }
}

// Leaves one completed reduction's gradients on the shards (or keeps them as partials
// when the dp_replicate all-reduce is skipped this step).
void FSDPModule::State::apply_pending(PendingReduce& pr) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (pr.param >= 0 && pr.param != static_cast<int>(i)) continue;
    auto& p = params[i];
    if (!p.requires_grad) continue;
    if (pr.flags && pr.flags->wait()[i] == 0) continue;  // no rank had a gradient for it
    at::Tensor seg = pr.param >= 0 ? pr.output.tensor()
                                   : pr.output.tensor().narrow(0, layout.offsets[i], p.plan.shard_numel());
    if (hsdp() && !requires_all_reduce) {
      // Keep the partial (not yet all-reduced) shard for the next step that all-reduces.
      if (!p.sharded_acc.defined()) {
        p.sharded_acc = OwnedBuffer::zeros({p.plan.shard_numel()}, dt.sharded_accumulate, device);
      }
      p.sharded_acc.tensor().add_(seg);
      continue;
    }
    apply_reduced(p, seg.narrow(0, 0, p.plan.rows * p.plan.row_numel).view(p.sharded.sizes()));
  }
}

}  // namespace hp
