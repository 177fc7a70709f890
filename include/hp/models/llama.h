// Llama-style decoder: RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP,
// optional tied embeddings. Blocks call their children through hp::call, so fully_shard,
// tensor parallelism and recomputation apply per block and per layer.
//
// Initialization is deterministic and layout-independent: init_weights(seed) draws each
// parameter from a generator seeded by (seed, the parameter's name), so a parameter's
// values never depend on how many ranks there are or what else was built before it.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "hp/attn/attention.h"
#include "hp/comm/communicator.h"
#include "hp/cp/context_parallel.h"
#include "hp/hooks/recompute.h"
#include "hp/models/pipeline_slice.h"

namespace hp::models {

// How the rotary frequencies are stretched for contexts longer than trained on (Hugging
// Face's rope_scaling): not at all; every frequency divided by a factor (linear); or Llama
// 3.1's: low frequencies (wavelengths above original_max_seq / low_freq_factor) divided by
// the factor, high ones (below original_max_seq / high_freq_factor) kept, and those between
// blended smoothly (llama3); or YaRN's (yarn, as DeepSeek-V3 and transformers define it):
// the frequencies of the dims that turn fewer than beta_slow times over original_max_seq
// positions divided by the factor, those that turn more than beta_fast times kept, a linear
// ramp between (its ends rounded outwards), and the rotary tables multiplied by the
// attention factor, mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are
// given, else mscale(factor, 1), with mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1).
enum class RopeScaling { kNone, kLinear, kLlama3, kYarn };

struct RopeOptions {
  double theta = 10000.0;
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_seq = 8192;
  double beta_fast = 32, beta_slow = 1;    // yarn
  double mscale = 0, mscale_all_dim = 0;   // yarn; 0: not given
};

// YaRN's mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1).
double yarn_mscale(double scale, double m);
// What yarn multiplies the rotary tables by (1 for the other scalings).
double rope_attention_factor(const RopeOptions& rope);
// Raises naming `who`'s keys (model.rope_*) where the scaling's values cannot be right.
void check_rope(const RopeOptions& rope, const char* who);

// A config's rotary options from its fields of these names (LlamaConfig's, DeepSeekConfig's).
template <typename C>
RopeOptions rope_of(const C& c) {
  RopeOptions o;
  o.theta = c.rope_theta;
  o.scaling = c.rope_scaling;
  o.factor = c.rope_factor;
  o.low_freq_factor = c.rope_low_freq_factor;
  o.high_freq_factor = c.rope_high_freq_factor;
  o.original_max_seq = c.rope_original_max_seq;
  o.beta_fast = c.rope_beta_fast;
  o.beta_slow = c.rope_beta_slow;
  o.mscale = c.rope_mscale;
  o.mscale_all_dim = c.rope_mscale_all_dim;
  return o;
}
// ... and back.
template <typename C>
void set_rope(C& c, const RopeOptions& o) {
  c.rope_theta = o.theta;
  c.rope_scaling = o.scaling;
  c.rope_factor = o.factor;
  c.rope_low_freq_factor = o.low_freq_factor;
  c.rope_high_freq_factor = o.high_freq_factor;
  c.rope_original_max_seq = o.original_max_seq;
  c.rope_beta_fast = o.beta_fast;
  c.rope_beta_slow = o.beta_slow;
  c.rope_mscale = o.mscale;
  c.rope_mscale_all_dim = o.mscale_all_dim;
}

struct LlamaConfig {
  int64_t vocab = 256;
  int64_t dim = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;       // grouped-query attention: heads % kv_heads == 0
  int64_t ffn_dim = 0;        // 0: 8/3 * dim rounded up to a multiple of 32
  int64_t max_seq = 256;
  // Attention's tile (hp/attn): queries and keys in tiles of this many positions, with or
  // without context parallelism. A runtime choice: not part of a Hugging Face config.
  int64_t attention_tile = attn::kDefaultTile;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;
  // Rotary scaling (RopeOptions); the factors matter only where rope_scaling uses them.
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_seq = 8192;
  double rope_beta_fast = 32, rope_beta_slow = 1, rope_mscale = 0, rope_mscale_all_dim = 0;  // yarn
  // Attention head size when it is not dim / heads (0: dim / heads). The query and output
  // projections are then dim x heads * head_dim (Hugging Face's explicit head_dim).
  int64_t explicit_head_dim = 0;
  // Biases: on the query, key, value and output projections (Hugging Face's attention_bias),
  // and on the MLP's three (mlp_bias).
  bool attention_bias = false;
  bool mlp_bias = false;
  // Biases on the query, key and value projections only: the Qwen2 family (model_type
  // qwen2), which Hugging Face interchange reads and writes as such.
  bool qkv_bias = false;
  // RMSNorm (norm_eps) over each head's query and key dims before the rotary, one scale of
  // head_dim each (Qwen3's q_norm and k_norm: MoELlama's Qwen3 flavor sets it; the llama
  // family's keys and interchange do not).
  bool qk_norm = false;

  RopeOptions rope() const;
  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : dim / heads; }
  int64_t hidden_dim() const;
  // Parameters of the model, computed from the config alone (nothing allocated).
  int64_t num_params() const;
  int64_t block_params() const;
  int64_t largest_param() const;  // elements of the largest single parameter
  // Raises hp::Error naming the offending field.
  void validate() const;

  static LlamaConfig tiny();
  static LlamaConfig llama3_8b();
};

// Deterministic, layout-independent initialization of every parameter of `m`: each is
// drawn from its own generator seeded by (seed, FNV-1a of its name), N(0, std); norm
// scales ("...norm....weight") are set to 1. Shared by all reference models.
void init_parameters(torch::nn::Module& m, uint64_t seed, double std = 0.02);
// The same values for a model built under hp::memory::DeferredAllocation, one parameter
// at a time: the returned function fills `full` (any floating dtype, the parameter's shape)
// with what init_parameters(m, seed, std) gives `param` (found by identity among m's
// parameters), rounded to full's dtype as a cast of the fp32 value would be. For
// FullyShardOptions::param_init.
std::function<void(const at::Tensor& param, at::Tensor& full)> parameter_initializer(torch::nn::Module& m,
                                                                                     uint64_t seed,
                                                                                     double std = 0.02);

// The dtype of the numerically sensitive steps (norms, softmax, rotary, routing, the
// loss): float32 for float32 and lower precisions; a float64 model stays in float64, so
// that parity tests can train whole models in float64 (no step rounds to float32).
inline at::Tensor upcast(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? x : x.to(at::kFloat); }
// Causal attention over the whole sequence (hp::attn's tiled kernel), written as a step
// RecomputePolicy::kLight keeps (hp::keep_step): its output and log-sum-exps are kept from
// the first forward and the recomputation rebuilds its backward from them.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t tile);

// Mean cross-entropy of logits [..., vocab] against targets [...], in fp32 (float64 for
// float64 logits); with `vocab_parallel`, the logits are this rank's vocabulary piece over
// that group and the loss is reduced without gathering them. Shared by the reference models.
at::Tensor cross_entropy_of_logits(const at::Tensor& logits, const at::Tensor& targets, const CommPtr& vocab_parallel);

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// cos and sin tables [seq, head_dim / 2] for positions 0..seq-1, in float64 (apply_rotary
// rounds them to the dtype it computes in).
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t seq, int64_t head_dim, double theta);
// The same with the frequencies scaled as `rope` says.
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t seq, int64_t head_dim, const RopeOptions& rope);
// Which elements of a head's D dims rotate together by angle i (i < D / 2).
enum class RotaryPairs {
  kInterleaved,  // (x[2i], x[2i+1]): DeepSeek-V3's MLA rotary dims
  kHalves,       // (x[i], x[i + D/2]): Llama, as Hugging Face's checkpoints expect it
};
// Rotates each pair of the last dim of x [B, H, T, D] by the position's angle i: the first
// element of a pair becomes a cos - b sin, the second a sin + b cos.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        RotaryPairs pairs = RotaryPairs::kInterleaved);

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  int64_t heads, kv_heads, head_dim, tile;
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // with LlamaConfig::qk_norm
  // Set by context_parallel(): x holds this rank's tokens of the sequence, and attention
  // runs over the whole sequence through it.
  std::shared_ptr<cp::ContextParallel> context_parallel;
};
TORCH_MODULE(LlamaAttention);

struct SwiGLUImpl : torch::nn::Module {
  SwiGLUImpl(int64_t dim, int64_t hidden, bool bias = false);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(SwiGLU);

struct LlamaBlockImpl : torch::nn::Module {
  explicit LlamaBlockImpl(const LlamaConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  LlamaAttention attn{nullptr};
  SwiGLU mlp{nullptr};
};
TORCH_MODULE(LlamaBlock);

struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const LlamaConfig& c, const PipelineSlice& slice = {});
  // Logits [B, T, vocab] of tokens [B, T] (a pipeline stage: see PipelineSlice).
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross-entropy (computed in fp32). Calls forward directly: under
  // fully_shard, call the root through hp::call and use loss_of_logits.
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);
  // The same loss of logits from forward (vocabulary-split ones with loss parallel).
  at::Tensor loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) const;
  // Deterministic, layout-independent initialization (see the file comment).
  void init_weights(uint64_t seed);

  LlamaConfig config;
  PipelineSlice slice;
  // Set by parallelize_llama with sequence parallelism: a stage's hidden-state input holds
  // T / stream_split of the sequence's T tokens.
  int64_t stream_split = 1;
  // Set: each block is checkpointed with this policy (activations recomputed in backward).
  c10::optional<RecomputePolicy> recompute;
  // Set by context_parallel(): the input holds this CP rank's tokens (cp::shard), the
  // rotary tables are taken at their positions, and attention spans the whole sequence.
  std::shared_ptr<cp::ContextParallel> context_parallel;
  // Set (by parallelize_llama with loss parallel): the output head's logits are split on
  // the vocabulary over this group, and loss() reduces them without gathering.
  CommPtr vocab_parallel_loss;
  // Set (by parallelize_llama with tie_embeddings): the tied head multiplies by this rank's
  // vocabulary rows of the embedding, so its input is gathered over this group (entered,
  // with the gradient all-reduced, without sequence parallelism; reduce-scattered back to
  // sequence pieces with it), and its logits are gathered unless vocab_parallel_loss is set.
  CommPtr tied_head_tp;
  c10::optional<at::ScalarType> tied_head_reduce_dtype;
  // Null on a pipeline stage without the embedding (with tie_embeddings the last stage holds
  // a copy of it for the output head).
  torch::nn::Embedding tok_emb{nullptr};
  std::vector<LlamaBlock> blocks;
  RMSNorm norm{nullptr};              // null on a stage without the head
  torch::nn::Linear output{nullptr};  // null when tied to tok_emb, or without the head
};
TORCH_MODULE(Llama);

// Context parallelism (hp/cp/context_parallel.h): the model takes this CP rank's tokens of
// each sequence (inputs and targets cut by cp::shard with ctx's split) and computes their
// logits; its loss is the mean over those tokens, so the whole sequence's loss is the mean
// over the CP ranks, and the gradients must be averaged over them (fully_shard over a group
// spanning data x context ranks does it). Apply to every rank of ctx's group, before or
// after tensor parallelism (attention then splits the local heads).
void context_parallel(LlamaImpl& model, std::shared_ptr<cp::ContextParallel> ctx);

// The rotary tables (rotary_tables' cos and sin, [seq, half]) at the positions this rank of
// `ctx` holds of a sequence of `seq` tokens; the whole tables without ctx.
std::pair<at::Tensor, at::Tensor> rotary_rows(std::pair<at::Tensor, at::Tensor> tables, const cp::ContextParallel* ctx);

// Hugging Face interchange (transformers' LlamaForCausalLM, hp/ckpt/consolidated.h moves
// the bytes). The model computes what LlamaForCausalLM computes (rotary on halves, RMSNorm
// in fp32, grouped-query heads repeated in order, SwiGLU as down(silu(gate) * up)), so the
// tensors map one to one, unpermuted.
//
// Each parameter's name there, in the order Hugging Face writes them: (ours, theirs).
// With tied embeddings there is no output head (lm_head) to map.
std::vector<std::pair<std::string, std::string>> hf_names(const LlamaConfig& c);
// The config.json of LlamaForCausalLM for `c`, its weights stored as `dtype`.
std::string hf_config(const LlamaConfig& c, at::ScalarType dtype);
// The model a config.json (its text; `path` names it in errors) describes. Raises naming
// the key for a model this one does not compute (an activation other than silu, attention
// or MLP biases, rope scaling, a head_dim other than hidden_size / num_attention_heads) or
// a value that is missing or not a number. max_seq is max_position_embeddings.
LlamaConfig llama_config_from_hf(const std::string& text, const std::string& path);
// Raises naming the key (ours and Hugging Face's) where `c` and the config.json describe
// different models (max_seq aside: it only bounds the sequence length).
void check_hf_config(const LlamaConfig& c, const std::string& text, const std::string& path);

}  // namespace hp::models
