// hp-train's configuration: a YAML file (plus --set overrides) read into TrainConfig.
//
// Training keys follow the seed system's names where they apply (params_dtype,
// data_parallel_shard, micro_batch_num, ...); the model and the data have their own
// sections. Every key is declared once, in src/train/config_keys.cpp's key table, with its type,
// help, setter and getter; the default of each key is the value of TrainConfig{} that the
// getter reads (the member initializers below are the one source, `hp-train --list-keys`
// prints them from the table, and resolved_settings() lists every key through it). A model
// key (model.<field>) is declared by its family (hp/models/family.h). Every choice is an
// enum parsed once, at load. Reading rejects, before anything else happens and naming the
// key: unknown keys (with the nearest known key suggested), values of the wrong type or
// outside their choices (listing them), keys of another model family. validate() rejects
// impossible combinations against the world size, and raises "not supported yet" for
// capabilities not built (fp16, ZeRO-1, ...).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "hp/ep/dispatch.h"
#include "hp/fsdp/mixed_precision.h"
#include "hp/models/family.h"
#include "hp/optim/muon_kinds.h"
#include "hp/train/parallel_dims.h"

namespace hp::train {

// The config's model: a family, one of its presets, and the fields set over it. Copies are
// deep. `->` reaches the family's arithmetic (num_params(), stage_params(), ...).
class ModelSpec {
 public:
  // The default family's default preset.
  ModelSpec();
  // `family`'s `preset` (empty: its default); raises listing the accepted names.
  explicit ModelSpec(const std::string& family, const std::string& preset = "");
  // The model `args` describe (read from a Hugging Face config.json: model.from_hf), shown
  // as coming from `source`; its family's default preset is the base later keys override.
  ModelSpec(std::unique_ptr<models::ModelArgs> args, std::string source);
  ModelSpec(const ModelSpec& o);
  ModelSpec& operator=(const ModelSpec& o);
  ModelSpec(ModelSpec&&) noexcept = default;
  ModelSpec& operator=(ModelSpec&&) noexcept = default;

  const models::ModelFamily& family() const { return args_->family(); }
  const std::string& preset() const { return preset_; }
  // Where the model's sizes were read from ("" for a preset).
  const std::string& source() const { return source_; }
  models::ModelArgs* operator->() { return args_.get(); }
  const models::ModelArgs* operator->() const { return args_.get(); }
  models::ModelArgs& args() { return *args_; }
  const models::ModelArgs& args() const { return *args_; }
  // The family's config struct (models::LlamaConfig, ...); raises for another family.
  template <typename Config>
  Config& config() {
    return models::config_of<Config>(*args_);
  }
  template <typename Config>
  const Config& config() const {
    return models::config_of<Config>(*args_);
  }

 private:
  std::string preset_;
  std::string source_;
  std::unique_ptr<models::ModelArgs> args_;
};

enum class DataType { kSynthetic, kBinary, kText, kMegatron };
enum class TokenDtype { kUint16, kUint32 };
// ZeRO-3 (reshard after forward), ZeRO-2 (keep the parameters until backward) or ZeRO-1
// (keep the parameters gathered and the gradients unsharded from the step's first
// micro-batch to its last: one gather and one reduction a step; the sharded state is the
// optimizer's and the masters').
enum class ShardStrategy { kOptimGradsParams, kOptimGrads, kOptim };
// Activation recomputation of every block (hp::RecomputePolicy): kSelective keeps the
// matmuls' outputs, kLight (DeepSeek-V3's) those and attention's, recomputing only the norms,
// MLA's up-projections and the activations.
enum class Recompute { kNone, kFull, kSelective, kLight };
enum class PipelineScheduleKind { kAuto, kGPipe, k1F1B, kInterleaved, kZBH1, kZBV, kDualPipeV };
enum class LrDecay { kCosine, kLinear, kConstant };
enum class OptimizerKind { kAdamW, kMuon };
// Where each rank trains: the CPU, or the GPU of its local rank (the nccl backend).
enum class Device { kCpu, kCuda };

// Each enum's config names, in the order errors and --list-keys show them; to_string(e) is
// the name.
template <typename E>
const std::vector<std::pair<E, const char*>>& enum_names();
template <typename E>
std::string to_string(E e) {
  for (const auto& [v, name] : enum_names<E>()) {
    if (v == e) return name;
  }
  return "?";
}

struct DataSpec {
  DataType type = DataType::kSynthetic;
  std::string path;                              // binary and text
  // The validation set, read as `type` (eval_interval > 0); synthetic data holds out its own.
  std::string valid_path;
  TokenDtype token_dtype = TokenDtype::kUint16;  // binary
  int64_t num_samples = 4096;                    // synthetic corpus size
  bool shuffle = true;                           // a new order every epoch
};

struct TrainConfig {
  ModelSpec model;
  DataSpec data;

  // cuda: each rank's model, optimizer state and batches on the GPU of its local rank
  // (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or LOCAL_RANK, modulo the GPUs it sees),
  // collectives over nccl. Needs a build with CUDA and NCCL.
  Device device = Device::kCpu;

  at::ScalarType params_dtype = at::kFloat;
  at::ScalarType compute_dtype = at::kFloat;  // defaults to params_dtype
  bool accumulate_allreduce_grads_in_fp32 = false;
  // fp32 main gradients for fp32 parameters too (the seed system's name); low-precision
  // parameters get them (and master weights) from accumulate_allreduce_grads_in_fp32 alone.
  bool apply_grad_on_fp32_main_grad = false;

  int64_t data_parallel = 1;         // dp_replicate
  int64_t data_parallel_shard = -1;  // dp_shard; -1 = the rest of the world
  ShardStrategy data_parallel_shard_strategy = ShardStrategy::kOptimGradsParams;
  int64_t reshard_after_forward_group_size = 0;  // 0: reshard over all of data_parallel_shard
  bool comm_fusion = true;
  // fully_shard's wait_per_submodule on every block (needs comm_fusion false).
  bool wait_per_submodule = false;
  Recompute recompute = Recompute::kNone;
  int64_t tensor_parallel = 1;
  bool sequence_parallel = false;
  // Expert parallelism: each MoE's routed experts split over this many consecutive
  // data_parallel_shard ranks (which then exchange tokens); must divide it.
  int64_t expert_parallel = 1;
  // How tokens reach their experts' ranks: one row per (token, expert) or one copy per rank.
  ep::DispatcherKind moe_dispatcher = ep::DispatcherKind::kAllToAll;
  // Chunks of local experts each MoE's all-to-alls overlap the experts' compute in (1: none).
  int64_t moe_overlap_chunks = 1;
  // Context parallelism: each sequence split over this many ranks (head-tail: load-balanced
  // for the causal mask), attention over the whole of it by context_parallel_method. The
  // world is data_parallel x data_parallel_shard x context_parallel x tensor_parallel x
  // pipeline_parallel; fully_shard shards over data_parallel_shard x context_parallel.
  int64_t context_parallel = 1;
  cp::Method context_parallel_method = cp::Method::kRing;
  int64_t pipeline_parallel = 1;
  int64_t pipeline_parallel_interleave_num = 1;
  // auto: 1f1b, or interleaved with interleave_num > 1; validate() resolves it.
  PipelineScheduleKind pipeline_schedule = PipelineScheduleKind::kAuto;
  // A paired forward and backward (dualpipev) taking turns at the expert exchanges
  // (pp::PipelineOptions::pairs_take_turns).
  bool pipeline_pair_overlap = true;
  // Layers of each of the pipeline_parallel x interleave stages; empty: as even as possible.
  std::vector<int64_t> pipeline_stage_layers;

  // Checkpoints: every save_interval steps (and after the last), to save_dir/step_<k>, with
  // save_dir/latest naming the newest; keep_last_n > 0 prunes older ones after a save
  // committed. save_dir empty: output_dir/checkpoints.
  int64_t save_interval = 0;
  std::string save_dir;
  int64_t keep_last_n = 0;
  bool async_save = false;  // copy the state, write it in the background while training goes on
  // A Hugging Face model folder (config.json and safetensors) the weights start from instead
  // of the seed (a family with Hugging Face names); the config's model must match its
  // config.json. A resumed run takes its weights from the checkpoint instead.
  std::string init_from_hf;
  // Leave the folder's multi-token prediction modules unread where the model has fewer
  // (DeepSeek-V3's model.layers.61 with model.mtp_layers 0); otherwise they are an error.
  bool init_from_hf_drop_mtp = false;

  int64_t micro_batch_num = 1;
  int64_t global_batch_size = 8;
  int64_t seq_length = 64;

  double lr = 1e-3;
  double min_lr = 0.0;
  int64_t lr_warmup_steps = 0;
  LrDecay lr_decay_style = LrDecay::kCosine;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  // optimizer: muon trains the hidden matrices with Muon (hp/optim/muon.h) and the rest
  // (embeddings, output head, norms, biases, vectors) with AdamW under the keys above.
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  double muon_lr = -1;            // < 0: lr (under the rms update scale AdamW's lr carries over)
  double muon_momentum = 0.95;
  bool muon_nesterov = true;
  double muon_weight_decay = -1;  // < 0: weight_decay
  optim::NsSchedule muon_ns_coefficients = optim::NsSchedule::kQuintic;
  int64_t muon_ns_steps = 0;      // 0: the schedule's own count
  at::ScalarType muon_ns_dtype = at::kBFloat16;
  optim::MuonScale muon_update_scale = optim::MuonScale::kRms;
  double muon_update_rms = 0.2;   // the rms scale's target: the RMS of Muon's update
  optim::MuonScheme muon_scheme = optim::MuonScheme::kOwner;
  // Routing overrides (parameter-name patterns, `*` any run of characters): muon_to_adamw
  // sends matching matrices to AdamW besides the token tables; muon_to_muon takes matching
  // parameters with Muon, token tables included (they must be 2-D). Each pattern must match
  // a parameter of the model, and no parameter both.
  std::vector<std::string> muon_to_adamw, muon_to_muon;
  double clip_grad = 1.0;  // global grad-norm limit; 0 = off

  int64_t train_steps = 20;
  uint64_t seed = 1234;
  int64_t log_interval = 1;
  // Validation every eval_interval steps and after the last (0: none): the mean next-token
  // loss of eval_steps global batches of the validation set (0: all of its whole batches),
  // the same batches every time, without gradients, under the training layout.
  int64_t eval_interval = 0;
  int64_t eval_steps = 10;
  std::string output_dir = "hp-train-out";  // metrics.jsonl and loss.svg; "" = none

  // Where the config came from (for messages), and the keys it set.
  std::string source;
  std::set<std::string> given;
  // What validate() accepted with a word (describe() prints each as "warning: ...").
  std::vector<std::string> warnings;

  // Checks the combinations against `world_size` and resolves data_parallel_shard = -1.
  // Raises hp::Error naming the key; "not supported yet" for capabilities not built.
  void validate(int world_size);

  // Where checkpoints go: save_dir, else output_dir/checkpoints (validate() sets save_dir so).
  std::string checkpoint_dir() const { return save_dir.empty() && !output_dir.empty() ? output_dir + "/checkpoints" : save_dir; }
  int64_t dp_size() const { return data_parallel * data_parallel_shard; }
  // The layout's degrees as given (data_parallel_shard -1 until validate() resolves it).
  ParallelDims::Degrees degrees() const {
    return {data_parallel, data_parallel_shard, context_parallel, tensor_parallel, pipeline_parallel, expert_parallel};
  }
  // The layout's degrees, its mesh and groups (valid after validate()).
  ParallelDims parallel_dims() const;
  // Samples one data-parallel rank runs per micro-batch (valid after validate()).
  int64_t micro_batch_size() const { return global_batch_size / (dp_size() * micro_batch_num); }
  // fp32 main gradients and fp32 master weights (low-precision params, fp32 accumulation).
  bool fp32_master() const { return accumulate_allreduce_grads_in_fp32 && params_dtype != at::kFloat; }
};

// Parses YAML text, then applies overrides ("key=value", dotted keys for sections, e.g.
// "model.dim=128"). `source` names the text in errors.
TrainConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides = {},
                         const std::string& source = "<config>");
// Reads the file at `path`; raises naming the path when it cannot be read.
TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

struct KeyInfo {
  std::string key, type, default_value, help;
};
// Every key, in the order the docs list them; default_value is TrainConfig{}'s value (or
// how it is derived, for a key whose default follows from another).
std::vector<KeyInfo> config_keys();

// The recompute policy of hooks/recompute.h for a Recompute choice (none: unset).
c10::optional<RecomputePolicy> recompute_policy(Recompute r);

// fully_shard's policy for the config: compute_dtype for forward/backward, fp32 reduction
// (and fp32 main gradients for low-precision parameters) with
// accumulate_allreduce_grads_in_fp32. Every dtype a run uses follows from it through
// resolve_dtypes.
MixedPrecisionPolicy mixed_precision(const TrainConfig& c);

// One line per setting, for the start of a run.
std::string describe(const TrainConfig& c);

// Every key's value, as (key, text that parses back to it), in the key table's order (the
// model's keys those of its family): the ranks of one run compare these before training (a
// run started with a different config on some ranks would train differently or hang), and
// a checkpoint keeps them all.
std::vector<std::pair<std::string, std::string>> resolved_settings(const TrainConfig& c);

using models::ResumeRule;
// What a resume may do with a change of `key` (one of resolved_settings'), from the key
// table (or, for model.<field>, the family's key); raises for an unknown key.
ResumeRule resume_rule(const TrainConfig& c, const std::string& key);
// Whether `key` is derived from another key (muon_lr from lr) and was not set: its value
// follows that key's, which is compared in its place.
bool follows_another_key(const TrainConfig& c, const std::string& key);

// "" when every rank of `world` holds the same `mine` (resolved_settings, or
// command_line_settings): mpirun's ':' form can start ranks with different configs, --set
// values or flags, which would train differently or hang. Else, on each rank that differs
// from rank 0: "the ranks were started with different <what>: k=v on rank r but k=w on rank
// 0; <remedy>" for the first differing key. Collective.
std::string settings_mismatch(const CommPtr& world, const std::vector<std::pair<std::string, std::string>>& mine,
                              const std::string& what, const std::string& remedy);

// The model that resolved_settings' model.* entries describe (as a checkpoint keeps them; the
// other entries are ignored). Raises naming the key and `source` for a value that does not
// parse.
ModelSpec model_from_settings(const std::vector<std::pair<std::string, std::string>>& settings,
                              const std::string& source);

}  // namespace hp::train
