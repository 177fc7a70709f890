// A Llama-style decoder whose feed-forward is a mixture of experts, as Qwen3-MoE and Mixtral
// publish it: Llama's grouped-query rotary attention (with Qwen3's RMSNorm over each head's
// queries and keys), and in the MoE blocks a softmax router over all experts, each token's
// top-k experts weighted by their scores (normalized to sum 1 unless Qwen3's norm_topk_prob
// says not), no shared expert. The MoE is DeepSeek's layer (deepseek.h: the same token
// dispatchers, expert parallelism, capacity limit and tensor-parallel plan), configured
// with softmax scores and no balancing bias; a block that is not sparse (Qwen3's
// decoder_sparse_step) has a dense SwiGLU of dense_hidden.
//
// The hp-train families qwen3_moe and mixtral (src/models/qwen3_moe_family.cpp,
// mixtral_family.cpp) are this model in the two flavors; the flavor decides the Hugging
// Face names and config.json (Qwen3MoeForCausalLM, MixtralForCausalLM).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/ep/dispatch.h"
#include "hp/models/deepseek.h"
#include "hp/models/llama.h"

namespace hp::models {

// Which published architecture a MoELlamaConfig is.
enum class MoEFlavor { kQwen3Moe, kMixtral };

struct MoELlamaConfig {
  MoEFlavor flavor = MoEFlavor::kQwen3Moe;
  int64_t vocab = 256;
  int64_t dim = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;           // grouped-query attention: heads % kv_heads == 0
  int64_t explicit_head_dim = 0;  // 0: dim / heads
  // RMSNorm over each head's query and key dims before the rotary (Qwen3: always;
  // Mixtral: never).
  bool qk_norm = true;
  bool attention_bias = false;  // on q, k, v and o (Qwen3's attention_bias)
  int64_t experts = 8;
  int64_t experts_per_token = 2;
  int64_t expert_hidden = 32;
  // The routing weights of a token's chosen experts normalized to sum 1 (Qwen3's
  // norm_topk_prob; Mixtral: always).
  bool norm_topk = true;
  // Block i (from 0) is a MoE block when (i + 1) % sparse_step == 0, else a dense SwiGLU of
  // dense_hidden (Qwen3's decoder_sparse_step and intermediate_size; Mixtral: 1).
  int64_t sparse_step = 1;
  int64_t dense_hidden = 128;
  // As DeepSeekConfig's (0: no limit, as both train).
  double capacity_factor = 0;
  DropPolicy drop_policy = DropPolicy::kProbs;
  int64_t max_seq = 256;
  int64_t attention_tile = attn::kDefaultTile;
  double rope_theta = 1000000.0;
  double norm_eps = 1e-6;
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_seq = 8192;
  double rope_beta_fast = 32, rope_beta_slow = 1, rope_mscale = 0, rope_mscale_all_dim = 0;

  RopeOptions rope() const { return rope_of(*this); }
  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : dim / heads; }
  bool is_moe(int64_t layer) const { return (layer + 1) % sparse_step == 0; }
  int64_t moe_layers() const { return layers / sparse_step; }
  // The attention's config (LlamaAttention's), and the MoE's (MoE's: softmax scores, no
  // shared expert, no balancing bias or loss).
  LlamaConfig attention_config() const;
  DeepSeekConfig moe_config() const;
  // Parameters of one block's attention with its two norms, of a dense block's SwiGLU, of a
  // MoE block's router and experts.
  int64_t attention_params() const;
  int64_t dense_params() const { return 3 * dim * dense_hidden; }
  int64_t moe_params() const { return dim * experts + experts * 3 * dim * expert_hidden; }
  int64_t num_params() const;
  int64_t largest_block_params() const;
  int64_t largest_param() const;
  // Raises hp::Error naming the offending field (model.<key>).
  void validate() const;

  static MoELlamaConfig qwen3_moe_tiny();
  static MoELlamaConfig qwen3_30b_a3b();
  static MoELlamaConfig qwen3_235b_a22b();
  static MoELlamaConfig mixtral_tiny();
  static MoELlamaConfig mixtral_8x7b();
};

struct MoELlamaBlockImpl : torch::nn::Module {
  MoELlamaBlockImpl(const MoELlamaConfig& c, bool moe);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  LlamaAttention attn{nullptr};
  SwiGLU dense{nullptr};  // a block that is not sparse (registered as "mlp")
  MoE moe{nullptr};
};
TORCH_MODULE(MoELlamaBlock);

struct MoELlamaImpl : torch::nn::Module {
  explicit MoELlamaImpl(const MoELlamaConfig& c, const PipelineSlice& slice = {});
  // Logits of tokens (a pipeline stage: see PipelineSlice).
  at::Tensor forward(const at::Tensor& tokens);
  at::Tensor loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) const;
  void init_weights(uint64_t seed) { init_parameters(*this, seed); }
  // The MoEs' loads summed over `dp` for metrics (no bias moves: the rate is 0).
  void update_balancing_bias(const CommPtr& dp = nullptr);
  MoELlamaConfig config;
  PipelineSlice slice;
  int64_t stream_split = 1;  // as LlamaImpl's
  CommPtr vocab_parallel_loss;
  c10::optional<RecomputePolicy> recompute;
  std::shared_ptr<cp::ContextParallel> context_parallel;
  torch::nn::Embedding tok_emb{nullptr};  // null on a pipeline stage without the embedding
  std::vector<MoELlamaBlock> blocks;
  RMSNorm norm{nullptr};              // null on a stage without the head
  torch::nn::Linear output{nullptr};  // null on a stage without the head
  // Each MoE of this stage with its layer in the whole model (as DeepSeekImpl::moes).
  std::vector<std::pair<int64_t, MoE>> moes() const;
};
TORCH_MODULE(MoELlama);

// Expert and context parallelism, as DeepSeek's (deepseek.h).
void expert_parallel(MoELlamaImpl& model, const CommPtr& ep, const ep::DispatchOptions& o = {});
void context_parallel(MoELlamaImpl& model, std::shared_ptr<cp::ContextParallel> ctx);

// Hugging Face interchange with transformers' Qwen3MoeForCausalLM or MixtralForCausalLM
// (c.flavor), in the published checkpoints' layout (one tensor per expert and projection:
// Qwen3's mlp.experts.<e>.{gate,up,down}_proj, Mixtral's block_sparse_moe.experts.<e>.w1/w2/w3).
std::vector<std::pair<std::string, std::string>> hf_names(const MoELlamaConfig& c);
std::string hf_config(const MoELlamaConfig& c, at::ScalarType dtype);
// The model a config.json describes (`flavor` says which model_type it must be). Raises
// naming the key for what the model cannot be: sliding-window attention, router jitter,
// the router's auxiliary loss in training, mlp_only_layers, tied embeddings, ...
MoELlamaConfig moe_llama_config_from_hf(MoEFlavor flavor, const std::string& text, const std::string& path);
void check_hf_config(const MoELlamaConfig& c, const std::string& text, const std::string& path);

}  // namespace hp::models
