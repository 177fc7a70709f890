// The Llama-style model against naive implementations written here.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>

#include "hp/core/memory.h"
#include "hp/models/family.h"
#include "hp/models/llama.h"
#include "light_recompute_util.h"
#include "test_util.h"

using hp::models::LlamaConfig;

TEST(Llama, ParameterCountFromTheConfigMatchesTheModel) {
  for (bool tied : {false, true}) {
    LlamaConfig c = LlamaConfig::tiny();
    c.tie_embeddings = tied;
    hp::models::Llama m(c);
    int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    EXPECT_EQ(n, c.num_params()) << "tied=" << tied;
  }
  // An explicit head size and biases: counted by hand, per block q 64x(4x24) + 96, k and v
  // 64x(2x24) + 48 each, o (96)x64 + 64; the MLP 3 x 64x160 + 2 x 160 + 64; two norms 64.
  LlamaConfig v = LlamaConfig::tiny();
  v.ffn_dim = 160;
  v.explicit_head_dim = 24;
  v.attention_bias = v.mlp_bias = true;
  const int64_t block = (64 * 96 + 96) + 2 * (64 * 48 + 48) + (96 * 64 + 64) + (3 * 64 * 160 + 2 * 160 + 64) + 2 * 64;
  EXPECT_EQ(v.block_params(), block);
  EXPECT_EQ(v.num_params(), 2 * 256 * 64 + 2 * block + 64);
  hp::models::Llama m(v);
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  EXPECT_EQ(n, v.num_params());
  EXPECT_EQ(m->named_parameters()["layers_0.attn.wq.weight"].sizes(), at::IntArrayRef({96, 64}));
  EXPECT_TRUE(m->named_parameters().contains("layers_1.mlp.w2.bias"));
  // Qwen2's biases: on q, k and v only (96 + 48 + 48 per block), none elsewhere.
  LlamaConfig q = LlamaConfig::tiny();
  q.ffn_dim = 160;
  q.explicit_head_dim = 24;
  q.qkv_bias = true;
  const int64_t qblock = (64 * 96 + 96) + 2 * (64 * 48 + 48) + 96 * 64 + 3 * 64 * 160 + 2 * 64;
  EXPECT_EQ(q.num_params(), 2 * 256 * 64 + 2 * qblock + 64);
  hp::models::Llama qm(q);
  n = 0;
  for (const auto& p : qm->parameters()) n += p.numel();
  EXPECT_EQ(n, q.num_params());
  EXPECT_FALSE(qm->named_parameters().contains("layers_0.attn.wo.bias"));
  q.attention_bias = true;
  hp::test::expect_error([&] { q.validate(); }, {"qkv_bias=true with attention_bias=true"});
  // Published size, from the config alone: Llama 3 8B has 8.03 B parameters.
  EXPECT_NEAR(LlamaConfig::llama3_8b().num_params() / 1e9, 8.03, 0.01);
}

TEST(Llama, RmsNormMatchesTheFormula) {
  hp::models::RMSNorm n(6, 1e-5);
  {
    at::NoGradGuard g;
    n->weight.copy_(at::arange(1, 7, at::kFloat));
  }
  at::Tensor x = at::randn({3, 6});
  at::Tensor got = n->forward(x);
  for (int r = 0; r < 3; ++r) {
    double ms = 0;
    for (int i = 0; i < 6; ++i) ms += x[r][i].item<double>() * x[r][i].item<double>() / 6;
    for (int i = 0; i < 6; ++i) {
      double want = x[r][i].item<double>() / std::sqrt(ms + 1e-5) * (i + 1);
      EXPECT_NEAR(got[r][i].item<double>(), want, 1e-5);
    }
  }
}

TEST(Llama, RotaryRotatesEachPairByItsAngle) {
  const int64_t T = 5, D = 8;
  const double theta = 10000;
  auto [cos, sin] = hp::models::rotary_tables(T, D, theta);
  at::Tensor x = at::randn({1, 2, T, D});
  // Interleaved pairs (x[2i], x[2i+1]) and halves (x[i], x[i + D/2]), by hand.
  for (auto layout : {hp::models::RotaryPairs::kInterleaved, hp::models::RotaryPairs::kHalves}) {
    const bool halves = layout == hp::models::RotaryPairs::kHalves;
    at::Tensor got = hp::models::apply_rotary(x, cos, sin, layout);
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < T; ++t) {
        for (int i = 0; i < D / 2; ++i) {
          const int ia = halves ? i : 2 * i, ib = halves ? i + D / 2 : 2 * i + 1;
          double ang = t * std::pow(theta, -2.0 * i / D);
          double a = x[0][h][t][ia].item<double>(), b = x[0][h][t][ib].item<double>();
          EXPECT_NEAR(got[0][h][t][ia].item<double>(), a * std::cos(ang) - b * std::sin(ang), 1e-5);
          EXPECT_NEAR(got[0][h][t][ib].item<double>(), a * std::sin(ang) + b * std::cos(ang), 1e-5);
        }
      }
    }
  }
}

TEST(Llama, GroupedQueryAttentionMatchesANaiveLoop) {
  LlamaConfig c = LlamaConfig::tiny();  // 4 query heads share 2 key/value heads
  hp::models::LlamaAttention att(c);
  const int64_t B = 2, T = 5, hd = c.head_dim();
  at::Tensor x = at::randn({B, T, c.dim});
  auto [cos, sin] = hp::models::rotary_tables(T, hd, c.rope_theta);
  at::Tensor got = att->forward(x, cos, sin);
  // Naive: per head h, its kv head is h / (heads / kv_heads); causal softmax by loops.
  at::Tensor q = hp::models::apply_rotary(att->wq->forward(x).view({B, T, c.heads, hd}).transpose(1, 2), cos, sin,
                                            hp::models::RotaryPairs::kHalves);
  at::Tensor k = hp::models::apply_rotary(att->wk->forward(x).view({B, T, c.kv_heads, hd}).transpose(1, 2), cos, sin,
                                            hp::models::RotaryPairs::kHalves);
  at::Tensor v = att->wv->forward(x).view({B, T, c.kv_heads, hd}).transpose(1, 2);
  at::Tensor o = at::zeros({B, T, c.heads * hd});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < c.heads; ++h) {
      int64_t kvh = h / (c.heads / c.kv_heads);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> w;
        double mx = -1e300, z = 0;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = (q[b][h][t] * k[b][kvh][s]).sum().item<double>() / std::sqrt(double(hd));
          w.push_back(dot);
          mx = std::max(mx, dot);
        }
        for (auto& e : w) z += (e = std::exp(e - mx));
        at::Tensor acc = at::zeros({hd});
        for (int64_t s = 0; s <= t; ++s) acc += v[b][kvh][s] * (w[s] / z);
        o[b][t].narrow(0, h * hd, hd).copy_(acc);
      }
    }
  }
  at::Tensor want = att->wo->forward(o);
  EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-5)) << (got - want).abs().max().item<double>();
}

TEST(Llama, InitIsDeterministicAndIndependentOfWhatElseIsBuilt) {
  LlamaConfig two = LlamaConfig::tiny(), three = LlamaConfig::tiny();
  three.layers = 3;
  hp::models::Llama a(two), b(three);
  a->init_weights(42);
  b->init_weights(42);
  // Layer 1's weights do not depend on how many layers there are.
  for (const auto& item : a->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), b->named_parameters()[item.key()])) << item.key();
  }
  hp::models::Llama c(two);
  c->init_weights(43);
  EXPECT_FALSE(at::equal(a->blocks[0]->attn->wq->weight, c->blocks[0]->attn->wq->weight));
}

TEST(Llama, ForwardShapesTiedAndBadConfigs) {
  LlamaConfig c = LlamaConfig::tiny();
  c.tie_embeddings = true;
  hp::models::Llama m(c);
  at::Tensor tokens = at::randint(c.vocab, {2, 7}, at::kLong);
  EXPECT_EQ(m->forward(tokens).sizes(), (std::vector<int64_t>{2, 7, c.vocab}));
  at::Tensor targets = at::randint(c.vocab, {2, 7}, at::kLong);
  at::Tensor loss = m->loss(tokens, targets);
  EXPECT_NEAR(loss.item<double>(), std::log(double(c.vocab)), 0.5);  // near-uniform at init
  LlamaConfig bad = LlamaConfig::tiny();
  bad.kv_heads = 3;
  hp::test::expect_error([&] { bad.validate(); }, {"heads=4", "kv_heads=3"});
  bad = LlamaConfig::tiny();
  bad.dim = 66;
  hp::test::expect_error([&] { bad.validate(); }, {"dim=66", "heads=4"});
}

// Llama 3.1's rotary scaling against values worked out by hand: head_dim 8, theta 10000
// (frequencies 1, 0.1, 0.01, 0.001, wavelengths 2 pi / f), factor 8, low/high frequency
// factors 1 and 4 over 128 original positions (wavelengths above 128 divided by 8, below 32
// kept, between blended): 1 kept; 0.1 (wavelength 62.8) blended with s = (128 / 62.83 - 1) /
// 3 = 0.34573 to (1 - s) 0.1 / 8 + s 0.1 = 0.042751; 0.01 and 0.001 divided by 8. Linear: all
// divided by the factor.
TEST(Llama, RotaryScalingAsWorkedOutByHand) {
  hp::models::RopeOptions o;
  o.theta = 10000;
  o.scaling = hp::models::RopeScaling::kLlama3;
  o.factor = 8;
  o.low_freq_factor = 1;
  o.high_freq_factor = 4;
  o.original_max_seq = 128;
  auto freqs = [](const hp::models::RopeOptions& r) {
    auto [cos, sin] = hp::models::rotary_tables(2, 8, r);
    return at::atan2(sin[1], cos[1]);  // position 1's angles: the frequencies
  };
  const double s = (128 / (2 * M_PI / 0.1) - 1) / 3;
  const std::vector<double> want = {1.0, (1 - s) * 0.1 / 8 + s * 0.1, 0.01 / 8, 0.001 / 8};
  at::Tensor got = freqs(o);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i].item<double>(), want[static_cast<size_t>(i)], 1e-12) << i;
  EXPECT_NEAR(want[1], 0.042751, 1e-6);
  o.scaling = hp::models::RopeScaling::kLinear;
  got = freqs(o);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i].item<double>(), std::pow(10000.0, -i / 4.0) / 8, 1e-12) << i;
  // yarn, factor 4 over 16 original positions, betas 32 and 1, head_dim 8: the dim turning
  // 32 times is 8 ln(16 / (32 2 pi)) / (2 ln 10000) = -1.10, floored to -2, so 0; the one
  // turning once is 8 ln(16 / (2 pi)) / (2 ln 10000) = 0.41, ceiled to 1. The ramp is 0 at
  // pair 0 (kept) and 1 from pair 1 on (divided by 4); the tables scaled by 0.1 ln 4 + 1.
  o.scaling = hp::models::RopeScaling::kYarn;
  o.factor = 4;
  o.original_max_seq = 16;
  o.beta_fast = 32;
  o.beta_slow = 1;
  got = freqs(o);
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(got[i].item<double>(), std::pow(10000.0, -i / 4.0) / (i == 0 ? 1 : 4), 1e-12) << i;
  }
  auto [cos, sin] = hp::models::rotary_tables(2, 8, o);
  EXPECT_NEAR(std::hypot(cos[1][2].item<double>(), sin[1][2].item<double>()), 0.1 * std::log(4.0) + 1, 1e-12);
  // Both mscales given: their ratio (1.2 ln 4 / 0.6 ln 4, each plus 1).
  o.mscale = 2;
  o.mscale_all_dim = 1;
  EXPECT_NEAR(hp::models::rope_attention_factor(o), (0.2 * std::log(4.0) + 1) / (0.1 * std::log(4.0) + 1), 1e-15);
}

// Light recompute (DeepSeek-V3's policy): logits and every gradient bitwise those of the
// plain model; one more block keeps exactly what the family counts for it
// (ActivationCount::light: its input, the Linear outputs, attention's output and
// log-sum-exps), measured with the counting allocator as the bytes held after forward by a
// model of 2 blocks less one of 1.
TEST(Llama, LightRecomputeIsBitwiseAndKeepsWhatTheFamilyCounts) {
  hp::memory::install_counting_allocator();
  LlamaConfig c = LlamaConfig::tiny();
  const int64_t B = 2, T = 16;
  torch::manual_seed(6);
  const at::Tensor tokens = at::randint(c.vocab, {B, T}, at::kLong);
  hp::models::Llama plain(c), light(c);
  plain->init_weights(3);
  light->init_weights(3);
  plain->to(at::kDouble);
  light->to(at::kDouble);
  light->recompute = hp::RecomputePolicy::kLight;
  at::Tensor a = plain->forward(tokens), b = light->forward(tokens);
  EXPECT_TRUE(at::equal(a, b));
  a.pow(2).mean().backward();
  b.pow(2).mean().backward();
  auto pb = light->named_parameters();
  for (const auto& item : plain->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value().grad(), pb[item.key()].grad())) << item.key();
  }
  auto held = [&](int64_t layers) { return hp::test::light_bytes_held<hp::models::Llama>(c, layers, tokens); };
  auto args = hp::models::model_family("llama").preset("tiny");
  const double per_token = args->activations_per_token(T).light;
  EXPECT_EQ(static_cast<double>(held(2) - held(1)), per_token * B * T * 8);
}
