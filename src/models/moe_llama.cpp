#include "hp/models/moe_llama.h"

#include <algorithm>
#include <cmath>

#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/hooks/call.h"
#include "hp/hooks/recompute.h"
#include "hp/models/family.h"

namespace hp::models {

LlamaConfig MoELlamaConfig::attention_config() const {
  LlamaConfig a;
  a.vocab = vocab;
  a.dim = dim;
  a.layers = layers;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.explicit_head_dim = explicit_head_dim;
  a.max_seq = max_seq;
  a.attention_tile = attention_tile;
  a.norm_eps = norm_eps;
  a.attention_bias = attention_bias;
  a.qk_norm = qk_norm;
  set_rope(a, rope());
  return a;
}

DeepSeekConfig MoELlamaConfig::moe_config() const {
  DeepSeekConfig m;
  m.vocab = vocab;
  m.dim = dim;
  m.layers = layers;
  m.dense_layers = 0;
  m.experts = experts;
  m.experts_per_token = experts_per_token;
  m.shared_experts = 0;
  m.expert_hidden = expert_hidden;
  m.router_score = RouterScore::kSoftmax;
  m.norm_topk = norm_topk;
  m.bias_update_rate = 0;
  m.aux_loss_coeff = 0;
  m.capacity_factor = capacity_factor;
  m.drop_policy = drop_policy;
  return m;
}

namespace {
template <typename T>
T count_attention(const MoELlamaConfig& c) {
  const T dim = c.dim, hd = c.head_dim(), h = c.heads, kv = c.kv_heads;
  return dim * h * hd + T(2) * dim * kv * hd + h * hd * dim + (c.attention_bias ? h * hd + T(2) * kv * hd + dim : T(0)) +
         (c.qk_norm ? T(2) * hd : T(0)) + T(2) * dim;
}
template <typename T>
T count_params(const MoELlamaConfig& c) {
  const T moe = T(c.dim) * T(c.experts) + T(c.experts) * T(3) * T(c.dim) * T(c.expert_hidden);
  const T dense = T(3) * T(c.dim) * T(c.dense_hidden);
  const T sparse = T(c.moe_layers());
  return T(2) * T(c.vocab) * T(c.dim) + T(c.dim) + T(c.layers) * count_attention<T>(c) + sparse * moe +
         (T(c.layers) - sparse) * dense;
}
const char* who(const MoELlamaConfig& c) { return c.flavor == MoEFlavor::kMixtral ? "mixtral" : "qwen3_moe"; }
}  // namespace

int64_t MoELlamaConfig::attention_params() const { return count_attention<int64_t>(*this); }
int64_t MoELlamaConfig::num_params() const { return count_params<int64_t>(*this); }
int64_t MoELlamaConfig::largest_block_params() const {
  // The larger of the kinds of block the model has.
  return attention_params() +
         std::max(moe_layers() > 0 ? moe_params() : 0, moe_layers() < layers ? dense_params() : 0);
}
int64_t MoELlamaConfig::largest_param() const {
  return std::max({vocab * dim, dim * heads * head_dim(), dim * kv_heads * head_dim(), dim * experts,
                   dim * expert_hidden, moe_layers() < layers ? dim * dense_hidden : 0});
}

void MoELlamaConfig::validate() const {
  const char* w = who(*this);
  HP_CHECK(vocab > 0 && dim > 0 && layers > 0 && heads > 0 && kv_heads > 0 && max_seq > 0, w,
           " config: vocab, dim, layers, heads, kv_heads and max_seq must be positive (got vocab=", vocab, " dim=", dim,
           " layers=", layers, " heads=", heads, " kv_heads=", kv_heads, " max_seq=", max_seq, ")");
  HP_CHECK(layers <= kMaxLayers, w, " config: layers=", layers, " is more than the ", kMaxLayers,
           " blocks a model may have (a damaged config?)");
  HP_CHECK(attention_tile >= 1, w, " config: attention_tile=", attention_tile, " must be at least 1");
  HP_CHECK(explicit_head_dim >= 0, w, " config: head_dim=", explicit_head_dim, " must be positive (0: dim / heads)");
  HP_CHECK(explicit_head_dim > 0 || dim % heads == 0, w, " config: dim=", dim, " is not divisible by heads=", heads,
           " (or give head_dim)");
  HP_CHECK(head_dim() % 2 == 0, w, " config: head_dim=", head_dim(), " must be even for rotary embeddings");
  HP_CHECK(heads % kv_heads == 0, w, " config: heads=", heads, " is not divisible by kv_heads=", kv_heads);
  HP_CHECK(experts >= 1 && expert_hidden >= 1, w, " config: experts=", experts, " and expert_hidden=", expert_hidden,
           " must be positive");
  HP_CHECK(experts_per_token >= 1 && experts_per_token <= experts, w, " config: experts_per_token=", experts_per_token,
           " must be in [1, experts=", experts, "]");
  HP_CHECK(sparse_step >= 1, w, " config: sparse_step=", sparse_step, " must be at least 1");
  HP_CHECK(moe_layers() == layers || dense_hidden >= 1, w, " config: dense_hidden=", dense_hidden,
           " must be positive (blocks that are not sparse use it)");
  HP_CHECK(capacity_factor >= 0 && std::isfinite(capacity_factor) && capacity_factor <= static_cast<double>(experts), w,
           " config: capacity_factor=", capacity_factor, " must be in [0, experts=", experts, "] (0: no limit)");
  // The flavor's fixed choices: Mixtral has no per-head norms, always normalizes its two
  // weights and has a MoE in every block.
  if (flavor == MoEFlavor::kMixtral) {
    HP_CHECK(!qk_norm && norm_topk && sparse_step == 1 && !attention_bias, w,
             " config: Mixtral has no query/key norms or attention biases, normalizes the chosen experts' weights and "
             "has a MoE in every block (qk_norm=", qk_norm, " norm_topk=", norm_topk, " sparse_step=", sparse_step,
             " attention_bias=", attention_bias, ")");
  }
  HP_CHECK(norm_eps > 0 && std::isfinite(norm_eps), w, " config: norm_eps=", norm_eps, " must be a finite number > 0");
  HP_CHECK(rope_theta > 0 && std::isfinite(rope_theta), w, " config: rope_theta=", rope_theta,
           " must be a finite number > 0");
  check_rope(rope(), w);
  HP_CHECK(count_params<double>(*this) < 4e18, w, " config: ", count_params<double>(*this),
           " parameters is too many to count");
}

MoELlamaConfig MoELlamaConfig::qwen3_moe_tiny() { return MoELlamaConfig{}; }

MoELlamaConfig MoELlamaConfig::mixtral_tiny() {
  MoELlamaConfig c;
  c.flavor = MoEFlavor::kMixtral;
  c.qk_norm = false;
  c.norm_eps = 1e-5;
  return c;
}

// The published config.json's values (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B,
// mistralai/Mixtral-8x7B-v0.1).
MoELlamaConfig MoELlamaConfig::qwen3_30b_a3b() {
  MoELlamaConfig c;
  c.vocab = 151936;
  c.dim = 2048;
  c.layers = 48;
  c.heads = 32;
  c.kv_heads = 4;
  c.explicit_head_dim = 128;
  c.experts = 128;
  c.experts_per_token = 8;
  c.expert_hidden = 768;
  c.dense_hidden = 6144;
  c.max_seq = 40960;
  c.rope_theta = 1000000.0;
  c.norm_eps = 1e-6;
  return c;
}

MoELlamaConfig MoELlamaConfig::qwen3_235b_a22b() {
  MoELlamaConfig c = qwen3_30b_a3b();
  c.dim = 4096;
  c.layers = 94;
  c.heads = 64;
  c.expert_hidden = 1536;
  c.dense_hidden = 12288;
  return c;
}

MoELlamaConfig MoELlamaConfig::mixtral_8x7b() {
  MoELlamaConfig c = mixtral_tiny();
  c.vocab = 32000;
  c.dim = 4096;
  c.layers = 32;
  c.heads = 32;
  c.kv_heads = 8;
  c.experts = 8;
  c.experts_per_token = 2;
  c.expert_hidden = 14336;
  c.max_seq = 32768;
  c.rope_theta = 1000000.0;
  c.norm_eps = 1e-5;
  return c;
}

MoELlamaBlockImpl::MoELlamaBlockImpl(const MoELlamaConfig& c, bool is_moe) {
  attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps));
  attn = register_module("attn", LlamaAttention(c.attention_config()));
  ffn_norm = register_module("ffn_norm", RMSNorm(c.dim, c.norm_eps));
  if (is_moe) {
    moe = register_module("moe", MoE(c.moe_config()));
  } else {
    dense = register_module("mlp", SwiGLU(c.dim, c.dense_hidden));
  }
}

at::Tensor MoELlamaBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor h = x + hp::call(attn, hp::call(attn_norm, x), cos, sin);
  at::Tensor n = hp::call(ffn_norm, h);
  return h + (moe ? hp::call(moe, n) : hp::call(dense, n));
}

MoELlamaImpl::MoELlamaImpl(const MoELlamaConfig& c, const PipelineSlice& sl) : config(c), slice(sl) {
  c.validate();
  const int64_t end = check_slice(sl, c.layers);
  if (sl.embedding) tok_emb = register_module("tok_emb", torch::nn::Embedding(c.vocab, c.dim));
  for (int64_t i = sl.first_layer; i < end; ++i) {
    blocks.push_back(register_module("layers_" + std::to_string(i), MoELlamaBlock(c, c.is_moe(i))));
  }
  if (sl.head) {
    norm = register_module("norm", RMSNorm(c.dim, c.norm_eps));
    output = register_module("output", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
  }
  if (!hp::memory::deferring()) init_weights(0);  // built without storage: fully_shard initializes
}

at::Tensor MoELlamaImpl::forward(const at::Tensor& x) {
  const int64_t cp = context_parallel ? context_parallel->size() : 1;
  const int64_t T = (tok_emb ? x.size(1) : x.size(1) * stream_split) * cp;
  HP_CHECK(T <= config.max_seq, "sequence of ", T, " tokens is longer than max_seq=", config.max_seq);
  auto [cos, sin] = rotary_rows(rotary_tables(T, config.head_dim(), config.rope()), context_parallel.get());
  cos = cos.to(x.device());
  sin = sin.to(x.device());
  at::Tensor h = tok_emb ? hp::call(tok_emb, x) : x;
  for (auto& b : blocks) h = recompute ? hp::recompute_with(*recompute, b, h, cos, sin) : hp::call(b, h, cos, sin);
  if (!output) return h;
  return hp::call(output, hp::call(norm, h));
}

at::Tensor MoELlamaImpl::loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) const {
  return cross_entropy_of_logits(logits, targets, vocab_parallel_loss);
}

std::vector<std::pair<int64_t, MoE>> MoELlamaImpl::moes() const {
  std::vector<std::pair<int64_t, MoE>> out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i]->moe) out.emplace_back(slice.first_layer + static_cast<int64_t>(i), blocks[i]->moe);
  }
  return out;
}

void MoELlamaImpl::update_balancing_bias(const CommPtr& dp) {
  for (auto& [layer, moe] : moes()) moe->update_balancing_bias(0.0, dp);
}

void expert_parallel(MoELlamaImpl& model, const CommPtr& ep, const ep::DispatchOptions& o) {
  for (auto& [layer, moe] : model.moes()) expert_parallel(*moe, ep, o);
}

void context_parallel(MoELlamaImpl& model, std::shared_ptr<cp::ContextParallel> ctx) {
  HP_CHECK(ctx != nullptr, "context_parallel: the context is null");
  HP_CHECK(!model.context_parallel, "context_parallel: the model is already context-parallel");
  model.context_parallel = ctx;
  for (auto& b : model.blocks) b->attn->context_parallel = ctx;
}

}  // namespace hp::models
