// Private: fully_shard's per-parameter state. For each parameter of a group: its shard
// (the optimizer's leaf), the module's own tensor whose storage unshard and reshard give
// and take, and the gradients kept between backwards; and the records of the group's
// reductions in flight.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "buffers.h"
#include "hp/comm/communicator.h"
#include "hp/fsdp/shard_plan.h"

namespace torch::autograd {
struct Node;
}

namespace hp::detail {

struct ParamInfo {
  std::string name;
  UnshardedParam param;  // the module's own tensor: unsharded view, identity kept
  std::vector<int64_t> shape;
  ShardPlan plan;
  bool requires_grad = false;
  // FullyShardOptions::wait_per_submodule: which of the group's submodules owns the
  // parameter (index into State::submodules; -1: the module itself, several, or a frozen
  // parameter), whether its forward all-gather is still to be waited for, and how many
  // autograd edges reached its gradient accumulator when that gather was issued (one more
  // by the wait means a read of the parameter before it).
  int submodule = -1;
  bool gather_pending = false;
  long uses_at_gather = 0;
  OwnedBuffer padded;  // [rows_per_shard, rest...] in the param dtype; never released
  at::Tensor sharded;  // leaf view of the real rows of `padded`: the optimizer's
  std::shared_ptr<torch::autograd::Node> accumulator;
  bool grad_ready = false;
  OwnedBuffer unsharded_acc;  // gradients kept across no-sync micro-steps
  OwnedBuffer sharded_acc;    // reduced shards kept across steps without all-reduce
  OwnedBuffer main_grad;      // fp32 main gradient of the real rows; never released
  // The gradient tensor last set on `sharded` and its version then: if the optimizer
  // cleared or zeroed it since, the main gradient starts again from zero.
  at::Tensor grad_set;
  int64_t grad_set_version = -1;
};

// Which of a group's parameters got a gradient on any rank this step (1) or on none (0):
// reduced with MAX over dp_shard before the gradients' reduce-scatter, then over
// dp_replicate before their all-reduce. A parameter no rank produced a gradient for is
// still reduced (as zeros, so every rank issues the same collectives) but its result is not
// applied: its .grad stays as one process leaves it (undefined after zero_grad(set_to_none)).
struct GradFlags {
  at::Tensor flags;  // int32 [params of the group]
  Work shard_w, replicate_w;
  bool replicate_issued = false;
  std::vector<int32_t> host;  // `flags` once every reduction of it is waited for
  const std::vector<int32_t>& wait() {
    if (host.empty()) {
      shard_w.wait();
      if (replicate_issued) replicate_w.wait();
      at::Tensor c = flags.cpu();
      host.assign(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel());
    }
    return host;
  }
};

struct PendingReduce {
  int param = -1;      // -1: the whole group (fused)
  std::shared_ptr<GradFlags> flags;  // shared by the group's reductions of this backward
  // The reduce-scatter's input (a buffer of ours, or autograd's gradient itself) is held
  // by the op alone, which drops it the moment it completes.
  OwnedBuffer output;  // reduce-scatter output = all-reduce bucket
  Work rs;
  Work ar;
  bool ar_issued = false;
  bool rs_done = false;  // reduce-scatter waited for (the op has dropped its input)
  bool applied = false;  // gradients left on the shards, output released
};

}  // namespace hp::detail
