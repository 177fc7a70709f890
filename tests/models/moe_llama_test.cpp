// MoELlama (the qwen3_moe and mixtral families) against computations written here.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>

#include "hp/core/memory.h"
#include "hp/models/family.h"
#include "hp/models/moe_llama.h"
#include "light_recompute_util.h"
#include "test_util.h"

using hp::models::MoELlamaConfig;

namespace {

// Qwen3-MoE with everything it may have: a dense block between MoE ones, an explicit head
// size, attention biases, weights not normalized.
MoELlamaConfig qwen3_full() {
  MoELlamaConfig c = MoELlamaConfig::qwen3_moe_tiny();
  c.layers = 3;
  c.sparse_step = 2;
  c.explicit_head_dim = 24;
  c.attention_bias = true;
  c.norm_topk = false;
  return c;
}

int64_t built_params(const MoELlamaConfig& c) {
  hp::models::MoELlama m(c);
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}

// Parameters a token runs through: all but the experts it does not use.
double active_params(const MoELlamaConfig& c) {
  return static_cast<double>(c.num_params()) - static_cast<double>(c.moe_layers()) *
                                                   static_cast<double>(c.experts - c.experts_per_token) * 3.0 *
                                                   static_cast<double>(c.dim * c.expert_hidden);
}

// RMSNorm over the last dim with scale w, by hand.
at::Tensor rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x / (x.pow(2).mean(-1, /*keepdim=*/true) + eps).sqrt() * w;
}

// Rotary over halves of the last dim of x [B, H, T, D] at positions 0..T-1, by hand.
at::Tensor rotate(const at::Tensor& x, double theta) {
  const int64_t T = x.size(2), D = x.size(3);
  at::Tensor out = x.clone();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double angle = static_cast<double>(t) / std::pow(theta, 2.0 * static_cast<double>(i) / static_cast<double>(D));
      at::Tensor a = x.select(2, t).select(-1, i), b = x.select(2, t).select(-1, i + D / 2);
      out.select(2, t).select(-1, i).copy_(a * std::cos(angle) - b * std::sin(angle));
      out.select(2, t).select(-1, i + D / 2).copy_(a * std::sin(angle) + b * std::cos(angle));
    }
  }
  return out;
}

at::Tensor linear(const at::Tensor& x, const torch::nn::Linear& l) {
  at::Tensor y = x.matmul(l->weight.t());
  return l->bias.defined() ? y + l->bias : y;
}

at::Tensor swiglu(const at::Tensor& x, const hp::models::SwiGLU& s) {
  at::Tensor a = linear(x, s->w1);
  return linear(a / (1 + (-a).exp()) * linear(x, s->w3), s->w2);
}

// One block of `c` on x [B, T, dim], written out: norms, grouped-query causal softmax
// attention (the per-head norms before the rotary), and the feed-forward: a dense SwiGLU,
// or each token's experts by a loop (softmax over all experts, the top k, their weights
// normalized where the config says).
at::Tensor naive_block(const MoELlamaConfig& c, hp::models::MoELlamaBlockImpl& b, const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), hd = c.head_dim();
  at::Tensor n = rms(x, b.attn_norm->weight, c.norm_eps);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, -1, hd}); };
  at::Tensor q = heads(linear(n, b.attn->wq)), k = heads(linear(n, b.attn->wk)), v = heads(linear(n, b.attn->wv));
  if (c.qk_norm) {
    q = rms(q, b.attn->q_norm->weight, c.norm_eps);
    k = rms(k, b.attn->k_norm->weight, c.norm_eps);
  }
  q = rotate(q.transpose(1, 2), c.rope_theta);
  k = rotate(k.transpose(1, 2), c.rope_theta).repeat_interleave(c.heads / c.kv_heads, 1);
  v = v.transpose(1, 2).repeat_interleave(c.heads / c.kv_heads, 1);
  at::Tensor s = q.matmul(k.transpose(-1, -2)) / std::sqrt(static_cast<double>(hd));
  s = s.masked_fill(at::ones({T, T}, at::kBool).triu(1), -INFINITY);
  at::Tensor o = s.softmax(-1).matmul(v).transpose(1, 2).reshape({B, T, -1});
  at::Tensor h = x + linear(o, b.attn->wo);
  at::Tensor f = rms(h, b.ffn_norm->weight, c.norm_eps).reshape({B * T, c.dim});
  at::Tensor y = at::zeros_like(f);
  if (!b.moe) {
    y = swiglu(f, b.dense);
  } else {
    for (int64_t t = 0; t < B * T; ++t) {
      at::Tensor p = linear(f[t], b.moe->gate).softmax(-1);
      auto [top, idx] = p.topk(c.experts_per_token);
      if (c.norm_topk) top = top / top.sum();
      for (int64_t j = 0; j < c.experts_per_token; ++j) {
        y[t] += top[j] * swiglu(f[t], b.moe->experts->list[idx[j].item<int64_t>()]);
      }
    }
  }
  return h + y.view({B, T, c.dim});
}

}  // namespace

TEST(MoELlama, ParameterCountsFromTheConfig) {
  for (const MoELlamaConfig& c : {qwen3_full(), MoELlamaConfig::mixtral_tiny()}) {
    EXPECT_EQ(built_params(c), c.num_params());
  }
  // Published: Qwen3-30B-A3B 30.5 B (3.3 B active), Qwen3-235B-A22B 235 B (22 B active),
  // Mixtral-8x7B 46.7 B (12.9 B active).
  EXPECT_NEAR(MoELlamaConfig::qwen3_30b_a3b().num_params() / 1e9, 30.5, 0.1);
  EXPECT_NEAR(active_params(MoELlamaConfig::qwen3_30b_a3b()) / 1e9, 3.3, 0.1);
  EXPECT_NEAR(MoELlamaConfig::qwen3_235b_a22b().num_params() / 1e9, 235, 1);
  EXPECT_NEAR(active_params(MoELlamaConfig::qwen3_235b_a22b()) / 1e9, 22, 0.5);
  EXPECT_NEAR(MoELlamaConfig::mixtral_8x7b().num_params() / 1e9, 46.7, 0.1);
  EXPECT_NEAR(active_params(MoELlamaConfig::mixtral_8x7b()) / 1e9, 12.9, 0.1);
}

// Every block kind of both flavors against the block written out above, in float64.
TEST(MoELlama, BlocksMatchANaiveComputation) {
  MoELlamaConfig mixtral = MoELlamaConfig::mixtral_tiny();
  mixtral.experts_per_token = 3;
  for (const MoELlamaConfig& c : {qwen3_full(), mixtral}) {
    hp::models::MoELlama m(c);
    m->init_weights(5);
    m->to(at::kDouble);
    {
      // Norm scales away from 1, so that a norm left out or swapped shows.
      at::NoGradGuard g;
      for (auto& p : m->named_parameters()) {
        if (p.key().find("norm") != std::string::npos) p.value().add_(0.3 * at::randn_like(p.value()));
      }
    }
    torch::manual_seed(2);
    const at::Tensor x = at::randn({2, 7, c.dim}, at::kDouble);
    auto [cos, sin] = hp::models::rotary_tables(7, c.head_dim(), c.rope());
    for (size_t i = 0; i < m->blocks.size(); ++i) {
      SCOPED_TRACE(std::string(c.flavor == hp::models::MoEFlavor::kMixtral ? "mixtral" : "qwen3") + " block " +
                   std::to_string(i));
      EXPECT_EQ(static_cast<bool>(m->blocks[i]->moe), c.is_moe(static_cast<int64_t>(i)));
      at::Tensor got = m->blocks[i]->forward(x, cos, sin);
      at::Tensor want = naive_block(c, *m->blocks[i], x);
      EXPECT_LE((got - want).abs().max().item<double>(), 1e-12 * want.abs().max().item<double>());
    }
  }
}

// What the family says light recompute keeps per token (ActivationCount::light) is what a
// block keeps: the bytes held after forward by 3 blocks less 2, float64, both flavors (the
// qwen3 one's third block a MoE, after a dense one).
TEST(MoELlama, LightRecomputeKeepsWhatTheFamilyCounts) {
  hp::memory::install_counting_allocator();
  const int64_t B = 2, T = 16;
  torch::manual_seed(7);
  for (const char* family : {"qwen3_moe", "mixtral"}) {
    auto args = hp::models::model_family(family).preset("tiny");
    MoELlamaConfig c = hp::models::config_of<MoELlamaConfig>(*args);
    c.sparse_step = family[0] == 'q' ? 3 : 1;  // qwen3: blocks 0, 1 dense, block 2 a MoE
    c.layers = 3;
    const at::Tensor tokens = at::randint(c.vocab, {B, T}, at::kLong);
    auto held = [&](int64_t layers) { return hp::test::light_bytes_held<hp::models::MoELlama>(c, layers, tokens); };
    hp::models::config_of<MoELlamaConfig>(*args) = c;
    args->set_layers(3);
    EXPECT_EQ(static_cast<double>(held(3) - held(2)), args->activations_per_token(T).light * B * T * 8) << family;
  }
}

TEST(MoELlama, BadConfigsNameTheField) {
  MoELlamaConfig c = MoELlamaConfig::qwen3_moe_tiny();
  c.experts_per_token = 9;
  hp::test::expect_error([&] { c.validate(); }, {"qwen3_moe", "experts_per_token=9", "experts=8"});
  c = MoELlamaConfig::qwen3_moe_tiny();
  c.sparse_step = 0;
  hp::test::expect_error([&] { c.validate(); }, {"sparse_step=0"});
  c = MoELlamaConfig::mixtral_tiny();
  c.qk_norm = true;
  hp::test::expect_error([&] { c.validate(); }, {"mixtral", "qk_norm=1"});
  c = MoELlamaConfig::mixtral_tiny();
  c.kv_heads = 3;
  hp::test::expect_error([&] { c.validate(); }, {"heads=4", "kv_heads=3"});
}

// The planner times the model at 1 and 2 layers (set_layers): each must keep the kinds of
// block the model has (a dense first block, then a MoE one), counted here by
// transformers' rule, block i sparse when (i + 1) % decoder_sparse_step == 0. And the
// routed FLOPs are one MoE block's (what its exchange hides behind), not the average.
TEST(MoELlama, PlannerModelsKeepTheKindsOfBlock) {
  const auto kinds = [](const hp::models::ModelArgs& a) {
    const MoELlamaConfig& c = hp::models::config_of<MoELlamaConfig>(a);
    int64_t moe = 0;
    for (int64_t i = 0; i < c.layers; ++i) moe += (i + 1) % c.sparse_step == 0 ? 1 : 0;
    return std::make_pair(c.layers - moe, moe);  // dense, MoE
  };
  auto qwen3 = hp::models::model_family("qwen3_moe").preset("tiny");
  auto& q = hp::models::config_of<MoELlamaConfig>(*qwen3);
  q.layers = 6;
  q.sparse_step = 3;
  auto one = qwen3->clone(), two = qwen3->clone();
  one->set_layers(1);
  two->set_layers(2);
  EXPECT_EQ(kinds(*one), std::make_pair(int64_t{1}, int64_t{0}));
  EXPECT_EQ(kinds(*two), std::make_pair(int64_t{1}, int64_t{1}));
  auto deep = qwen3->clone();
  deep->set_layers(12);  // deeper: the model's own step
  EXPECT_EQ(kinds(*deep), std::make_pair(int64_t{8}, int64_t{4}));
  // All dense stays all dense; all MoE (Mixtral) stays all MoE.
  q.sparse_step = 7;
  auto dense = qwen3->clone();
  dense->set_layers(8);
  EXPECT_EQ(kinds(*dense), std::make_pair(int64_t{8}, int64_t{0}));
  auto mixtral = hp::models::model_family("mixtral").preset("tiny");
  mixtral->set_layers(2);
  EXPECT_EQ(kinds(*mixtral), std::make_pair(int64_t{0}, int64_t{2}));
  // Routed FLOPs: 2 x 3 x dim x expert_hidden per expert a token runs, in one MoE block,
  // whatever share of the blocks are MoE ones.
  q.sparse_step = 3;
  const double routed = 2.0 * 3 * q.dim * q.expert_hidden * q.experts_per_token;
  EXPECT_EQ(qwen3->flops_per_token(16).routed, routed);
  EXPECT_EQ(mixtral->flops_per_token(16).routed,
            2.0 * 3 * hp::models::config_of<MoELlamaConfig>(*mixtral).dim *
                hp::models::config_of<MoELlamaConfig>(*mixtral).expert_hidden *
                hp::models::config_of<MoELlamaConfig>(*mixtral).experts_per_token);
}

// config.json as each family writes it is read back to the same model, and read under the
// other family's model_type is refused; the values a file may not have are named.
TEST(MoELlama, HuggingFaceConfigRoundTrips) {
  MoELlamaConfig q = MoELlamaConfig::qwen3_moe_tiny();
  q.sparse_step = 2;
  q.norm_topk = false;
  q.attention_bias = true;
  q.explicit_head_dim = 24;
  q.rope_theta = 5000;
  q.norm_eps = 1e-5;
  MoELlamaConfig m = MoELlamaConfig::mixtral_tiny();
  m.experts = 6;
  m.experts_per_token = 3;
  for (const MoELlamaConfig& c : {q, m}) {
    const std::string text = hp::models::hf_config(c, at::kFloat);
    const MoELlamaConfig r = hp::models::moe_llama_config_from_hf(c.flavor, text, "c.json");
    EXPECT_EQ(r.vocab, c.vocab);
    EXPECT_EQ(r.dim, c.dim);
    EXPECT_EQ(r.layers, c.layers);
    EXPECT_EQ(r.heads, c.heads);
    EXPECT_EQ(r.kv_heads, c.kv_heads);
    EXPECT_EQ(r.head_dim(), c.head_dim());
    EXPECT_EQ(r.qk_norm, c.qk_norm);
    EXPECT_EQ(r.attention_bias, c.attention_bias);
    EXPECT_EQ(r.experts, c.experts);
    EXPECT_EQ(r.experts_per_token, c.experts_per_token);
    EXPECT_EQ(r.expert_hidden, c.expert_hidden);
    EXPECT_EQ(r.norm_topk, c.norm_topk);
    EXPECT_EQ(r.sparse_step, c.sparse_step);
    EXPECT_EQ(r.moe_layers() < r.layers ? r.dense_hidden : 0, c.moe_layers() < c.layers ? c.dense_hidden : 0);
    EXPECT_EQ(r.rope_theta, c.rope_theta);
    EXPECT_EQ(r.norm_eps, c.norm_eps);
    EXPECT_NO_THROW(hp::models::check_hf_config(c, text, "c.json"));
    const auto other = c.flavor == hp::models::MoEFlavor::kMixtral ? hp::models::MoEFlavor::kQwen3Moe
                                                                   : hp::models::MoEFlavor::kMixtral;
    hp::test::expect_error([&] { hp::models::moe_llama_config_from_hf(other, text, "c.json"); }, {"'c.json'", "model_type"});
  }
  // A differing model is named by both keys.
  MoELlamaConfig wider = q;
  wider.dim = 128;
  hp::test::expect_error([&] { hp::models::check_hf_config(wider, hp::models::hf_config(q, at::kFloat), "c.json"); },
                         {"model.dim=128", "hidden_size=64"});
  // Values no model can have, from the file.
  const auto with = [&](const char* key, const char* value) {
    std::string text = hp::models::hf_config(q, at::kFloat);
    const std::string k = std::string("\"") + key + "\": ";
    const size_t at = text.find(k) + k.size();
    return text.replace(at, text.find_first_of(",\n", at) - at, value);
  };
  hp::test::expect_error([&] { hp::models::moe_llama_config_from_hf(q.flavor, with("rms_norm_eps", "0"), "c.json"); },
                         {"norm_eps=0"});
  hp::test::expect_error([&] { hp::models::moe_llama_config_from_hf(q.flavor, with("rope_theta", "-1"), "c.json"); },
                         {"rope_theta=-1"});
  hp::test::expect_error([&] { hp::models::moe_llama_config_from_hf(q.flavor, with("num_experts", "0"), "c.json"); },
                         {"num_experts=0", "not supported yet"});
  hp::test::expect_error(
      [&] { hp::models::moe_llama_config_from_hf(q.flavor, with("num_experts_per_tok", "9"), "c.json"); },
      {"experts_per_token=9"});
}
