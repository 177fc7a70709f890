// The trainer's private parts shared by its files: Trainer::Impl (the state of one rank's
// run) and the helpers the Trainer and the ReferenceTrainer both use.
//   trainer.cpp            the Trainer: building the layout, the step, the loop
//   trainer_state.cpp      its checkpoints: save, background save, load
//   hf.cpp                 Hugging Face import and export
//   reference_trainer.cpp  the same training in one process (--verify)
//   step_math.cpp          learning rate, gradient norm, clipping, the optimizer
//   model_adapter.cpp      the config's model, stages and schedule
#pragma once

#include <torch/optim/optimizer.h>

#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "hp/ckpt/checkpoint.h"
#include "hp/fsdp/master_weights.h"
#include "hp/mesh/device_mesh.h"
#include "hp/pp/pipeline.h"
#include "hp/train/trainer.h"
#include "parallelize.h"

namespace hp::train {

namespace internal {

using Clock = std::chrono::steady_clock;

// AdamW (multi-tensor, same results as libtorch's) with weight decay on matrices
// (dim >= 2) and none on norm scales and vectors.
std::unique_ptr<torch::optim::Optimizer> make_adamw(const TrainConfig& c, const std::vector<at::Tensor>& params);
// Raises TrainingDiverged for a loss or norm that is not finite.
void check_finite(const TrainConfig& c, int64_t step, const char* what, double x);
// The config's optimizer over `named` (the parameters that require grad, by their names in
// the whole model): AdamW, or Muon for the hidden matrices (routed by shape, the model's
// token tables to AdamW) and AdamW for the rest. With `boxes` (each parameter's box of its
// whole tensor) the Muon matrices are pieces distributed over `world` (collective); without,
// each is whole on this process.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c,
                                                        const std::vector<std::pair<std::string, at::Tensor>>& named,
                                                        const std::vector<ShardSpec>* boxes, const CommPtr& world);
// Every parameter of the whole model that requires grad, by name, with its element count
// and whether the config's optimizer steps it with Muon (the trainer's routing).
struct RoutedParam {
  std::string name;
  int64_t numel = 0;
  bool muon = false;
};
std::vector<RoutedParam> routed_params(const TrainConfig& c);
// The learning rate of step `step`'s schedule for AdamW's groups (lr_at) and Muon's
// (muon_lr_at).
void set_lr(torch::optim::Optimizer& opt, const TrainConfig& c, int64_t step);
// The validation set of `c` (`given`, or opened here), checked to hold the batches an
// evaluation runs, and their order (DataSharder without shuffle). Null without validation.
struct Validation {
  std::shared_ptr<const TokenDataset> data;
  std::unique_ptr<DataSharder> order;
  int64_t batches = 0;
};
Validation open_validation(const TrainConfig& c, std::shared_ptr<const TokenDataset> given);
// An evaluation's figures after `step` steps: its mean `loss` over the set's batches.
EvalStats eval_stats(const TrainConfig& c, const Validation& v, int64_t step, double loss, double seconds);
// The mean next-token loss of a batch [B, seq + 1].
// The inputs and targets of batch [B, seq + 1]: its first and last seq tokens; with `cp`,
// this CP rank's tokens of each (cut alike by cp::shard).
std::pair<at::Tensor, at::Tensor> inputs_and_targets(const at::Tensor& batch, int64_t seq, const cp::ContextParallel* cp);
// The mean next-token loss of batch [B, seq + 1] (of this CP rank's tokens with `cp`).
at::Tensor next_token_loss(TrainModel& m, const at::Tensor& batch, int64_t seq, bool hooked,
                           const cp::ContextParallel* cp = nullptr);
// The Hugging Face name of each parameter of the config's model, after checking the
// folder's config.json against it.
std::map<std::string, std::string> hf_sources(const TrainConfig& c, const std::string& dir);
const std::string& hf_source(const std::map<std::string, std::string>& sources, const std::string& name);
// Appends an item for each buffer of `root` that has a Hugging Face name (DeepSeek's
// balancing bias), whole, read in place.
void add_hf_buffers(torch::nn::Module& root, const std::map<std::string, std::string>& sources,
                    std::vector<ckpt::Item>& items);

// Points the items on a device at host tensors for a reader to fill; put_back() then copies
// each into its device tensor.
class HostStaging {
 public:
  explicit HostStaging(std::vector<ckpt::Item>& items);
  void put_back();

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> staged_;  // (device tensor, host copy)
};

}  // namespace internal

struct Trainer::Impl {
  TrainConfig c;
  // Where the model, its state and the batches live, and where the world carries control
  // values (losses, figures): the CPU, or the device for nccl.
  c10::Device device = c10::kCPU, control = c10::kCPU;
  CommPtr world;
  // The layout's groups, each also held below under the name the step uses: dp (kData: the
  // data and context ranks, over which losses and routing loads are averaged or summed),
  // shards (fully_shard's dp_shard x cp), tp, pp.
  std::unique_ptr<ParallelMesh> mesh;
  CommPtr dp, shards, tp, pp;
  // The ranks whose routed tokens differ (ParallelDims' kRouting).
  CommPtr routing;
  // With context_parallel > 1: the attention over the CP group.
  std::shared_ptr<cp::ContextParallel> context;
  std::unique_ptr<TrainModel> model;  // without pipeline parallelism
  // With it: this rank's stages (each a part of the model), run by `pipe`.
  std::vector<std::unique_ptr<TrainModel>> stages;
  std::unique_ptr<pp::Pipeline> pipe;
  // The model or the stages laid out (internal::parallelize): a record per parameter this
  // rank holds (its shard, name, box, tp piece, tied copy, main gradient), fully_shard's
  // handles, the roots.
  internal::ShardedModel sharded;
  std::shared_ptr<const TokenDataset> data;
  std::unique_ptr<DataSharder> sharder;
  internal::Validation validation;  // eval_interval > 0
  int64_t dp_rank = 0;  // the data rank alone (kBatch): which samples this rank reads
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<FP32MasterOptimizer> master;
  int64_t steps = 0;

  // Tied embeddings under pipeline parallelism: the first and the last stage each hold a copy
  // of the embedding; their gradients are summed over `tie_group` (the pp ranks of the two
  // stages with this rank's dp/tp coordinates) after each backward, and the last stage's copy
  // is left out of the gradient norm (counted once: its record's norm_skip).
  std::vector<size_t> tied;  // indices into sharded.params of this rank's copies
  CommPtr tie_group;

  // The constructor's steps (trainer.cpp): the layout's groups; with pipeline_parallel > 1
  // this rank's stages, laid out, the tied copies and the pipeline; the optimizer.
  void build_mesh();
  void build_pipeline();
  void build_optimizer();

  // The gradient the optimizer steps parameter i with (its main gradient with fp32 masters).
  at::Tensor grad_of(size_t i) const { return master ? sharded.params[i].main_grad : sharded.params[i].param.grad(); }

  // The gradients to clip and step with; `split` (when given) says which are
  // tensor-parallel pieces, `skip` which are the duplicate copy of a tied parameter.
  std::vector<at::Tensor> grads(std::vector<bool>* split = nullptr, std::vector<bool>* skip = nullptr) const {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < sharded.params.size(); ++i) {
      if (!sharded.params[i].param.requires_grad()) continue;
      at::Tensor g = grad_of(i);
      if (!g.defined()) continue;
      out.push_back(g);
      if (split) split->push_back(sharded.params[i].tp_piece);
      if (skip) skip->push_back(sharded.params[i].norm_skip);
    }
    return out;
  }
};

}  // namespace hp::train
