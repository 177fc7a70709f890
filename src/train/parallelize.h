// hp-train's parallelize step (private to the trainer): a model, or a pipeline stage of one,
// laid out as the config says, with one record per parameter this rank holds.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/shard_spec.h"
#include "hp/train/config.h"
#include "hp/train/parallel_dims.h"
#include "hp/train/trainer.h"

namespace hp::train::internal {

// One parameter this rank holds, after parallelize().
struct ShardedParam {
  at::Tensor param;        // this rank's shard: the module's parameter, in place
  std::string name;        // its name in the whole model
  ShardSpec box;           // its box of the global tensor
  // Its elements differ between the tensor-parallel ranks (a split piece, or experts an EP
  // group spreads over them): the gradient norm sums it over tp too.
  bool tp_piece = false;
  // The duplicate copy of a tied parameter (a pipeline's last stage's embedding): left out
  // of the gradient norm, counted once.
  bool norm_skip = false;
  at::Tensor main_grad;    // its fp32 main gradient (fp32 masters), else undefined
  int stage = -1;          // the pipeline stage holding it; -1 without a pipeline
};

// What parallelize() made on this rank, model after model (or stage after stage).
struct ShardedModel {
  std::vector<ShardedParam> params;
  // fully_shard's units, per model: each MoE's experts, the blocks, the root.
  std::vector<FSDPHandle> handles;
  std::vector<torch::nn::Module*> roots;
};

// Lays `m` (built without storage) out over `mesh` as `c` says, in this order: expert
// parallelism (expert_parallel > 1), context parallelism (`context` given), tensor
// parallelism (before fully_shard, which then shards each rank's pieces), a fully_shard unit
// for each MoE's experts (over the experts' groups, the gradient divided by the whole data
// degree: each expert's gradient already sums every EP rank's tokens), one per block, one
// for the root; each rank materializes only its shards, on `device`. Appends the records of
// its parameters to `out`, `stage` the pipeline stage `m` is (-1: a whole model).
void parallelize(TrainModel& m, const TrainConfig& c, const ParallelMesh& mesh,
                 const std::shared_ptr<cp::ContextParallel>& context, c10::Device device, int stage,
                 ShardedModel& out);

}  // namespace hp::train::internal
