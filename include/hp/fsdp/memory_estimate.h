// Per-rank memory of training a model under fully_shard, from its sizes alone: nothing
// is allocated. The terms match what BENCHMARKS.md measures with the counting allocator:
// the sharded state (parameters, gradients, optimizer state, fp32 masters) divided over
// dp_shard, plus what backward holds at its peak (two unsharded blocks, the current
// block's full gradients and up to two in-flight reduce-scatter inputs). Activations
// are not included (they depend on batch and sequence).
#pragma once

#include <cstdint>
#include <string>

#include "hp/fsdp/mixed_precision.h"

namespace hp {

struct ParallelLayout {
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  // FullyShardOptions' field; 0: not set. 1 is also what reshard_after_forward = false
  // amounts to: every module kept whole from forward to backward.
  int64_t reshard_after_forward_group_size = 0;
  // A pipeline's stages (hp::pp::Pipeline): each is gathered before its first micro-batch
  // and kept whole, its gradients accumulating unsharded, until its last; then reduced once.
  // The trainer's optim strategy (ZeRO-1) does the same with the whole model.
  bool unsharded_through_step = false;
};

struct MemoryEstimate {
  int64_t params = 0;          // whole model
  int64_t sharded_params = 0;  // bytes per rank
  int64_t sharded_grads = 0;
  int64_t optimizer_state = 0;  // AdamW: two moments, fp32 with masters, else the parameters' dtype
  int64_t fp32_masters = 0;     // FP32MasterOptimizer, for low-precision shards with main grads
  int64_t backward_peak_extra = 0;
  // Under a pipeline (unsharded_through_step): all of it whole in the compute dtype, and its
  // unsharded gradients, instead of two blocks.
  // With a reshard group size k: every module's share kept from forward to backward
  // (1/k of the model in the all-gather dtype), all of it held when backward starts.
  int64_t post_forward_shares = 0;
  int64_t total() const {
    return sharded_params + sharded_grads + optimizer_state + fp32_masters + backward_peak_extra +
           post_forward_shares;
  }
  std::string to_string() const;
};

// `largest_block_params`: the largest fully_shard group (a transformer block).
MemoryEstimate estimate_memory(int64_t params, int64_t largest_block_params, at::ScalarType param_dtype,
                               const MixedPrecisionPolicy& policy, const ParallelLayout& layout);

// fully_shard's collectives in one optimizer step of one rank, from the layout alone (the
// rules of src/fsdp/rules.h, which the runtime follows): counted per group, as one fused
// collective each (comm_fusion; per-parameter collectives issue one per parameter of the
// group instead, the same bytes).
struct CollectiveCounts {
  int64_t all_gathers = 0;      // forward gathers, and backward's gathers again
  int64_t reduce_scatters = 0;  // one per group and round
  int64_t all_reduces = 0;      // HSDP: one across replicas per reduce-scatter
  // Which parameters got a gradient (a flag per parameter, a few bytes): agreed over
  // dp_shard before each reduce-scatter and over dp_replicate before each all-reduce.
  int64_t flag_all_reduces = 0;
};
// `groups`: fully_shard groups on the rank (blocks and the root); `rounds`: forward and
// backward passes that gather and reduce in the step (micro-batches, or 1 where a pipeline
// keeps its stages' parameters through the step); `reshard_after_forward`: whether backward
// gathers again (all groups but the root and the last to finish forward).
CollectiveCounts estimate_collectives(int64_t groups, int64_t rounds, bool reshard_after_forward,
                                      int64_t dp_replicate);

}  // namespace hp
