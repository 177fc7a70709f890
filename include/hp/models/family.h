// The model-family seam: everything the trainer, the planner and the memory estimate need
// to know about a kind of model, behind one interface, so that none of them names a model.
//
//   ModelFamily   a kind of model (Llama, DeepSeek-V3): its name, its presets, the config
//                 keys of its fields (model.<field>).
//   ModelArgs     one configured model of a family (its sizes): parameter counts (whole, per
//                 pipeline slice, per tensor-parallel rank), FLOPs and activations per token,
//                 validation, the tensor-parallel check, Hugging Face names and config, and
//                 the factory that builds it.
//   Model         a built model: the root module, its blocks (fully_shard's units), forward,
//                 the loss, the tensor-parallel plan and the step hook.
//
// Families are found by name in a registry (model_family); the built-in ones are listed in
// src/models/family.cpp, one line each, and register_model_family adds others (a test's toy
// family, a user's model) at run time. A new family implements ModelFamily and ModelArgs in
// models/ and touches nothing above.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/core/error.h"
#include "hp/cp/context_parallel.h"
#include "hp/ep/dispatch.h"
#include "hp/hooks/recompute.h"
#include "hp/models/pipeline_slice.h"

namespace hp::models {

class ModelFamily;

// The most blocks a model may have: far beyond any real model's (Llama 3.1 405B has 126),
// low enough that what is listed per block (Hugging Face names, plans) stays small for a
// damaged config.json or a typo (a config naming 222222228 layers listed 2 billion names).
constexpr int64_t kMaxLayers = 10000;

// One MoE block's routing in the last step (Model::expert_load), summed over the
// data-parallel ranks.
struct ExpertLoad {
  int64_t layer = 0;   // in the whole model
  at::Tensor tokens;   // [experts]: the slots the router gave each expert
  double dropped = 0;  // of all of them, the slots a capacity limit dropped
};

// A built model (one pipeline stage's part of it, or the whole).
class Model {
 public:
  virtual ~Model() = default;
  virtual torch::nn::Module& root() = 0;
  // The blocks, in order: each becomes a fully_shard unit before the root.
  virtual std::vector<torch::nn::Module*> blocks() = 0;
  // Logits [B, T, vocab] of tokens [B, T]; through hp::call (so fully_shard's hooks run)
  // when `hooked`. Under tensor parallelism with loss parallel, this rank's vocabulary piece.
  virtual at::Tensor forward(const at::Tensor& tokens, bool hooked) = 0;
  // Mean cross-entropy of forward's logits (vocabulary-parallel when they are split).
  virtual at::Tensor loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) = 0;
  // The targets [B, T] (loss_of_logits's) of the next forward, for a model whose training
  // forward reads them (DeepSeek-V3's multi-token prediction learns the token after the
  // next); give them before every differentiated forward. Others ignore them.
  virtual void set_targets(const at::Tensor& targets) {}
  // The multi-token prediction losses of the differentiated forwards since the last call
  // (each one micro-batch's mean): their sum and how many. {0, 0} for a model without
  // multi-token prediction, or a pipeline stage without the head.
  struct LossSum {
    double sum = 0;
    int64_t count = 0;
  };
  virtual LossSum take_mtp_loss() { return {}; }
  // Deterministic, layout-independent initialization from `seed`.
  virtual void init_weights(uint64_t seed) = 0;
  // Applies tensor (and sequence) parallelism over `tp` (before fully_shard); raises "not
  // supported yet" for a family without a plan.
  virtual void parallelize(const CommPtr& tp, bool sequence_parallel, c10::optional<at::ScalarType> reduce_dtype) = 0;
  // After each optimizer step (DeepSeek: the balancing bias from the load summed over `dp`;
  // null `dp`: this process only).
  virtual void after_step(const CommPtr& dp) {}
  // What each micro-batch's loss is multiplied by before backward (1 / micro-batches): a
  // loss the model adds inside (DeepSeek's balance loss) gets its gradient scaled alike.
  virtual void set_loss_scale(double scale) {}
  // Expert parallelism over `ep` (before fully_shard, after tensor parallelism): keeps this
  // rank's routed experts and sends tokens to the ranks holding the others (hp/ep). Raises
  // "not supported yet" for a family without routed experts.
  virtual void expert_parallel(const CommPtr& ep, const ep::DispatchOptions& o);
  // Context parallelism through `ctx` (hp/cp): forward then takes this CP rank's tokens of
  // each sequence (cp::shard) and attends over the whole sequence. Raises "not supported
  // yet" for a family without it.
  virtual void context_parallel(std::shared_ptr<cp::ContextParallel> ctx);
  // The modules holding routed experts (each a fully_shard unit of its own, sharded over the
  // ranks holding the same experts); none for a model without them.
  virtual std::vector<torch::nn::Module*> expert_modules() { return {}; }
  // Each MoE block's (of this model part) routing in the last step, as after_step's
  // balancing saw it. Empty before the first after_step, and for a model without routed
  // experts.
  virtual std::vector<ExpertLoad> expert_load() const { return {}; }
};

// Forward FLOPs of one sequence position: per block (its matmuls and attention's two
// products over the sequence) and of the head.
struct FlopCount {
  double block = 0, head = 0;
  // Of block: the matmuls RecomputePolicy::kLight runs again in backward (those the model
  // marks hp::recomputed_here: MLA's up-projections; the norms and activations it also
  // recomputes are not matmuls and not counted).
  double light_recompute = 0;
  // Of block: the routed experts a token runs and the shared experts (a MoE block's; 0
  // without), what an overlapped expert exchange hides behind (ep::overlap_exposure).
  double routed = 0, shared = 0;
};
// Activation elements one sequence position keeps for backward: per block and of the head
// (the logits, their fp32 copy and probabilities).
struct ActivationCount {
  double block = 0, head = 0;
  // Of block: what attention keeps beyond its inputs and output, one log-sum-exp per head
  // (the tiled kernel, hp/attn, keeps no probabilities).
  double attention = 0;
  // Not per token: what one sequence's attention holds while a block computes, float32
  // elements (attn::tile_workspace_elements for every head).
  double attention_workspace = 0;
  // What a block keeps per position under RecomputePolicy::kLight: its input, the outputs
  // of the Linear calls it does not recompute, attention's output and log-sum-exps.
  double light = 0;
};
// Elements per token of one attention layer: its keys and values (what context
// parallelism's ring and all-gather exchange) and its queries and output (what Ulysses
// exchanges besides). Zeros: a family without context parallelism.
struct AttentionWidths {
  double kv = 0, q_out = 0;
  int64_t heads = 0, kv_heads = 0;  // query heads, and key/value heads (MLA: heads)
};

// The value of one model field, as its key's kind says.
using ModelValue = std::variant<int64_t, double, bool>;

// What resuming a checkpoint may do with a change of a setting (the checkpoint records every
// setting of its run):
//   kFree        how the run is laid out, timed, reported or stored (parallel degrees,
//                recompute, attention tiles, intervals, folders): changes, said in a line;
//   kTrajectory  what the run computes (seed, batch, data, schedule, optimizer, an MoE's
//                capacity or balancing): refused unless the resume names it as allowed
//                (hp-train --resume-changes);
//   kFixed       the model's shape and function: never (its weights are of that model).
enum class ResumeRule { kFree, kTrajectory, kFixed };

// One field of a family's config that hp-train's model.<name> key sets.
struct ModelKey {
  enum class Kind { kInt, kFloat, kBool, kChoice };
  std::string name;  // without "model."
  Kind kind = Kind::kInt;
  // Int and float: the smallest value accepted; above_min: the value must be greater.
  double min = 0;
  bool above_min = false;
  std::string help;
  std::function<void(class ModelArgs&, const ModelValue&)> set;
  std::function<ModelValue(const class ModelArgs&)> get;
  std::vector<std::string> choices;  // kChoice: the names accepted; the value is the index
  ResumeRule resume = ResumeRule::kFixed;
};

// `k` with resume rule `r` (for ModelFamily::keys()).
inline ModelKey on_resume(ModelKey k, ResumeRule r) {
  k.resume = r;
  return k;
}

// One configured model of a family: sizes and arithmetic from the config alone (nothing
// allocated), and the factory.
class ModelArgs {
 public:
  virtual ~ModelArgs() = default;
  virtual std::unique_ptr<ModelArgs> clone() const = 0;
  virtual const ModelFamily& family() const = 0;

  virtual int64_t vocab() const = 0;
  virtual int64_t dim() const = 0;  // the residual stream's width
  virtual int64_t layers() const = 0;
  virtual int64_t max_seq() const = 0;
  // A dense feed-forward's hidden size (the planner times matmuls at it).
  virtual int64_t ffn_hidden() const = 0;

  virtual int64_t num_params() const = 0;
  virtual int64_t largest_param() const = 0;  // elements of the largest single parameter
  virtual int64_t largest_block_params() const = 0;
  // Parameters of a pipeline stage's part of the model (before tensor parallelism); a stage
  // that holds a copy of a tied parameter counts it.
  virtual int64_t stage_params(const PipelineSlice& slice) const = 0;
  // Parameters each tensor-parallel rank holds (before fully_shard): the split ones divided
  // by tp, the whole ones (whole_under_tp) in full. tp = 1: num_params().
  virtual int64_t params_per_tp_rank(int64_t tp) const = 0;
  virtual int64_t largest_block_params_per_tp_rank(int64_t tp) const = 0;
  // What tensor parallelism keeps whole on every rank, in words ("norms", ...).
  virtual std::string whole_under_tp() const = 0;
  // Of the largest block (without expert parallelism): the parameters tensor parallelism
  // keeps whole whose gradients arrive partial, each summed over the group by one all-reduce
  // in backward (tp::block_traffic): under sequence parallelism those used on sequence
  // pieces (norms, row-parallel biases), and those every rank uses on its share of the work
  // (MLA's down-projections, the router). None: a family without tensor parallelism.
  struct SummedParams {
    int64_t tensors = 0, elements = 0;
  };
  virtual SummedParams tp_summed_params(bool sequence_parallel) const { return {}; }
  virtual FlopCount flops_per_token(int64_t seq_length) const = 0;
  virtual ActivationCount activations_per_token(int64_t seq_length) const = 0;
  virtual AttentionWidths attention_widths() const { return {}; }

  // The same model with `layers` blocks, keeping the kinds of block it has (the planner
  // times a model of 1 and 2 layers).
  virtual void set_layers(int64_t layers) = 0;
  // Raises hp::Error naming the offending field.
  virtual void validate() const = 0;
  // Raises hp::Error naming the field when the model cannot be split over `tp` ranks.
  virtual void check_tensor_parallel(int64_t tp) const = 0;
  // Routed experts per MoE block (0: no mixture of experts, so no expert parallelism).
  virtual int64_t routed_experts() const { return 0; }
  // Multi-token prediction modules after the last block (DeepSeek-V3's: 1), each with a MoE
  // block numbered layers() + its index; 0 for a model without.
  virtual int64_t mtp_layers() const { return 0; }
  // The same model with `n` of them (an export for inference drops them); raises "not
  // supported yet" for a family without multi-token prediction.
  virtual void set_mtp_layers(int64_t n) {
    HP_CHECK(n == 0, "model family has no multi-token prediction: mtp_layers=", n, " is not supported yet");
  }
  // What expert parallelism divides and moves (0 for a model without routed experts): the
  // parameters of a slice's routed experts, those of one MoE block's, and the routed experts
  // each token uses.
  virtual int64_t stage_expert_params(const PipelineSlice& slice) const { return 0; }
  virtual int64_t block_expert_params() const { return 0; }
  virtual int64_t experts_per_token() const { return 0; }
  // One MoE block's shared (always-on) experts' parameters: split by tensor parallelism
  // alone, whole on every tp rank beside expert parallelism.
  virtual int64_t block_shared_expert_params() const { return 0; }
  // The largest block's parameters outside its routed experts (a dense block's, or a MoE
  // block's attention, router and shared experts): fully_shard's unit beside the experts'.
  virtual int64_t largest_block_params_outside_experts() const { return largest_block_params(); }
  // Names (in the whole model) of parameters that a pipeline's first and last stage each
  // hold a copy of, to be summed after backward (Llama's tied embedding).
  virtual std::vector<std::string> tied_parameters() const { return {}; }
  // Names (patterns with '*', in the whole model) of the 2-D parameters that are tables of
  // tokens rather than linear maps (the embedding, the output head): under Muon they stay
  // with AdamW. The reference families name theirs tok_emb and output.
  virtual std::vector<std::string> token_tables() const { return {"tok_emb.weight", "output.weight"}; }

  // Builds the model (a pipeline stage's part: `slice`), in fp32, not initialized; every
  // block checkpointed with `recompute` when set.
  virtual std::unique_ptr<Model> build(const PipelineSlice& slice, c10::optional<RecomputePolicy> recompute) const = 0;

  // Hugging Face interchange. supports_hf() false: the others raise "not supported yet".
  virtual bool supports_hf() const { return false; }
  // (ours, theirs) for every parameter, and each buffer the folder holds (DeepSeek's
  // balancing bias), in the order Hugging Face writes them.
  virtual std::vector<std::pair<std::string, std::string>> hf_names() const;
  // The config.json describing this model, its weights stored as `dtype`.
  virtual std::string hf_config(at::ScalarType dtype) const;
  // Raises naming the key where a config.json (its text; `path` names it) describes another model.
  virtual void check_hf_config(const std::string& text, const std::string& path) const;
  // Whether a tensor of a Hugging Face folder (its name there) that hf_names() does not list
  // may be passed over, as transformers passes over it: the rotary frequencies older
  // versions saved (recomputed from config.json), and what a family adds. Importing a folder
  // with any other tensor left over is an error: its config.json describes less than its
  // weights hold.
  virtual bool hf_ignores(const std::string& theirs) const;
  // Whether a tensor of a Hugging Face folder (its name there) belongs to a multi-token
  // prediction module this model does not have (DeepSeek-V3's model.layers.61 under
  // mtp_layers 0): left unread only where the run says so (init_from_hf_drop_mtp).
  virtual bool hf_unbuilt_mtp(const std::string& theirs) const { return false; }
};

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  virtual std::string name() const = 0;
  // The presets' names; the first is the default.
  virtual std::vector<std::string> presets() const = 0;
  // The preset's model; raises naming the accepted presets for another name.
  virtual std::unique_ptr<ModelArgs> preset(const std::string& name) const = 0;
  // The fields a config may set, in the order --list-keys shows them.
  virtual const std::vector<ModelKey>& keys() const = 0;
  // Hugging Face interchange: the config.json model_types this family reads (none where it
  // has no interchange), and the model a config.json (its text; `path` names it) describes.
  virtual std::vector<std::string> hf_model_types() const { return {}; }
  virtual std::unique_ptr<ModelArgs> from_hf_config(const std::string& text, const std::string& path) const;
};

// The family registered under `name`; raises listing the registered names.
const ModelFamily& model_family(const std::string& name);
// Every registered family, the built-in ones first, in registration order.
std::vector<const ModelFamily*> model_families();
// Adds `family` (kept for the process's life); raises when its name is taken.
void register_model_family(std::shared_ptr<const ModelFamily> family);
// The family a config without model.type trains.
const ModelFamily& default_model_family();
// Raises (`where` first) naming the first int or float field of `a` outside its key's range.
void check_key_ranges(const ModelArgs& a, const std::string& where);
// The model a Hugging Face config.json describes, by its model_type; raises naming the
// model_types the registered families read for another, and a value outside its key's range.
std::unique_ptr<ModelArgs> model_from_hf_config(const std::string& text, const std::string& path);

// A family's args holding its config struct `Config`: the common part of every family.
template <typename Config>
class ArgsOf : public ModelArgs {
 public:
  explicit ArgsOf(Config c) : config(std::move(c)) {}
  Config config;
};

// The config of `a` as family type Config; raises naming both families when `a` is another.
template <typename Config>
Config& config_of(ModelArgs& a) {
  auto* p = dynamic_cast<ArgsOf<Config>*>(&a);
  HP_CHECK(p != nullptr, "the model is of family ", a.family().name(), ", not the one asked for");
  return p->config;
}
template <typename Config>
const Config& config_of(const ModelArgs& a) {
  return config_of<Config>(const_cast<ModelArgs&>(a));
}

// Keys of a field of Config (for ModelFamily::keys()).
template <typename Config>
ModelKey int_key(const char* name, int64_t Config::*f, int64_t min, const char* help) {
  return {name, ModelKey::Kind::kInt, static_cast<double>(min), false, help,
          [f](ModelArgs& a, const ModelValue& v) { config_of<Config>(a).*f = std::get<int64_t>(v); },
          [f](const ModelArgs& a) { return ModelValue(config_of<Config>(a).*f); }};
}
template <typename Config>
ModelKey float_key(const char* name, double Config::*f, double min, bool above_min, const char* help) {
  return {name, ModelKey::Kind::kFloat, min, above_min, help,
          [f](ModelArgs& a, const ModelValue& v) { config_of<Config>(a).*f = std::get<double>(v); },
          [f](const ModelArgs& a) { return ModelValue(config_of<Config>(a).*f); }};
}
// A field of enum type E whose values are 0, 1, ... named by `choices` in that order.
template <typename Config, typename E>
ModelKey choice_key(const char* name, E Config::*f, std::vector<std::string> choices, const char* help) {
  ModelKey k{name, ModelKey::Kind::kChoice, 0, false, help,
             [f](ModelArgs& a, const ModelValue& v) { config_of<Config>(a).*f = static_cast<E>(std::get<int64_t>(v)); },
             [f](const ModelArgs& a) { return ModelValue(static_cast<int64_t>(config_of<Config>(a).*f)); }};
  k.choices = std::move(choices);
  return k;
}
template <typename Config>
ModelKey bool_key(const char* name, bool Config::*f, const char* help) {
  return {name, ModelKey::Kind::kBool, 0, false, help,
          [f](ModelArgs& a, const ModelValue& v) { config_of<Config>(a).*f = std::get<bool>(v); },
          [f](const ModelArgs& a) { return ModelValue(config_of<Config>(a).*f); }};
}

// The built-in families (src/models/llama_family.cpp, deepseek_family.cpp,
// qwen3_moe_family.cpp, mixtral_family.cpp).
std::shared_ptr<const ModelFamily> llama_family();
std::shared_ptr<const ModelFamily> deepseek_family();
std::shared_ptr<const ModelFamily> qwen3_moe_family();
std::shared_ptr<const ModelFamily> mixtral_family();

}  // namespace hp::models
