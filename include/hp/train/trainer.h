// hp-train's training loop, in two forms that must agree:
//   Trainer          the config's layout: one process per rank, the model's blocks and
//                    root under fully_shard on the (pp, dp_replicate, dp_shard, tp) mesh;
//                    with pipeline_parallel > 1 each rank holds its stages' part of the
//                    model (each under fully_shard) and a step runs the pipeline schedule
//                    over the micro-batches (hp/pp/pipeline.h).
//   ReferenceTrainer the same config in one process on the global batch, no fully_shard
//                    (what --verify compares against).
// A step: for each micro-batch, forward, next-token cross-entropy (in fp32) scaled by
// 1 / micro_batch_num, backward (gradients reduced over the data-parallel ranks every
// micro-batch); then the global gradient norm (over every shard), clipping to clip_grad,
// the scheduled learning rate, AdamW (weight decay on matrices only), and the DeepSeek
// balancing-bias update from the expert load of all data-parallel ranks.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "hp/ckpt/consolidated.h"
#include "hp/comm/communicator.h"
#include "hp/core/error.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/models/family.h"
#include "hp/pp/schedule.h"
#include "hp/train/config.h"
#include "hp/train/data.h"

namespace hp::train {

// The device a rank trains on for the config's `device`: the CPU, or the current CUDA
// device (hp::init's nccl backend makes the local rank's GPU current). Raises for cuda in
// a build without CUDA ("not supported yet") and where the process sees no GPU.
c10::Device training_device(Device d);

// Learning rate of optimizer step `step` (0-based): linear warmup, lr (k + 1) / W for
// k < W = lr_warmup_steps, then lr_decay_style from lr to min_lr over the remaining
// steps, progress (k - W + 1) / (train_steps - W): the last step uses min_lr.
double lr_at(const TrainConfig& c, int64_t step);
// Muon's: muon_lr scaled by lr_at's factor on lr (with lr 0: the same warmup and decay from
// muon_lr down to 0).
double muon_lr_at(const TrainConfig& c, int64_t step);

// Whether the validation set is evaluated after step `step` (1-based): every eval_interval
// steps and after the last, with eval_interval > 0.
bool eval_due(const TrainConfig& c, int64_t step);

// sqrt of the sum of squares of every element of `grads` over the ranks of `shards`
// (each rank holding different elements); null `shards`: this process only. fp64 sums.
double global_grad_norm(const std::vector<at::Tensor>& grads, const CommPtr& shards);
// The same under tensor parallelism: grads[i] is a tensor-parallel piece when split[i]
// (summed over `tp` too) and whole on every tp rank otherwise (counted once).
double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& split, const CommPtr& shards,
                        const CommPtr& tp);
// The same with pipeline parallelism: each pp rank holds different parameters (summed over
// `pp` too).
double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& split, const CommPtr& shards,
                        const CommPtr& tp, const CommPtr& pp);
// Scales `grads` by max_norm / (norm + 1e-6) when norm > max_norm > 0; returns the scale.
double clip_grads_(const std::vector<at::Tensor>& grads, double max_norm, double norm);

// Raised (on every rank alike) when a step's loss or gradient norm is not finite.
class TrainingDiverged : public Error {
 public:
  using Error::Error;
};
// What to try after a divergence, as the config stands: "(try a lower lr than 0.1;
// clip_grad is 1)", or "(try a lower lr than 0.1, or clip_grad > 0)" without clipping.
std::string diverged_hint(const TrainConfig& c);

struct StepStats {
  int64_t step = 0;           // 1-based
  double loss = 0;            // mean over the global batch
  double lr = 0;
  double grad_norm = 0;       // before clipping
  double step_time_s = 0;     // slowest rank
  double tokens_per_s = 0;    // global batch tokens / step_time_s
  int64_t peak_bytes = 0;     // largest tensor-memory peak over ranks
  double optimizer_time_s = 0;       // the optimizer's step (its communication included), slowest rank
  // Bytes sent per rank (Communicator::traffic), the most any rank sent: in the whole step
  // (gathers, reductions, pipeline and expert exchanges, the optimizer's), and in the
  // optimizer's step alone (Muon's owner or gather exchanges; AdamW sends nothing).
  int64_t comm_bytes = 0;
  int64_t optimizer_comm_bytes = 0;
  // Per MoE block (a model with routed experts): the tokens its busiest routed expert got
  // this step and the mean over its experts, summed over the data-parallel ranks (the load
  // the balancing bias steers by). max / mean is the imbalance: 1 when perfectly even.
  struct ExpertLoad {
    int64_t layer = 0;
    double max = 0, mean = 0;
    double dropped = 0;  // the fraction of its routed slots a capacity limit dropped
  };
  std::vector<ExpertLoad> expert_load;
  // The multi-token prediction loss (model.mtp_layers > 0), mean over the global batch as
  // `loss`; NaN for a model without.
  double mtp_loss = std::numeric_limits<double>::quiet_NaN();
};

// One evaluation of the validation set (Trainer::evaluate).
struct EvalStats {
  int64_t step = 0;        // after this many steps
  double loss = 0;         // mean next-token loss over the batches evaluated
  double perplexity = 0;   // exp(loss)
  int64_t tokens = 0;      // tokens evaluated
  double seconds = 0;      // slowest rank
};

// A model hp-train can train: any family's, behind one interface (hp/models/family.h).
using TrainModel = models::Model;
// Built in fp32, initialized from the seed (layout-independent), then cast to params_dtype.
// `deferred`: built under hp::memory::DeferredAllocation and not initialized (no storage of
// its own); fully_shard with param_init = models::parameter_initializer(root, seed) gives
// every rank bitwise the shards of the initialized model.
// `slice`: a pipeline stage's part of the model (default: all of it).
std::unique_ptr<TrainModel> make_model(const TrainConfig& c, bool deferred = false,
                                       const models::PipelineSlice& slice = {});

// "optimizer groups: muon 14 matrices (98304 parameters), adamw 7 tensors (...)": how the
// config's optimizer routes the whole model's parameters (built without storage), for the
// start of a run; AdamW's one line otherwise.
std::string describe_optimizer(const TrainConfig& c);
// The [rows, columns] of every matrix optimizer: muon trains with Muon (routed as the
// trainer routes them, the whole model's); none under adamw.
std::vector<std::pair<int64_t, int64_t>> muon_matrix_shapes(const TrainConfig& c);

// Parameters of each of the pipeline_parallel x interleave stages (before tensor
// parallelism), from the config alone (the family's ModelArgs::stage_params).
std::vector<int64_t> stage_params(const TrainConfig& c);

// The pipeline schedule of a validated config with pipeline_parallel > 1: its
// pipeline_schedule over pipeline_parallel ranks and micro_batch_num micro-batches (the
// placement of stages on ranks is the schedule's rank_of).
pp::Schedule pipeline_schedule(const TrainConfig& c);

class CheckpointManager;

// What Trainer::train reports: after each step, and after each save it starts.
struct TrainCallbacks {
  std::function<void(const StepStats&)> on_step;
  // The checkpoint's folder; `background`: being written while training goes on.
  std::function<void(const std::string& dir, bool background)> on_save;
  // After each evaluation (eval_interval).
  std::function<void(const EvalStats&)> on_eval;
  // Polled on every rank after each step (its evaluation and save included): a non-zero
  // value (a signal's number, PreemptionSignals::received) on any rank stops the run there,
  // every rank agreeing in one all-reduce; the checkpoint manager then saves that step
  // synchronously unless it already did. Unset: never polled, no collective.
  std::function<int()> stop_requested;
};

// A run of Trainer::train.
struct TrainSummary {
  int64_t first_step = 0;    // steps done before it (a resumed run's)
  int64_t steps = 0;         // steps it trained
  double seconds = 0;        // their step times summed (each the slowest rank's)
  double tokens_per_s = 0;   // after the first step (allocations and caches warming up); one step: that one
  int64_t peak_bytes = 0;    // largest tensor-memory peak of any step on any rank
  double optimizer_seconds = 0;    // the steps' optimizer_time_s summed
  int64_t comm_bytes = 0;           // the steps' comm_bytes summed
  int64_t optimizer_comm_bytes = 0; // ... and their optimizer_comm_bytes
  std::vector<double> losses;
  std::vector<EvalStats> evals;
  // A run stopped through stop_requested: the largest value any rank asked with, the
  // lowest rank that asked, and the checkpoint that holds the last step ("" when the run
  // saves nowhere).
  int stopped_by = 0;
  int stop_rank = -1;
  std::string stop_saved;
};

// What Trainer::load found: the optimizer whose state the checkpoint holds, and the
// parameters of the whole model whose optimizer state starts afresh because the checkpoint
// holds the other optimizer's for them (none when nothing changed).
struct ResumeReport {
  OptimizerKind saved_optimizer = OptimizerKind::kAdamW;
  int64_t fresh_tensors = 0;
  int64_t fresh_elements = 0;
  int64_t kept_tensors = 0;  // those whose saved state was loaded
};

class Trainer : public ckpt::Checkpointable {
 public:
  // `world` must have data_parallel x data_parallel_shard ranks; `c` validated. `data`:
  // the config's dataset when already opened (null: opened here); `valid` the same for the
  // validation set (eval_interval > 0: make_validation_dataset).
  Trainer(const TrainConfig& c, CommPtr world, std::shared_ptr<const TokenDataset> data = nullptr,
          std::shared_ptr<const TokenDataset> valid = nullptr);
  ~Trainer();
  StepStats step();  // the next step
  // The validation loss of the model as it is now (needs eval_interval > 0): the first
  // validation_batches() global batches of the validation set, in order, each split over
  // the data-parallel ranks and micro-batches as a training step's batch is, forward only
  // without gradients under the training layout (a pipeline runs Pipeline::evaluate). The
  // mean over every micro-batch's mean loss (equal sizes: the mean over every token).
  // Nothing of the training state changes: parameters are resharded after, and the MoE's
  // balancing load counts training forwards only. Collective over the world.
  EvalStats evaluate();
  // Trains from steps_done() to train_steps: on_step after each step; with eval_interval,
  // evaluate() every eval_interval steps and after the last, then on_eval; a save through
  // `checkpoints` (when given) after each step it says is due, then on_save; at the end a
  // background save is waited for. Every rank raises alike: TrainingDiverged for a loss or
  // norm that is not finite, or for weights that are not when a save is due (nothing is
  // saved: `latest` stays the last good checkpoint), hp::Error for a save that failed on
  // any rank.
  TrainSummary train(CheckpointManager* checkpoints = nullptr, const TrainCallbacks& callbacks = {});
  int64_t steps_done() const override;
  // This rank's sharded parameters and what the optimizer steps them with.
  std::vector<at::Tensor> sharded_params() const;
  std::vector<at::Tensor> sharded_grads() const;
  // Per sharded_params()[i]: its name in the whole model and its box of the global tensor.
  std::vector<std::string> parameter_names() const;
  std::vector<ShardSpec> parameter_specs() const;
  // fully_shard's handles: with expert_parallel, each MoE's experts' first; each block's,
  // then the root's.
  const std::vector<FSDPHandle>& handles() const;
  // The ranks one replica's parameters are sharded over (dp_shard).
  const CommPtr& shard_group() const;
  // The tensor-parallel group (size 1 without tensor parallelism).
  const CommPtr& tp_group() const;
  // The pipeline-parallel group (size 1 without pipeline parallelism).
  const CommPtr& pp_group() const;
  std::string describe_data() const;

  // Checkpoints (hp/ckpt/checkpoint.h), collective over the world. save(dir) writes the
  // whole training state: every parameter's shards under the whole model's names, fp32
  // masters where kept, AdamW's moments and step, the model's buffers (DeepSeek's balancing
  // bias), the steps done (which fix the data position and the learning rate) and the model
  // settings. load(dir) restores them into this trainer, from a checkpoint of any layout
  // (resharded on load); training then continues exactly where the saved one stopped.
  // Raises naming the key for model settings that differ from the checkpoint's.
  // A checkpoint of the other optimizer (adamw <-> muon), or with matrices routed the other
  // way (muon_to_adamw, muon_to_muon), resumes too: each parameter keeps its saved optimizer
  // state where its optimizer is the same (AdamW's moments of the token tables, norms and
  // vectors under both), and one now stepped by the other optimizer starts that one's state
  // afresh (Muon's momentum zero, or AdamW's moments zero at step 0), as its first step
  // would; the report says how many (hp-train prints it). Parameters, masters, the data
  // position and the schedule continue as saved.
  void save(const std::string& dir) const;
  ResumeReport load(const std::string& dir);
  // What save() writes, as items and values (a CheckpointManager saves them, in the
  // background or not), and load() without its report.
  State checkpoint_state() const override;
  void load_checkpoint(const std::string& dir) override;
  // The model's weights (and fp32 masters) from a Hugging Face model folder (config.json,
  // safetensors: hp/ckpt/consolidated.h), each rank reading only its shards' bytes, cast to
  // the parameters' dtype; the optimizer's state is left as it is. Collective over the
  // world (an error on any rank raises on all). Raises naming the key when config.json
  // describes another model, and "not supported yet" for a family without Hugging Face
  // names (ModelArgs::supports_hf). The
  // constructor calls it for the config's init_from_hf.
  void load_hf(const std::string& dir);

  struct Impl;

 private:
  // TrainCallbacks::stop_requested agreed over the world: true when any rank's `mine` is
  // non-zero, filling out's stopped_by and stop_rank. Collective.
  bool stop_agreed(int mine, TrainSummary* out) const;
  // Raises TrainingDiverged on every rank when any rank's weights hold a value that is not
  // finite after step `step` (a step whose loss and norm were finite can still overflow
  // them): such a state is never saved. Collective over the world.
  void require_finite_weights(int64_t step) const;

  std::unique_ptr<Impl> impl_;
};

// Writes the model of the committed checkpoint `ckpt_dir` (saved by Trainer::save, any
// layout) to the new folder `out_dir` in Hugging Face's layout for the model's family
// (LlamaForCausalLM for Llama)
// (config.json, model-0000k-of-0000n.safetensors of at most options.max_shard_bytes, the
// index): the fp32 masters where the checkpoint holds them, else the parameters, written as
// options.dtype (default: the parameters' dtype). Collective over `world`: the files are
// spread over the ranks and no rank holds the whole model (ckpt::export_consolidated).
// Raises "not supported yet" for a family without Hugging Face names. `without_mtp`: the
// multi-token prediction modules (DeepSeek-V3's) are left out, for inference, and
// config.json says none (a model without them exports the same with or without it).
void export_hf(const std::string& ckpt_dir, const std::string& out_dir, const CommPtr& world,
               ckpt::ExportOptions options = {}, bool without_mtp = false);

class ReferenceTrainer {
 public:
  // `c` validated for the real layout.
  explicit ReferenceTrainer(const TrainConfig& c, std::shared_ptr<const TokenDataset> data = nullptr,
                            std::shared_ptr<const TokenDataset> valid = nullptr);
  ~ReferenceTrainer();
  StepStats step();
  // The validation loss on the same batches as Trainer::evaluate, in one process.
  EvalStats evaluate();
  TrainModel& model();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hp::train
