#include "hp/models/llama.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include "hp/ckpt/float8.h"
#include "hp/core/error.h"
#include "hp/models/family.h"
#include "hp/core/hash.h"
#include "hp/core/memory.h"
#include "hp/hooks/call.h"
#include "hp/tp/parallelize.h"
#include "hf_json.h"

namespace hp::models {

int64_t LlamaConfig::hidden_dim() const {
  if (ffn_dim > 0) return ffn_dim;
  int64_t h = (8 * dim) / 3;
  return (h + 31) / 32 * 32;
}

namespace {
// One block's and the whole model's parameter counts in T (double detects overflow).
template <typename T>
T count_block(const LlamaConfig& c) {
  const T dim = c.dim, hd = c.head_dim();
  const T attn = dim * T(c.heads) * hd + T(2) * dim * T(c.kv_heads) * hd + T(c.heads) * hd * dim +
                 (c.attention_bias || c.qkv_bias ? T(c.heads) * hd + T(2) * T(c.kv_heads) * hd : T(0)) +
                 (c.attention_bias ? dim : T(0)) + (c.qk_norm ? T(2) * hd : T(0));
  const T mlp = T(3) * dim * T(c.hidden_dim()) + (c.mlp_bias ? T(2) * T(c.hidden_dim()) + dim : T(0));
  return attn + mlp + T(2) * dim;  // two RMSNorm weights
}
template <typename T>
T count_params(const LlamaConfig& c) {
  return T(c.vocab) * T(c.dim) * T(c.tie_embeddings ? 1 : 2) + T(c.layers) * count_block<T>(c) + T(c.dim);
}
}  // namespace

int64_t LlamaConfig::block_params() const { return count_block<int64_t>(*this); }
int64_t LlamaConfig::largest_param() const {
  return std::max({vocab * dim, dim * hidden_dim(), dim * heads * head_dim(), dim * kv_heads * head_dim()});
}
int64_t LlamaConfig::num_params() const { return count_params<int64_t>(*this); }

void LlamaConfig::validate() const {
  HP_CHECK(vocab > 0 && dim > 0 && layers > 0 && heads > 0 && kv_heads > 0 && max_seq > 0,
           "llama config: vocab, dim, layers, heads, kv_heads and max_seq must be positive (got vocab=", vocab,
           " dim=", dim, " layers=", layers, " heads=", heads, " kv_heads=", kv_heads, " max_seq=", max_seq, ")");
  HP_CHECK(attention_tile >= 1, "llama config: attention_tile=", attention_tile, " must be at least 1");
  HP_CHECK(layers <= kMaxLayers, "llama config: layers=", layers, " is more than the ", kMaxLayers,
           " blocks a model may have (a damaged config?)");
  HP_CHECK(explicit_head_dim >= 0, "llama config: head_dim=", explicit_head_dim, " must be positive (0: dim / heads)");
  HP_CHECK(explicit_head_dim > 0 || dim % heads == 0, "llama config: dim=", dim, " is not divisible by heads=", heads,
           " (or give head_dim)");
  HP_CHECK(head_dim() % 2 == 0, "llama config: head_dim=", head_dim(), " must be even for rotary embeddings");
  HP_CHECK(heads % kv_heads == 0, "llama config: heads=", heads, " is not divisible by kv_heads=", kv_heads);
  HP_CHECK(!(qkv_bias && attention_bias), "llama config: qkv_bias=true with attention_bias=true (which biases the ",
           "query, key and value projections too): give one");
  check_rope(rope(), "llama config");
  HP_CHECK(count_params<double>(*this) < 4e18, "llama config: ", count_params<double>(*this),
           " parameters is too many to count");
}

LlamaConfig LlamaConfig::tiny() { return LlamaConfig{}; }

LlamaConfig LlamaConfig::llama3_8b() {
  LlamaConfig c;
  c.vocab = 128256;
  c.dim = 4096;
  c.layers = 32;
  c.heads = 32;
  c.kv_heads = 8;
  c.ffn_dim = 14336;
  c.max_seq = 8192;
  c.rope_theta = 500000.0;
  return c;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double e) : eps(e) { weight = register_parameter("weight", at::ones({dim})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  at::Tensor xf = upcast(x);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return y.to(x.scalar_type()) * weight;
}

std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t seq, int64_t head_dim, double theta) {
  RopeOptions o;
  o.theta = theta;
  return rotary_tables(seq, head_dim, o);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t seq, int64_t head_dim, const RopeOptions& rope) {
  at::Tensor i = at::arange(0, head_dim / 2, at::kDouble);
  at::Tensor inv_freq = at::pow(rope.theta, -2.0 * i / head_dim);
  if (rope.scaling == RopeScaling::kLinear) {
    inv_freq = inv_freq / rope.factor;
  } else if (rope.scaling == RopeScaling::kLlama3) {
    const double old = static_cast<double>(rope.original_max_seq);
    const double low_wavelen = old / rope.low_freq_factor, high_wavelen = old / rope.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq);
    at::Tensor smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
    at::Tensor blended = (1 - smooth) * scaled / rope.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    inv_freq = at::where(medium, blended, scaled);
  } else if (rope.scaling == RopeScaling::kYarn) {
    // The dim whose frequency turns `turns` times over original_max_seq positions.
    const double dim = static_cast<double>(head_dim), old = static_cast<double>(rope.original_max_seq);
    const auto dim_of = [&](double turns) { return dim * std::log(old / (turns * 2 * M_PI)) / (2 * std::log(rope.theta)); };
    const double low = std::max(std::floor(dim_of(rope.beta_fast)), 0.0);
    double high = std::min(std::ceil(dim_of(rope.beta_slow)), dim - 1);
    if (low == high) high += 0.001;
    const at::Tensor ramp = ((i - low) / (high - low)).clamp(0, 1);  // 0: kept, 1: divided by the factor
    inv_freq = inv_freq / rope.factor * ramp + inv_freq * (1 - ramp);
  }
  at::Tensor angles = at::outer(at::arange(seq, at::kDouble), inv_freq);
  const double a = rope_attention_factor(rope);
  return {angles.cos() * a, angles.sin() * a};  // float64; apply_rotary casts them to its dtype
}

void check_rope(const RopeOptions& r, const char* who) {
  if (r.scaling != RopeScaling::kNone) {
    HP_CHECK(r.factor > 0 && std::isfinite(r.factor), who, ": rope_factor=", r.factor, " must be a finite number > 0");
  }
  if (r.scaling == RopeScaling::kYarn) {
    HP_CHECK(r.original_max_seq > 0 && r.beta_fast > 0 && r.beta_slow > 0 && std::isfinite(r.beta_fast) &&
                 std::isfinite(r.beta_slow) && r.mscale >= 0 && r.mscale_all_dim >= 0 && std::isfinite(r.mscale) &&
                 std::isfinite(r.mscale_all_dim),
             who, ": rope_scaling yarn needs rope_original_max_seq > 0 (", r.original_max_seq,
             "), finite rope_beta_fast > 0 (", r.beta_fast, ") and rope_beta_slow > 0 (", r.beta_slow,
             "), finite rope_mscale >= 0 (", r.mscale, ") and rope_mscale_all_dim >= 0 (", r.mscale_all_dim, ")");
  }
  if (r.scaling == RopeScaling::kLlama3) {
    HP_CHECK(r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor && r.original_max_seq > 0, who,
             ": rope_scaling llama3 needs 0 < rope_low_freq_factor (", r.low_freq_factor, ") < rope_high_freq_factor (",
             r.high_freq_factor, ") and rope_original_max_seq > 0 (", r.original_max_seq, ")");
  }
}

double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

double rope_attention_factor(const RopeOptions& rope) {
  if (rope.scaling != RopeScaling::kYarn) return 1.0;
  if (rope.mscale != 0 && rope.mscale_all_dim != 0) {
    return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim);
  }
  return yarn_mscale(rope.factor, 1.0);
}

RopeOptions LlamaConfig::rope() const { return rope_of(*this); }

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, RotaryPairs layout) {
  const int64_t T = x.size(-2), D = x.size(-1);
  const bool halves = layout == RotaryPairs::kHalves;
  // [B, H, T, D/2, 2] with the pair's elements on the last dim (halves: [B, H, T, 2, D/2]).
  at::Tensor pairs = halves ? upcast(x).reshape({x.size(0), x.size(1), T, 2, D / 2})
                            : upcast(x).reshape({x.size(0), x.size(1), T, D / 2, 2});
  const int64_t pd = halves ? -2 : -1;
  at::Tensor a = pairs.select(pd, 0), b = pairs.select(pd, 1);
  at::Tensor c = cos.narrow(0, 0, T).to(pairs.scalar_type()), s = sin.narrow(0, 0, T).to(pairs.scalar_type());
  at::Tensor out = at::stack({a * c - b * s, a * s + b * c}, pd);
  return out.reshape(x.sizes()).to(x.scalar_type());
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t tile) {
  return hp::keep_step(
      [&] {
        auto [o, lse] = attn::attention_with_lse(q, k, v, attn::Mask::kCausal, scale, tile);
        return std::vector<at::Tensor>{o, lse};
      },
      [&](const std::vector<at::Tensor>& kept) {
        return attn::attention_from_kept(q, k, v, kept.at(0), kept.at(1), attn::Mask::kCausal, scale, tile);
      });
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c)
    : heads(c.heads), kv_heads(c.kv_heads), head_dim(c.head_dim()), tile(c.attention_tile) {
  auto lin = [](int64_t in, int64_t out, bool bias) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  const bool qkv = c.attention_bias || c.qkv_bias;
  wq = register_module("wq", lin(c.dim, heads * head_dim, qkv));
  wk = register_module("wk", lin(c.dim, kv_heads * head_dim, qkv));
  wv = register_module("wv", lin(c.dim, kv_heads * head_dim, qkv));
  wo = register_module("wo", lin(heads * head_dim, c.dim, c.attention_bias));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(head_dim, c.norm_eps));
    k_norm = register_module("k_norm", RMSNorm(head_dim, c.norm_eps));
  }
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1);
  // Head counts come from the projections' outputs: under tensor parallelism each rank
  // holds heads / tp query heads and kv_heads / tp key/value heads.
  // [B, T, heads, head_dim], each head's dims normalized where the model says, then heads first.
  auto split = [&](const at::Tensor& t, RMSNorm& norm) {
    at::Tensor h = t.view({B, T, -1, head_dim});
    return (norm ? hp::call(norm, h) : h).transpose(1, 2);
  };
  RMSNorm none{nullptr};
  at::Tensor q = apply_rotary(split(hp::call(wq, x), q_norm), cos, sin, RotaryPairs::kHalves);
  at::Tensor k = apply_rotary(split(hp::call(wk, x), k_norm), cos, sin, RotaryPairs::kHalves);
  at::Tensor v = split(hp::call(wv, x), none);
  const int64_t local_heads = q.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  // k and v keep their kv_heads: each group of heads / kv_heads query heads shares one.
  const at::Tensor o = context_parallel ? context_parallel->attention(q, k, v, cp::Mask::kCausal, scale, tile)
                                        : causal_attention(q, k, v, scale, tile);
  return hp::call(wo, o.transpose(1, 2).reshape({B, T, local_heads * head_dim}));
}

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden, bool bias) {
  auto lin = [bias](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  w1 = register_module("w1", lin(dim, hidden));
  w2 = register_module("w2", lin(hidden, dim));
  w3 = register_module("w3", lin(dim, hidden));
}

at::Tensor SwiGLUImpl::forward(const at::Tensor& x) {
  return hp::call(w2, torch::nn::functional::silu(hp::call(w1, x)) * hp::call(w3, x));
}

LlamaBlockImpl::LlamaBlockImpl(const LlamaConfig& c) {
  attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps));
  attn = register_module("attn", LlamaAttention(c));
  ffn_norm = register_module("ffn_norm", RMSNorm(c.dim, c.norm_eps));
  mlp = register_module("mlp", SwiGLU(c.dim, c.hidden_dim(), c.mlp_bias));
}

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor h = x + hp::call(attn, hp::call(attn_norm, x), cos, sin);
  return h + hp::call(mlp, hp::call(ffn_norm, h));
}

LlamaImpl::LlamaImpl(const LlamaConfig& c, const PipelineSlice& sl) : config(c), slice(sl) {
  c.validate();
  const int64_t end = check_slice(sl, c.layers);
  // Tied embeddings: the last stage holds its own copy of the embedding (same name, same
  // initial values) for the output head; the trainer sums the two copies' gradients.
  if (sl.embedding || (sl.head && c.tie_embeddings)) {
    tok_emb = register_module("tok_emb", torch::nn::Embedding(c.vocab, c.dim));
  }
  for (int64_t i = sl.first_layer; i < end; ++i) {
    blocks.push_back(register_module("layers_" + std::to_string(i), LlamaBlock(c)));
  }
  if (sl.head) {
    norm = register_module("norm", RMSNorm(c.dim, c.norm_eps));
    if (!c.tie_embeddings) {
      output = register_module("output", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
    }
  }
  if (!hp::memory::deferring()) init_weights(0);  // built without storage: fully_shard initializes
}

at::Tensor LlamaImpl::forward(const at::Tensor& x) {
  const int64_t cp = context_parallel ? context_parallel->size() : 1;
  const int64_t T = (slice.embedding ? x.size(1) : x.size(1) * stream_split) * cp;
  HP_CHECK(T <= config.max_seq, "sequence of ", T, " tokens is longer than max_seq=", config.max_seq);
  auto [cos, sin] = rotary_rows(rotary_tables(T, config.head_dim(), config.rope()), context_parallel.get());
  cos = cos.to(x.device());
  sin = sin.to(x.device());
  at::Tensor h = slice.embedding ? hp::call(tok_emb, x) : x;
  for (auto& b : blocks) h = recompute ? hp::recompute_with(*recompute, b, h, cos, sin) : hp::call(b, h, cos, sin);
  if (!norm) return h;
  h = hp::call(norm, h);
  if (output) return hp::call(output, h);
  if (!tied_head_tp) {
    at::Tensor logits = h.matmul(tok_emb->weight.t());
    hp::mark_weight_output(logits, {tok_emb->weight});  // the embedding's weight used outside its module
    return logits;
  }
  // Tied under tensor parallelism: the head is a column-parallel product with this rank's
  // vocabulary rows, its input the whole residual stream.
  const tp::RedistributeOptions ro{tied_head_reduce_dtype};
  const tp::Placement stream = stream_split > 1 ? tp::Shard(1) : tp::Replicate();
  h = tp::redistribute(h, tied_head_tp, stream, tp::Replicate(), /*grad=*/tp::Partial(), ro);
  at::Tensor logits = h.matmul(tok_emb->weight.t());
  hp::mark_weight_output(logits, {tok_emb->weight});
  if (vocab_parallel_loss) return logits;
  return tp::redistribute(logits, tied_head_tp, tp::Shard(-1), tp::Replicate(), /*grad=*/tp::Replicate(), ro);
}

void context_parallel(LlamaImpl& model, std::shared_ptr<cp::ContextParallel> ctx) {
  HP_CHECK(ctx != nullptr, "context_parallel: the context is null");
  HP_CHECK(!model.context_parallel, "context_parallel: the model is already context-parallel");
  model.context_parallel = ctx;
  for (auto& b : model.blocks) b->attn->context_parallel = ctx;
}

std::pair<at::Tensor, at::Tensor> rotary_rows(std::pair<at::Tensor, at::Tensor> tables, const cp::ContextParallel* ctx) {
  if (!ctx || ctx->size() == 1) return tables;
  const at::Tensor rows = ctx->split_of(tables.first.size(0)).positions(ctx->rank());
  return {tables.first.index_select(0, rows), tables.second.index_select(0, rows)};
}

at::Tensor LlamaImpl::loss(const at::Tensor& tokens, const at::Tensor& targets) {
  return loss_of_logits(forward(tokens), targets);
}

at::Tensor LlamaImpl::loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) const {
  return cross_entropy_of_logits(logits, targets, vocab_parallel_loss);
}

at::Tensor cross_entropy_of_logits(const at::Tensor& logits, const at::Tensor& targets, const CommPtr& vocab_parallel) {
  if (vocab_parallel) return tp::vocab_parallel_cross_entropy(logits, targets, vocab_parallel);
  return torch::nn::functional::cross_entropy(upcast(logits.reshape({-1, logits.size(-1)})),
                                              targets.reshape({-1}));
}

namespace {

// The initial value of the parameter named `name`, written into `out` (its shape): N(0,
// std) drawn in fp32 from a generator seeded by (seed, the name), then rounded to out's
// dtype; norm scales are 1.
void init_parameter(const std::string& name, at::Tensor& out, uint64_t seed, double std) {
  at::NoGradGuard no_grad;
  if (name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 && name.find("norm") != std::string::npos) {
    out.fill_(1.0);  // RMSNorm scales
    return;
  }
  uint64_t h = fnv1a(name);  // the same on every machine
  h ^= seed * 0x9E3779B97F4A7C15ULL;
  at::Generator gen = at::detail::createCPUGenerator(h);
  if (out.scalar_type() == at::kFloat && out.is_contiguous()) {
    out.normal_(0.0, std, gen);  // the same draws as into a new fp32 tensor, without one
  } else {
    out.copy_(at::empty(out.sizes(), at::kFloat).normal_(0.0, std, gen));
  }
}

// init_parameter for `param`, written into `out` (param itself, or a tensor of its shape):
// a tensor-parallel piece gets the global tensor's values in its box.
void init_piece(const std::string& name, const at::Tensor& param, at::Tensor& out, uint64_t seed, double std) {
  auto spec = tp::parameter_spec(param);
  if (!spec) {
    init_parameter(name, out, seed, std);
    return;
  }
  at::Tensor global = at::empty(spec->global_shape, out.options());
  init_parameter(name, global, seed, std);
  at::Tensor box = global;
  for (size_t d = 0; d < spec->offsets.size(); ++d) box = box.narrow(d, spec->offsets[d], spec->lengths[d]);
  at::NoGradGuard no_grad;
  out.copy_(box);
}

}  // namespace

void init_parameters(torch::nn::Module& m, uint64_t seed, double std) {
  for (const auto& item : m.named_parameters()) {
    at::Tensor p = item.value();
    init_piece(item.key(), p, p, seed, std);
  }
}

std::function<void(const at::Tensor&, at::Tensor&)> parameter_initializer(torch::nn::Module& m, uint64_t seed,
                                                                          double std) {
  auto names = std::make_shared<std::map<const c10::TensorImpl*, std::string>>();
  for (const auto& item : m.named_parameters()) names->emplace(item.value().unsafeGetTensorImpl(), item.key());
  return [names, seed, std](const at::Tensor& param, at::Tensor& full) {
    auto it = names->find(param.unsafeGetTensorImpl());
    HP_CHECK(it != names->end(), "parameter_initializer: a parameter ", param.sizes(),
             " that is not one of the model's");
    init_piece(it->second, param, full, seed, std);
  };
}

void LlamaImpl::init_weights(uint64_t seed) { init_parameters(*this, seed); }

std::vector<std::pair<std::string, std::string>> hf_names(const LlamaConfig& c) {
  std::vector<std::pair<std::string, std::string>> out = {{"tok_emb.weight", "model.embed_tokens.weight"}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string ours = "layers_" + std::to_string(i) + ".", theirs = "model.layers." + std::to_string(i) + ".";
    for (const auto& [a, b] : std::vector<std::pair<const char*, const char*>>{
             {"attn.wq.weight", "self_attn.q_proj.weight"},
             {"attn.wk.weight", "self_attn.k_proj.weight"},
             {"attn.wv.weight", "self_attn.v_proj.weight"},
             {"attn.wo.weight", "self_attn.o_proj.weight"},
             {"mlp.w1.weight", "mlp.gate_proj.weight"},
             {"mlp.w3.weight", "mlp.up_proj.weight"},
             {"mlp.w2.weight", "mlp.down_proj.weight"},
             {"attn_norm.weight", "input_layernorm.weight"},
             {"ffn_norm.weight", "post_attention_layernorm.weight"}}) {
      out.emplace_back(ours + a, theirs + b);
    }
    if (c.attention_bias || c.qkv_bias) {
      for (const char* p : {"q", "k", "v", "o"}) {
        if (*p == 'o' && !c.attention_bias) continue;
        out.emplace_back(ours + "attn.w" + p + ".bias", theirs + "self_attn." + p + "_proj.bias");
      }
    }
    if (c.mlp_bias) {
      for (const auto& [a, b] : std::vector<std::pair<const char*, const char*>>{
               {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}}) {
        out.emplace_back(ours + "mlp." + a + ".bias", theirs + "mlp." + b + ".bias");
      }
    }
  }
  out.emplace_back("norm.weight", "model.norm.weight");
  if (!c.tie_embeddings) out.emplace_back("output.weight", "lm_head.weight");
  return out;
}

std::string hf_config(const LlamaConfig& c, at::ScalarType dtype) {
  HP_CHECK(!c.qk_norm, "Hugging Face export of a llama with qk_norm is not supported yet (use the qwen3_moe family)");
  // With q/k/v-only biases, the Qwen2 family's layout, which has no other bias nor another
  // head size.
  if (c.qkv_bias) {
    HP_CHECK(!c.mlp_bias && c.explicit_head_dim == 0, "Hugging Face export of a llama with qkv_bias (as Qwen2) with ",
             c.mlp_bias ? "mlp_bias" : "an explicit head_dim", " is not supported yet (Qwen2 has neither)");
  }
  nlohmann::json j = {{"architectures", {c.qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                      {"model_type", c.qkv_bias ? "qwen2" : "llama"},
                      {"vocab_size", c.vocab},
                      {"hidden_size", c.dim},
                      {"intermediate_size", c.hidden_dim()},
                      {"num_hidden_layers", c.layers},
                      {"num_attention_heads", c.heads},
                      {"num_key_value_heads", c.kv_heads},
                      {"head_dim", c.head_dim()},
                      {"max_position_embeddings", c.max_seq},
                      {"rope_theta", c.rope_theta},
                      {"rope_scaling", nullptr},
                      {"rms_norm_eps", c.norm_eps},
                      {"hidden_act", "silu"},
                      {"attention_bias", c.attention_bias},
                      {"mlp_bias", c.mlp_bias},
                      {"tie_word_embeddings", c.tie_embeddings},
                      {"torch_dtype", detail::hf_dtype_name(dtype)}};
  if (c.qkv_bias) {
    for (const char* key : {"attention_bias", "mlp_bias", "head_dim"}) j.erase(key);
    j["use_sliding_window"] = false;
  }
  j["rope_scaling"] = detail::rope_hf_json(c.rope());
  return j.dump(2) + "\n";
}



LlamaConfig llama_config_from_hf(const std::string& text, const std::string& path) {
  const detail::HfJson j(text, path);
  const bool qwen2 = j.has("model_type") && j.json()["model_type"] == "qwen2";
  if (!qwen2) j.require("model_type", "llama", "llama or qwen2");
  ckpt::hf_float8_blocks(text, path);  // none, or FP8 with block scales (read by the import); others refused
  j.require("hidden_act", "silu", "the model uses silu");
  LlamaConfig c;
  if (qwen2) {  // biases on q, k and v, always; no sliding-window attention
    j.require("use_sliding_window", false, "attention over the whole sequence");
    c.qkv_bias = true;
  }
  c.vocab = j.integer("vocab_size");
  c.dim = j.integer("hidden_size");
  c.ffn_dim = j.integer("intermediate_size");
  c.layers = j.integer("num_hidden_layers");
  c.heads = j.integer("num_attention_heads");
  c.kv_heads = j.integer("num_key_value_heads", c.heads);
  c.max_seq = j.integer("max_position_embeddings", c.max_seq);
  c.rope_theta = j.real("rope_theta", 10000.0);
  RopeOptions rope = c.rope();
  detail::read_rope(j, rope, c.max_seq);
  set_rope(c, rope);
  c.norm_eps = j.real("rms_norm_eps", 1e-6);  // Hugging Face's default
  c.tie_embeddings = j.boolean("tie_word_embeddings", false);
  if (!qwen2) {
    c.attention_bias = j.boolean("attention_bias", false);
    c.mlp_bias = j.boolean("mlp_bias", false);
  }
  // An explicit head_dim (null or absent: hidden_size / num_attention_heads) kept only where
  // it differs, so a config that states the usual one reads as one that does not.
  if (j.has("head_dim") && !j.json()["head_dim"].is_null()) {
    const int64_t hd = j.integer("head_dim");
    if (c.heads <= 0 || c.dim % c.heads != 0 || hd != c.dim / c.heads) c.explicit_head_dim = hd;
  }
  c.validate();
  return c;
}

void check_hf_config(const LlamaConfig& c, const std::string& text, const std::string& path) {
  const LlamaConfig h = llama_config_from_hf(text, path);
  using detail::same_as_hf;
  same_as_hf("vocab", "vocab_size", c.vocab, h.vocab, path);
  same_as_hf("dim", "hidden_size", c.dim, h.dim, path);
  same_as_hf("ffn_dim", "intermediate_size", c.hidden_dim(), h.hidden_dim(), path);
  same_as_hf("layers", "num_hidden_layers", c.layers, h.layers, path);
  same_as_hf("heads", "num_attention_heads", c.heads, h.heads, path);
  same_as_hf("kv_heads", "num_key_value_heads", c.kv_heads, h.kv_heads, path);
  same_as_hf("head_dim", "head_dim", c.head_dim(), h.head_dim(), path);
  same_as_hf("attention_bias", "attention_bias", c.attention_bias, h.attention_bias, path);
  same_as_hf("mlp_bias", "mlp_bias", c.mlp_bias, h.mlp_bias, path);
  same_as_hf("qkv_bias", "model_type qwen2", c.qkv_bias, h.qkv_bias, path);
  same_as_hf("rope_theta", "rope_theta", c.rope_theta, h.rope_theta, path);
  detail::same_rope(c.rope(), h.rope(), path);
  same_as_hf("norm_eps", "rms_norm_eps", c.norm_eps, h.norm_eps, path);
  same_as_hf("tie_embeddings", "tie_word_embeddings", c.tie_embeddings, h.tie_embeddings, path);
}

}  // namespace hp::models
