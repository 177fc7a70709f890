// hp-train's configuration: a YAML file (plus --set overrides) read into TrainConfig.
//
// Training keys follow the seed system's names where they apply (params_dtype,
// data_parallel_shard, micro_batch_num, ...); the model and the data have their own
// sections. Every key is declared once, in src/train/config.cpp, with its type, default
// and help (`hp-train --list-keys` prints them; docs/train.md explains them). Reading
// rejects, before anything else happens and naming the key: unknown keys (with the
// nearest known key suggested), values of the wrong type or outside their choices, keys
// of the other model type. validate() rejects impossible combinations against the world
// size, and raises "not supported yet" for capabilities not built (tensor_parallel > 1,
// pipeline_parallel > 1, fp16, ZeRO-1).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "hp/fsdp/mixed_precision.h"
#include "hp/models/deepseek.h"
#include "hp/models/llama.h"

namespace hp::train {

struct ModelSpec {
  std::string type = "deepseek";  // deepseek | llama
  std::string preset = "tiny";    // tiny | deepseek_v3 (deepseek) | llama3_8b (llama)
  models::DeepSeekConfig deepseek = models::DeepSeekConfig::tiny();
  models::LlamaConfig llama = models::LlamaConfig::tiny();
  int64_t vocab() const;
  int64_t dim() const;  // the residual stream's width
  int64_t max_seq() const;
  int64_t layers() const;
  int64_t num_params() const;
  int64_t largest_block_params() const;
  int64_t largest_param() const;
  // Parameters each tensor-parallel rank holds (before fully_shard): the split ones divided
  // by tp, the whole ones (norms; DeepSeek's MLA down-projections, their norms and the MoE
  // router) in full. tp = 1: num_params() and largest_block_params().
  int64_t params_per_tp_rank(int64_t tp) const;
  // Parameters of a pipeline stage's part of the model (before tensor parallelism), from
  // the config alone (a tied Llama's last stage counts its copy of the embedding).
  int64_t stage_params(const models::PipelineSlice& slice) const;
  int64_t largest_block_params_per_tp_rank(int64_t tp) const;
};

struct DataSpec {
  std::string type = "synthetic";  // synthetic | binary | text
  std::string path;                // binary and text
  std::string token_dtype = "uint16";  // binary: uint16 | uint32
  int64_t num_samples = 4096;          // synthetic corpus size
  bool shuffle = true;                 // a new order every epoch
};

struct TrainConfig {
  ModelSpec model;
  DataSpec data;

  at::ScalarType params_dtype = at::kFloat;
  at::ScalarType compute_dtype = at::kFloat;  // defaults to params_dtype
  bool accumulate_allreduce_grads_in_fp32 = false;
  // fp32 main gradients for fp32 parameters too (the seed system's name); low-precision
  // parameters get them (and master weights) from accumulate_allreduce_grads_in_fp32 alone.
  bool apply_grad_on_fp32_main_grad = false;

  int64_t data_parallel = 1;         // dp_replicate
  int64_t data_parallel_shard = -1;  // dp_shard; -1 = the rest of the world
  std::string data_parallel_shard_strategy = "optim_grads_params";
  int64_t reshard_after_forward_group_size = 0;  // 0: reshard over all of data_parallel_shard
  bool comm_fusion = true;
  // fully_shard's wait_per_submodule on every block (needs comm_fusion false).
  bool wait_per_submodule = false;
  std::string recompute = "none";  // none | full | selective (activation checkpointing per block)
  int64_t tensor_parallel = 1;
  bool sequence_parallel = false;
  int64_t pipeline_parallel = 1;
  int64_t pipeline_parallel_interleave_num = 1;
  // gpipe | 1f1b | interleaved; "auto": 1f1b, or interleaved with interleave_num > 1.
  // validate() resolves auto.
  std::string pipeline_schedule = "auto";
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
  // of the seed (Llama only); the config's model must match its config.json. A resumed run
  // takes its weights from the checkpoint instead.
  std::string init_from_hf;

  int64_t micro_batch_num = 1;
  int64_t global_batch_size = 8;
  int64_t seq_length = 64;

  double lr = 1e-3;
  double min_lr = 0.0;
  int64_t lr_warmup_steps = 0;
  std::string lr_decay_style = "cosine";  // cosine | linear | constant
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  double clip_grad = 1.0;  // global grad-norm limit; 0 = off

  int64_t train_steps = 20;
  uint64_t seed = 1234;
  int64_t log_interval = 1;
  std::string output_dir = "hp-train-out";  // metrics.jsonl and loss.svg; "" = none

  // Where the config came from (for messages), and the keys it set.
  std::string source;
  std::set<std::string> given;

  // Checks the combinations against `world_size` and resolves data_parallel_shard = -1.
  // Raises hp::Error naming the key; "not supported yet" for capabilities not built.
  void validate(int world_size);

  int64_t dp_size() const { return data_parallel * data_parallel_shard; }
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
// Every key, in the order the docs list them.
std::vector<KeyInfo> config_keys();

// fully_shard's policy for the config: compute_dtype for forward/backward, fp32 reduction
// (and fp32 main gradients for low-precision parameters) with
// accumulate_allreduce_grads_in_fp32. Every dtype a run uses follows from it through
// resolve_dtypes.
MixedPrecisionPolicy mixed_precision(const TrainConfig& c);

// One line per setting, for the start of a run.
std::string describe(const TrainConfig& c);

// Every resolved setting that decides what a run computes, as (key, value) in a fixed
// order: the ranks of one run compare these before training (a run started with a
// different config on some ranks would train differently or hang).
std::vector<std::pair<std::string, std::string>> resolved_settings(const TrainConfig& c);

}  // namespace hp::train
