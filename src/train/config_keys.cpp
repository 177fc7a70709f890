// The key table: every config key's type, help, setter and getter (the getter of
// TrainConfig{} is the key's default), and the model families' keys beside it. The names of
// each choice and the values' parsers: config_values.cpp.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>

#include "config_keys.h"
#include "hp/core/untrusted.h"

namespace hp::train {
namespace internal {
namespace {

// Upper bounds that keep every product of sizes far from int64 overflow.
constexpr int64_t kMaxModelInt = int64_t(1) << 31;
constexpr int64_t kMaxRanks = int64_t(1) << 24;
constexpr int64_t kMaxCount = int64_t(1) << 40;

using Setter = std::function<void(TrainConfig&, const Value&)>;
using Getter = std::function<std::string(const TrainConfig&)>;

// A key of the table: `get` writes the value as text that `set` reads back; the default of
// the key is get(TrainConfig{}) unless `derived` says how it follows from another key.
struct Key {
  std::string name, type, help;
  Setter set;
  Getter get;
  std::string derived;
  // What a resume may do with a change of it: by default it changes the run's course.
  ResumeRule resume = ResumeRule::kTrajectory;
};

// Builders for the table's usual kinds. `at` gives the field of a config.
template <typename At>
Key int_key(const char* name, const char* help, At at, int64_t min, int64_t max) {
  return {name, "int", help,
          [at, min, max](TrainConfig& c, const Value& v) { at(c) = as_int(v, min, max); },
          [at](const TrainConfig& c) { return std::to_string(at(const_cast<TrainConfig&>(c))); }, ""};
}
template <typename At>
Key bool_key(const char* name, const char* help, At at) {
  return {name, "bool", help, [at](TrainConfig& c, const Value& v) { at(c) = as_bool(v); },
          [at](const TrainConfig& c) { return bool_text(at(const_cast<TrainConfig&>(c))); }, ""};
}
// A float checked by `check` (which raises through the Value).
template <typename At, typename Check>
Key float_key(const char* name, const char* help, At at, Check check) {
  return {name, "float", help,
          [at, check](TrainConfig& c, const Value& v) {
            const double x = as_double(v);
            check(v, x);
            at(c) = x;
          },
          [at](const TrainConfig& c) { return double_text(at(const_cast<TrainConfig&>(c))); }, ""};
}
template <typename E, typename At>
Key enum_key(const char* name, const char* help, At at) {
  std::string type;
  for (const auto& [e, n] : enum_names<E>()) type += (type.empty() ? "" : "|") + std::string(n);
  return {name, type, help, [at](TrainConfig& c, const Value& v) { at(c) = as_enum<E>(v); },
          [at](const TrainConfig& c) { return to_string(at(const_cast<TrainConfig&>(c))); }, ""};
}
template <typename At>
Key path_key(const char* name, const char* help, At at) {
  return {name, "path", help, [at](TrainConfig& c, const Value& v) { at(c) = v.text; },
          [at](const TrainConfig& c) { return at(const_cast<TrainConfig&>(c)); }, ""};
}
template <typename At>
Key dtype_key(const char* name, const char* help, At at) {
  return {name, "dtype", help, [at](TrainConfig& c, const Value& v) { at(c) = as_dtype(v); },
          [at](const TrainConfig& c) { return dtype_text(at(const_cast<TrainConfig&>(c))); }, ""};
}
template <typename Get>
Key with_getter(Key k, Get get) {
  k.get = get;
  return k;
}
// A key a resume changes freely: how the run is laid out, timed, reported or stored.
Key free_on_resume(Key k) {
  k.resume = ResumeRule::kFree;
  return k;
}
Key derived(Key k, const char* how) {
  k.derived = how;
  return k;
}

#define HP_FIELD(expr) [](TrainConfig& c) -> auto& { return c.expr; }

void positive(const Value& v, double x) {
  if (x <= 0) v.fail("must be > 0");
}
void nonneg(const Value& v, double x) {
  if (x < 0) v.fail("must be >= 0");
}
void beta(const Value& v, double x) {
  if (x < 0 || x >= 1) v.fail("must be in [0, 1)");
}

// The model's family, preset and Hugging Face source (its fields come from the family: model_keys()).
void add_model_keys(std::vector<Key>& k) {
  // model.type and model.preset are applied first, then the family's fields override the
  // preset (model_keys()).
  k.push_back(free_on_resume({"model.type", "family", "model family (hp-train --list-keys shows each one's keys)",
               [](TrainConfig& c, const Value& v) {
                 std::string all;
                 for (const models::ModelFamily* f : models::model_families()) {
                   if (f->name() == v.text) {
                     c.model = ModelSpec(v.text);
                     return;
                   }
                   all += (all.empty() ? "" : ", ") + f->name();
                 }
                 v.fail("expected one of: ", all);
               },
               [](const TrainConfig& c) { return c.model.family().name(); }, ""}));
  k.push_back(free_on_resume({"model.preset", "name", "base sizes the model's fields start from (each family's presets)",
               [](TrainConfig& c, const Value& v) {
                 const std::vector<std::string> presets = c.model.family().presets();
                 if (std::find(presets.begin(), presets.end(), v.text) == presets.end()) {
                   std::string all;
                   for (const auto& p : presets) all += (all.empty() ? "" : ", ") + p;
                   v.fail("expected one of: ", all, " (the presets of model.type ", c.model.family().name(), ")");
                 }
                 c.model = ModelSpec(c.model.family().name(), v.text);
               },
               [](const TrainConfig& c) { return c.model.preset(); }, ""}));
  k.push_back(free_on_resume({"model.from_hf", "path",
               "a Hugging Face model folder: the model's family and sizes read from its config.json (the other "
               "model keys then override and are checked against it) and, unless init_from_hf says otherwise, its "
               "weights",
               [](TrainConfig& c, const Value& v) {
                 if (v.text.empty()) return;  // as a checkpoint records it: the sizes are its other keys
                 const std::string path = v.text + "/config.json";
                 std::string text;
                 try {
                   text = hp::files::read_regular(path, "config.json");
                 } catch (const Error& e) {
                   v.fail("no config.json there (not a Hugging Face model folder): ", e.what());
                 }
                 auto args = models::model_from_hf_config(text, path);
                 if (c.given.count("model.type") && &args->family() != &c.model.family()) {
                   v.fail("its config.json describes a ", args->family().name(), " model, but model.type is ",
                          c.model.family().name());
                 }
                 c.model = ModelSpec(std::move(args), v.text);
                 if (!c.given.count("init_from_hf")) c.init_from_hf = v.text;
               },
               // Not recorded: a checkpoint (and a resumed run) holds the sizes as the other
               // keys, and the folder may be gone by then.
               [](const TrainConfig&) { return std::string(); }, ""}));
}

// The data source.
void add_data_keys(std::vector<Key>& k) {
  k.push_back(enum_key<DataType>("data.type",
                                 "synthetic corpus, a file of token ids, UTF-8 text (byte tokens), or Megatron-LM's "
                                 "indexed dataset (data.path: the prefix of its .bin and .idx)",
                                 HP_FIELD(data.type)));
  k.push_back(path_key("data.path", "the binary or text file", HP_FIELD(data.path)));
  k.push_back(free_on_resume(path_key("data.valid_path",
                       "the validation set, of data.type (eval_interval > 0; synthetic data holds out its own)",
                       HP_FIELD(data.valid_path))));
  k.push_back(enum_key<TokenDtype>("data.token_dtype", "token id width of a binary file", HP_FIELD(data.token_dtype)));
  k.push_back(int_key("data.num_samples", "samples in the synthetic corpus", HP_FIELD(data.num_samples), 1, kMaxCount));
  k.push_back(bool_key("data.shuffle", "a new sample order each epoch", HP_FIELD(data.shuffle)));
}

// Device, dtypes and the parallel layout.
void add_precision_and_layout_keys(std::vector<Key>& k) {
  k.push_back(free_on_resume(enum_key<Device>("device",
                               "where each rank trains: cpu, or cuda (the GPU of its local rank, collectives "
                               "over nccl; a build with CUDA and NCCL)",
                               HP_FIELD(device))));
  k.push_back(dtype_key("params_dtype", "dtype of the (sharded) parameters", HP_FIELD(params_dtype)));
  k.push_back(derived(dtype_key("compute_dtype", "dtype of forward/backward (the all-gather)", HP_FIELD(compute_dtype)),
                      "params_dtype"));
  k.push_back(bool_key("accumulate_allreduce_grads_in_fp32",
                       "reduce gradients in fp32; with low-precision params, fp32 main grads and master weights",
                       HP_FIELD(accumulate_allreduce_grads_in_fp32)));
  k.push_back(bool_key("apply_grad_on_fp32_main_grad",
                       "reduced gradients accumulate into an fp32 main gradient per shard, which the optimizer steps "
                       "with (needs accumulate_allreduce_grads_in_fp32; implied for low-precision params)",
                       HP_FIELD(apply_grad_on_fp32_main_grad)));
  k.push_back(free_on_resume(int_key("data_parallel", "replicas (HSDP dp_replicate)", HP_FIELD(data_parallel), 1, kMaxRanks)));
  {
    Key shard = int_key("data_parallel_shard", "ranks a replica is sharded over; -1 = the rest",
                        HP_FIELD(data_parallel_shard), -1, kMaxRanks);
    Setter inner = shard.set;
    shard.set = [inner](TrainConfig& c, const Value& v) {
      inner(c, v);
      if (c.data_parallel_shard == 0) v.fail("must be >= 1 or -1");
    };
    k.push_back(free_on_resume(shard));
  }
  k.push_back(free_on_resume(enum_key<ShardStrategy>("data_parallel_shard_strategy",
                                      "ZeRO-3 (reshard after forward), ZeRO-2 (keep parameters until backward) or "
                                      "ZeRO-1 (keep parameters and unsharded gradients through the step)",
                                      HP_FIELD(data_parallel_shard_strategy))));
  k.push_back(free_on_resume(int_key("reshard_after_forward_group_size",
                      "with optim_grads_params: after forward keep parameters sharded over groups of this many "
                      "data_parallel_shard ranks, gathered within the group for backward; 0 = over all of them",
                      HP_FIELD(reshard_after_forward_group_size), 0, kMaxRanks)));
  k.push_back(free_on_resume(bool_key("comm_fusion", "one fused all-gather/reduce-scatter per block", HP_FIELD(comm_fusion))));
  k.push_back(free_on_resume(bool_key("wait_per_submodule",
                       "in forward, wait for each of a block's parameters when its layer is called, not for the "
                       "whole block at its start (needs comm_fusion false)",
                       HP_FIELD(wait_per_submodule))));
  k.push_back(free_on_resume(enum_key<Recompute>("recompute",
                                  "activation recomputation of every block: full recomputes its activations in "
                                  "backward, selective keeps its matmul outputs and recomputes the rest, light "
                                  "(DeepSeek-V3's) keeps those, attention's and the experts' exchanges and recomputes the "
                                  "norms, MLA's up-projections and the activations",
                                  HP_FIELD(recompute))));
  k.push_back(free_on_resume(int_key("tensor_parallel", "tensor-parallel size (ranks each layer is split over)",
                      HP_FIELD(tensor_parallel), 1, kMaxRanks)));
  k.push_back(free_on_resume(bool_key("sequence_parallel", "sequence parallel (needs tensor_parallel > 1)", HP_FIELD(sequence_parallel))));
  k.push_back(free_on_resume(int_key("expert_parallel",
                      "expert-parallel size: each MoE's routed experts split over this many consecutive "
                      "data_parallel_shard ranks, which exchange tokens (must divide data_parallel_shard; with "
                      "tensor_parallel > 1 and sequence_parallel: tensor_parallel x a divisor of it, the EP group "
                      "taking the tp ranks)",
                      HP_FIELD(expert_parallel), 1, kMaxRanks)));
  k.push_back(free_on_resume(enum_key<ep::DispatcherKind>(
      "moe_dispatcher",
      "with expert_parallel > 1: all_to_all sends a row per (token, chosen expert), dedup one copy of a token per "
      "rank holding any of its experts (fewer bytes, two small all-to-alls more; the same results)",
      HP_FIELD(moe_dispatcher))));
  k.push_back(free_on_resume(int_key("moe_overlap_chunks",
                      "with expert_parallel > 1: each MoE's all-to-alls in this many chunks of its local experts, "
                      "each chunk's experts running while the other chunks' rows move (1: no overlap; at most "
                      "experts / expert_parallel; bitwise the same results; the all_to_all dispatcher only)",
                      HP_FIELD(moe_overlap_chunks), 1, kMaxCount)));
  k.push_back(free_on_resume(int_key("context_parallel",
                      "context-parallel size: each sequence split over this many ranks (seq_length a multiple of "
                      "2 x context_parallel), attention over the whole sequence; fully_shard shards over "
                      "data_parallel_shard x context_parallel",
                      HP_FIELD(context_parallel), 1, kMaxRanks)));
  k.push_back(free_on_resume(enum_key<cp::Method>(
      "context_parallel_method",
      "with context_parallel > 1: ring passes key/value blocks around the ranks (overlapped with the compute), "
      "allgather gathers every rank's keys and values, ulysses exchanges heads for sequence by all-to-all (heads "
      "and kv heads divisible by context_parallel)",
      HP_FIELD(context_parallel_method))));
  k.push_back(free_on_resume(int_key("pipeline_parallel", "pipeline-parallel size (ranks the layers are split over)",
                      HP_FIELD(pipeline_parallel), 1, kMaxRanks)));
  k.push_back(free_on_resume(int_key("pipeline_parallel_interleave_num", "stages per pipeline rank (interleaved schedule)",
                      HP_FIELD(pipeline_parallel_interleave_num), 1, kMaxRanks)));
  k.push_back(free_on_resume(enum_key<PipelineScheduleKind>(
      "pipeline_schedule",
      "pipeline schedule; auto = 1f1b, or interleaved with pipeline_parallel_interleave_num > 1; zbh1 = zero bubble "
      "(backward split into input and weight gradients); zbv = zero bubble with 2 stages per rank in a V "
      "(pipeline_parallel_interleave_num 2); dualpipev = DeepSeek's V of 2 stages per rank with paired forwards "
      "and backwards (pipeline_parallel_interleave_num 2, micro_batch_num >= 2 x pipeline_parallel)",
      HP_FIELD(pipeline_schedule))));
  k.push_back(free_on_resume(bool_key("pipeline_pair_overlap",
                                      "a paired forward and backward (dualpipev) take turns: each computes while the "
                                      "other's expert all-to-all travels (bitwise the same training); false: one "
                                      "after the other",
                                      HP_FIELD(pipeline_pair_overlap))));
  k.push_back(free_on_resume(derived({"pipeline_stage_layers", "list",
                       "layers of each pipeline stage, e.g. [2, 1, 1] (pipeline_parallel x interleave entries); "
                       "empty = even",
                       [](TrainConfig& c, const Value& v) { c.pipeline_stage_layers = as_int_list(v, 1, kMaxModelInt); },
                       [](const TrainConfig& c) { return list_text(c.pipeline_stage_layers); }, ""},
                      "[] (even)")));
}

// Batch, schedule and AdamW.
void add_batch_and_adamw_keys(std::vector<Key>& k) {
  k.push_back(free_on_resume(int_key("micro_batch_num", "micro-batches per step (pipeline micro-batches, or gradient accumulation)",
                      HP_FIELD(micro_batch_num), 1, kMaxRanks)));
  k.push_back(int_key("global_batch_size", "samples per optimizer step, all ranks together",
                      HP_FIELD(global_batch_size), 1, kMaxRanks));
  k.push_back(int_key("seq_length", "tokens per sample", HP_FIELD(seq_length), 1, kMaxModelInt));
  k.push_back(float_key("lr", "peak learning rate (0: the weights stay as they are)", HP_FIELD(lr), nonneg));
  k.push_back(float_key("min_lr", "learning rate at the end of the decay", HP_FIELD(min_lr), nonneg));
  k.push_back(int_key("lr_warmup_steps", "steps of linear warmup", HP_FIELD(lr_warmup_steps), 0, kMaxCount));
  k.push_back(enum_key<LrDecay>("lr_decay_style", "decay from lr to min_lr after warmup", HP_FIELD(lr_decay_style)));
  k.push_back(float_key("weight_decay", "AdamW decoupled weight decay (matrices only)", HP_FIELD(weight_decay), nonneg));
  k.push_back(float_key("adam_beta1", "AdamW beta1", HP_FIELD(adam_beta1), beta));
  k.push_back(float_key("adam_beta2", "AdamW beta2", HP_FIELD(adam_beta2), beta));
  k.push_back(float_key("adam_eps", "AdamW epsilon", HP_FIELD(adam_eps), positive));
  k.push_back(enum_key<OptimizerKind>(
      "optimizer",
      "adamw, or muon: Muon for the hidden matrices (2-D weights other than the embedding and output head), "
      "AdamW (the adam_* keys, lr, weight_decay) for the rest",
      HP_FIELD(optimizer)));
}

// optimizer: muon's keys.
void add_muon_keys(std::vector<Key>& k) {
  // Derived from AdamW's until set (the field holds -1 then): the getter gives the value in
  // effect, so that the settings text parses back before validate() resolves it too.
  k.push_back(derived(with_getter(float_key("muon_lr", "Muon's peak learning rate (scheduled like lr)",
                                            HP_FIELD(muon_lr), nonneg),
                                  [](const TrainConfig& c) { return double_text(c.muon_lr < 0 ? c.lr : c.muon_lr); }),
                      "lr"));
  k.push_back(float_key("muon_momentum", "Muon's momentum", HP_FIELD(muon_momentum), beta));
  k.push_back(bool_key("muon_nesterov", "Muon's Nesterov momentum", HP_FIELD(muon_nesterov)));
  k.push_back(derived(with_getter(float_key("muon_weight_decay", "Muon's decoupled weight decay (with the unscaled lr)",
                                            HP_FIELD(muon_weight_decay), nonneg),
                                  [](const TrainConfig& c) {
                                    return double_text(c.muon_weight_decay < 0 ? c.weight_decay : c.muon_weight_decay);
                                  }),
                      "weight_decay"));
  k.push_back(enum_key<optim::NsSchedule>(
      "muon_ns_coefficients",
      "the Newton-Schulz coefficients: quintic (3.4445, -4.7750, 2.0315) each step, per_step (five tuned triples), "
      "deepseek_v4 (8 quintic steps, then 2 of (2, -1.5, 0.5))",
      HP_FIELD(muon_ns_coefficients)));
  k.push_back(int_key("muon_ns_steps", "Newton-Schulz steps; 0 = the coefficients' own (5, 5, 10); only quintic "
                      "takes another count",
                      HP_FIELD(muon_ns_steps), 0, 100));
  k.push_back(dtype_key("muon_ns_dtype", "dtype of the Newton-Schulz iteration (bfloat16, float32 or float64)",
                        HP_FIELD(muon_ns_dtype)));
  k.push_back(enum_key<optim::MuonScale>(
      "muon_update_scale",
      "rms: 0.2 sqrt(max(rows, cols)), an update of AdamW's RMS (its lr carries over); original: "
      "sqrt(max(1, rows / cols))",
      HP_FIELD(muon_update_scale)));
  k.push_back(float_key("muon_update_rms",
                        "with muon_update_scale: rms, the RMS of Muon's update (0.2: about AdamW's, so that its lr "
                        "carries over; the scale is this x sqrt(max(rows, cols)))",
                        HP_FIELD(muon_update_rms), positive));
  k.push_back(free_on_resume(enum_key<optim::MuonScheme>(
      "muon_scheme",
      "owner: each whole matrix orthogonalized by one rank holding a piece of it, balanced by cost; "
      "gather_everywhere: by every rank holding a piece (the baseline)",
      HP_FIELD(muon_scheme))));
  k.push_back({"muon_to_adamw", "list",
               "with optimizer: muon, parameter-name patterns (`*` any characters) trained by AdamW besides the "
               "token tables, e.g. [layers_*.attn.wo.weight]; each must match a parameter",
               [](TrainConfig& c, const Value& v) { c.muon_to_adamw = as_pattern_list(v); },
               [](const TrainConfig& c) { return list_text(c.muon_to_adamw); }, ""});
  k.push_back({"muon_to_muon", "list",
               "with optimizer: muon, parameter-name patterns trained by Muon even if they are token tables, e.g. "
               "[output.weight] (2-D only); each must match a parameter, none one muon_to_adamw matches",
               [](TrainConfig& c, const Value& v) { c.muon_to_muon = as_pattern_list(v); },
               [](const TrainConfig& c) { return list_text(c.muon_to_muon); }, ""});
}

// Clipping, steps, logging, validation, output and checkpoints.
void add_run_keys(std::vector<Key>& k) {
  k.push_back(float_key("clip_grad", "global gradient-norm limit; 0 = no clipping", HP_FIELD(clip_grad), nonneg));
  k.push_back(int_key("train_steps", "optimizer steps", HP_FIELD(train_steps), 1, kMaxCount));
  k.push_back({"seed", "int", "initialization and data order",
               [](TrainConfig& c, const Value& v) { c.seed = static_cast<uint64_t>(as_int(v, 0)); },
               [](const TrainConfig& c) { return std::to_string(c.seed); }, ""});
  k.push_back(free_on_resume(int_key("log_interval", "steps between progress lines", HP_FIELD(log_interval), 1, kMaxCount)));
  k.push_back(free_on_resume(int_key("eval_interval",
                      "validation loss every this many steps and after the last, without gradients; 0 = none",
                      HP_FIELD(eval_interval), 0, kMaxCount)));
  k.push_back(free_on_resume(int_key("eval_steps", "global batches of the validation set per evaluation; 0 = all of it",
                      HP_FIELD(eval_steps), 0, kMaxCount)));
  k.push_back(free_on_resume(path_key("output_dir", "metrics.jsonl and loss.svg go here; empty = none", HP_FIELD(output_dir))));
  k.push_back(free_on_resume(int_key("save_interval", "save a checkpoint every this many steps and after the last; 0 = never",
                      HP_FIELD(save_interval), 0, kMaxModelInt)));
  k.push_back(free_on_resume(derived(path_key("save_dir", "checkpoints go here (step_<k> folders and 'latest')", HP_FIELD(save_dir)),
                      "output_dir/checkpoints")));
  k.push_back(free_on_resume(int_key("keep_last_n", "keep only the newest n checkpoints (older ones removed after a save); 0 = all",
                      HP_FIELD(keep_last_n), 0, kMaxModelInt)));
  k.push_back(free_on_resume(bool_key("async_save", "write checkpoints in the background (the state is copied first)",
                       HP_FIELD(async_save))));
  k.push_back(free_on_resume(path_key("init_from_hf",
                       "start from the weights of this Hugging Face model folder instead of the seed (a family "
                       "with Hugging Face names: llama, deepseek, qwen3_moe, mixtral; model.from_hf sets it)",
                       HP_FIELD(init_from_hf))));
  k.push_back(free_on_resume(bool_key("init_from_hf_drop_mtp",
                       "leave init_from_hf's multi-token prediction modules unread where the model has fewer (DeepSeek-V3's "
                       "model.layers.61 with model.mtp_layers 0; otherwise an error)",
                       HP_FIELD(init_from_hf_drop_mtp))));
}

const std::vector<Key>& keys() {
  static const std::vector<Key> k = [] {
    std::vector<Key> k;
    add_model_keys(k);
    add_data_keys(k);
    add_precision_and_layout_keys(k);
    add_batch_and_adamw_keys(k);
    add_muon_keys(k);
    add_run_keys(k);
    return k;
  }();
  return k;
}

#undef HP_FIELD

// A model field's key: "model." + the family key's name.
const models::ModelKey* family_key(const models::ModelFamily& f, const std::string& key) {
  if (key.rfind("model.", 0) != 0) return nullptr;
  const std::string field = key.substr(6);
  for (const models::ModelKey& k : f.keys()) {
    if (k.name == field) return &k;
  }
  return nullptr;
}

void set_model_field(TrainConfig& c, const models::ModelKey& k, const Value& v) {
  models::ModelValue x;
  switch (k.kind) {
    case models::ModelKey::Kind::kInt: {
      const int64_t n = as_int(v, static_cast<int64_t>(k.min), kMaxModelInt);
      if (k.above_min && static_cast<double>(n) <= k.min) v.fail("must be > ", static_cast<int64_t>(k.min));
      x = n;
      break;
    }
    case models::ModelKey::Kind::kFloat: {
      const double d = as_double(v);
      if (k.above_min ? d <= k.min : d < k.min) v.fail("must be ", k.above_min ? "> " : ">= ", k.min);
      x = d;
      break;
    }
    case models::ModelKey::Kind::kBool:
      x = as_bool(v);
      break;
    case models::ModelKey::Kind::kChoice: {
      const auto it = std::find(k.choices.begin(), k.choices.end(), v.text);
      if (it == k.choices.end()) {
        std::string all;
        for (const auto& name : k.choices) all += (all.empty() ? "" : ", ") + name;
        v.fail("expected one of: ", all);
      }
      x = static_cast<int64_t>(it - k.choices.begin());
      break;
    }
  }
  k.set(c.model.args(), x);
}

std::string model_value_text(const models::ModelKey& k, const models::ModelValue& v) {
  if (k.kind == models::ModelKey::Kind::kChoice) return k.choices.at(static_cast<size_t>(std::get<int64_t>(v)));
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) return double_text(*d);
  return bool_text(std::get<bool>(v));
}

const char* kind_name(models::ModelKey::Kind k) {
  switch (k) {
    case models::ModelKey::Kind::kInt:
      return "int";
    case models::ModelKey::Kind::kFloat:
      return "float";
    case models::ModelKey::Kind::kBool:
      return "bool";
    case models::ModelKey::Kind::kChoice:
      return "choice";
  }
  return "?";
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

// Every key's name: the table's and each family's model fields.
std::vector<std::string> all_key_names() {
  std::vector<std::string> out;
  for (const Key& k : keys()) out.push_back(k.name);
  for (const models::ModelFamily* f : models::model_families()) {
    for (const models::ModelKey& m : f->keys()) {
      const std::string name = "model." + m.name;
      if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
    }
  }
  return out;
}

// Raises for a key that neither the table nor any family declares, suggesting the nearest.
void check_known(const Value& v) {
  const std::string* best = nullptr;
  size_t best_d = SIZE_MAX;
  const std::vector<std::string> names = all_key_names();
  for (const std::string& n : names) {
    if (n == v.key) return;
    size_t d = edit_distance(n, v.key);
    if (d < best_d) best_d = d, best = &n;
  }
  std::ostringstream os;
  os << v.origin << ": unknown config key '" << v.key << "'";
  if (best && best_d <= std::max<size_t>(2, v.key.size() / 4)) os << " (did you mean '" << *best << "'?)";
  os << "; hp-train --list-keys lists them all";
  throw Error(os.str());
}

const Key* table_key(const std::string& name) {
  for (const Key& k : keys()) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

// Applies a known key to `c` (whose model family is already chosen).
void apply(TrainConfig& c, const Value& v) {
  if (const Key* k = table_key(v.key)) return k->set(c, v);
  if (const models::ModelKey* m = family_key(c.model.family(), v.key)) return set_model_field(c, *m, v);
  std::string owners;
  for (const models::ModelFamily* f : models::model_families()) {
    if (family_key(*f, v.key)) owners += (owners.empty() ? "" : " or ") + f->name();
  }
  v.fail("a key of model.type ", owners, ", but model.type is ", c.model.family().name());
}

// Flattens YAML maps into dotted keys (model: {dim: 64} -> model.dim).
bool is_model_first(const std::string& key) {
  return key == "model.type" || key == "model.preset" || key == "model.from_hf";
}

void apply_model_first(TrainConfig& c, const std::vector<Value>& values) {
  for (const char* first : {"model.type", "model.preset", "model.from_hf"}) {
    for (const Value& v : values) {
      if (v.key == first) apply(c, v);
    }
  }
}

}  // namespace internal

using namespace internal;

std::vector<KeyInfo> config_keys() {
  const TrainConfig defaults;
  std::vector<KeyInfo> out;
  for (const Key& k : keys()) {
    out.push_back({k.name, k.type, k.derived.empty() ? k.get(defaults) : k.derived, k.help});
    if (k.name == "model.type") {  // the families registered now
      out.back().type.clear();
      for (const models::ModelFamily* f : models::model_families()) {
        out.back().type += (out.back().type.empty() ? "" : "|") + f->name();
      }
    }
    if (k.name != "model.preset") continue;
    // The model's fields after the preset: each once, tagged with the families that have it
    // unless all do, its default the preset's.
    const auto families = models::model_families();
    std::vector<std::string> done;
    for (const models::ModelFamily* f : families) {
      for (const models::ModelKey& m : f->keys()) {
        if (std::find(done.begin(), done.end(), m.name) != done.end()) continue;
        done.push_back(m.name);
        std::vector<std::string> owners;
        for (const models::ModelFamily* g : families) {
          if (family_key(*g, "model." + m.name)) owners.push_back(g->name());
        }
        std::string help = m.help;
        if (owners.size() < families.size()) {
          std::string tag;
          for (const auto& o : owners) tag += (tag.empty() ? "" : ", ") + o;
          help += " [" + tag + "]";
        }
        std::string type = kind_name(m.kind);
        if (m.kind == models::ModelKey::Kind::kChoice) {
          type.clear();
          for (const auto& name : m.choices) type += (type.empty() ? "" : "|") + name;
        }
        out.push_back({"model." + m.name, type, "preset", help});
      }
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> resolved_settings(const TrainConfig& c) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Key& k : keys()) {
    out.emplace_back(k.name, k.get(c));
    if (k.name != "model.preset") continue;
    for (const models::ModelKey& m : c.model.family().keys()) {
      out.emplace_back("model." + m.name, model_value_text(m, m.get(c.model.args())));
    }
  }
  return out;
}

ResumeRule resume_rule(const TrainConfig& c, const std::string& key) {
  for (const Key& k : keys()) {
    if (k.name == key) return k.resume;
  }
  if (const models::ModelKey* m = family_key(c.model.family(), key)) return m->resume;
  throw Error("resume_rule: '" + key + "' is not a config key of a " + c.model.family().name() + " model");
}

bool follows_another_key(const TrainConfig& c, const std::string& key) {
  for (const Key& k : keys()) {
    if (k.name == key) return !k.derived.empty() && !c.given.count(key);
  }
  return false;
}

ModelSpec model_from_settings(const std::vector<std::pair<std::string, std::string>>& settings,
                              const std::string& source) {
  std::vector<Value> values;
  for (const auto& [k, v] : settings) {
    if (k.rfind("model.", 0) == 0) values.push_back({k, v, source});
  }
  TrainConfig c;
  for (const Value& v : values) check_known(v);
  apply_model_first(c, values);
  for (const Value& v : values) {
    if (!is_model_first(v.key)) apply(c, v);
  }
  return c.model;
}

}  // namespace hp::train
