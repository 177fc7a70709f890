// The DeepSeek-V3-style model against naive implementations written here.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "hp/models/deepseek.h"
#include "test_util.h"

using hp::models::DeepSeekConfig;

TEST(DeepSeek, ParameterCountFromTheConfig) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::DeepSeek m(c);
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  EXPECT_EQ(n, c.num_params());
  // Published: DeepSeek-V3 has 671 B parameters (without the multi-token prediction module).
  EXPECT_NEAR(DeepSeekConfig::deepseek_v3().num_params() / 1e9, 671, 2);
}

TEST(DeepSeek, RoutingPicksTopKByScorePlusBiasAndNormalizesChosenScores) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::MoE moe(c);
  {
    at::NoGradGuard g;
    moe->bias.copy_(at::linspace(0, 0.7, c.experts));  // favour the high experts in selection
  }
  at::Tensor x = at::randn({6, c.dim});
  auto [chosen, w] = moe->route(x);
  at::Tensor scores = moe->gate->forward(x).sigmoid();
  for (int t = 0; t < 6; ++t) {
    // Naive: sort experts by score + bias, take the first k.
    std::vector<std::pair<double, int>> order;
    for (int e = 0; e < c.experts; ++e) {
      order.push_back({scores[t][e].item<double>() + moe->bias[e].item<double>(), e});
    }
    std::sort(order.rbegin(), order.rend());
    double sum = 0;
    for (int k = 0; k < c.experts_per_token; ++k) sum += scores[t][order[k].second].item<double>();
    std::vector<int> want, got;
    for (int k = 0; k < c.experts_per_token; ++k) {
      want.push_back(order[k].second);
      got.push_back(static_cast<int>(chosen[t][k].item<int64_t>()));
      // The weight is the chosen expert's own score (no bias), normalized over the chosen.
      EXPECT_NEAR(w[t][k].item<double>(), scores[t][chosen[t][k].item<int64_t>()].item<double>() / sum, 1e-6);
    }
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want);
  }
}

TEST(DeepSeek, MoEOutputMatchesAPerTokenLoop) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::MoE moe(c);
  at::Tensor x = at::randn({2, 3, c.dim});
  at::Tensor got = moe->forward(x);
  at::Tensor flat = x.reshape({-1, c.dim});
  auto [chosen, w] = moe->route(flat);
  for (int64_t t = 0; t < flat.size(0); ++t) {
    at::Tensor want = moe->shared->forward(flat[t].unsqueeze(0))[0];
    for (int64_t k = 0; k < c.experts_per_token; ++k) {
      int64_t e = chosen[t][k].item<int64_t>();
      want = want + w[t][k] * moe->experts->list[e]->forward(flat[t].unsqueeze(0))[0];
    }
    EXPECT_TRUE(at::allclose(got.reshape({-1, c.dim})[t], want, 1e-5, 1e-6)) << "token " << t;
  }
}

TEST(DeepSeek, BalancingBiasMovesTowardUnderloadedExpertsWithoutGradient) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::MoE moe(c);
  EXPECT_FALSE(moe->bias.requires_grad());
  at::Tensor x = at::randn({64, c.dim});
  moe->forward(x);
  at::Tensor load = moe->load.clone();
  EXPECT_EQ(load.sum().item<double>(), 64.0 * c.experts_per_token);
  moe->update_balancing_bias(0.01);
  double mean = load.mean().item<double>();
  for (int e = 0; e < c.experts; ++e) {
    double l = load[e].item<double>(), b = moe->bias[e].item<double>();
    if (l > mean) {
      EXPECT_FLOAT_EQ(b, -0.01f) << e;
    }
    if (l < mean) {
      EXPECT_FLOAT_EQ(b, 0.01f) << e;
    }
  }
  EXPECT_EQ(moe->load.sum().item<double>(), 0.0);
}

TEST(DeepSeek, MlaMatchesANaiveComputation) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::MLA att(c);
  const int64_t B = 1, T = 4, H = c.heads, qk = c.qk_nope_dim + c.qk_rope_dim;
  at::Tensor x = at::randn({B, T, c.dim});
  auto [cos, sin] = hp::models::rotary_tables(T, c.qk_rope_dim, c.rope_theta);
  at::Tensor got = att->forward(x, cos, sin);
  // Naive, token by token and head by head.
  at::Tensor o = at::zeros({B, T, H * c.v_head_dim});
  at::Tensor q = att->wq_b->forward(att->q_norm->forward(att->wq_a->forward(x)));  // [B,T,H*qk]
  at::Tensor kva = att->wkv_a->forward(x);
  at::Tensor kv = att->wkv_b->forward(att->kv_norm->forward(kva.narrow(-1, 0, c.kv_lora_rank)));
  auto rot = [&](at::Tensor v, int64_t t) {  // rotate pairs of v by position t
    at::Tensor out = v.clone();
    for (int64_t i = 0; i < v.size(0) / 2; ++i) {
      double ang = t * std::pow(c.rope_theta, -2.0 * i / c.qk_rope_dim);
      double a = v[2 * i].item<double>(), b = v[2 * i + 1].item<double>();
      out[2 * i] = a * std::cos(ang) - b * std::sin(ang);
      out[2 * i + 1] = a * std::sin(ang) + b * std::cos(ang);
    }
    return out;
  };
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      at::Tensor qh = q[0][t].narrow(0, h * qk, qk);
      at::Tensor qn = qh.narrow(0, 0, c.qk_nope_dim), qr = rot(qh.narrow(0, c.qk_nope_dim, c.qk_rope_dim), t);
      std::vector<double> s;
      for (int64_t u = 0; u <= t; ++u) {
        at::Tensor kvh = kv[0][u].narrow(0, h * (c.qk_nope_dim + c.v_head_dim), c.qk_nope_dim + c.v_head_dim);
        at::Tensor kr = rot(kva[0][u].narrow(0, c.kv_lora_rank, c.qk_rope_dim), u);  // shared by heads
        s.push_back(((qn * kvh.narrow(0, 0, c.qk_nope_dim)).sum() + (qr * kr).sum()).item<double>() / std::sqrt(double(qk)));
      }
      double mx = *std::max_element(s.begin(), s.end()), z = 0;
      for (auto& e : s) z += (e = std::exp(e - mx));
      at::Tensor acc = at::zeros({c.v_head_dim});
      for (int64_t u = 0; u <= t; ++u) {
        acc += kv[0][u].narrow(0, h * (c.qk_nope_dim + c.v_head_dim) + c.qk_nope_dim, c.v_head_dim) * (s[u] / z);
      }
      o[0][t].narrow(0, h * c.v_head_dim, c.v_head_dim).copy_(acc);
    }
  }
  at::Tensor want = att->wo->forward(o);
  EXPECT_TRUE(at::allclose(got, want, 1e-4, 1e-5)) << (got - want).abs().max().item<double>();
}

TEST(DeepSeek, FirstLayersDenseAndForwardShape) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::DeepSeek m(c);
  EXPECT_TRUE(m->blocks[0]->dense && !m->blocks[0]->moe);
  EXPECT_TRUE(m->blocks[1]->moe && !m->blocks[1]->dense);
  at::Tensor tokens = at::randint(c.vocab, {2, 5}, at::kLong);
  at::Tensor logits = m->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 5, c.vocab}));
  logits.sum().backward();
  EXPECT_TRUE(m->blocks[1]->moe->gate->weight.grad().defined());
  DeepSeekConfig bad = c;
  bad.experts_per_token = 9;
  hp::test::expect_error([&] { bad.validate(); }, {"experts_per_token=9", "experts=8"});
}

TEST(DeepSeek, LargestBlockIsAnMoEBlockCountedByHand) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::DeepSeek m(c);
  int64_t moe = 0, dense = 0;
  for (const auto& p : m->blocks[1]->parameters()) moe += p.numel();
  for (const auto& p : m->blocks[0]->parameters()) dense += p.numel();
  EXPECT_EQ(c.largest_block_params(), std::max(moe, dense));
}

// Checkpointed blocks: the logits and every gradient are bitwise those of the plain model,
// and each MoE counts its expert load once per token and choice, not again when the block
// is recomputed in backward (the balancing bias reads that count).
TEST(DeepSeek, RecomputedBlocksGiveBitwiseGradientsAndCountLoadOnce) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::DeepSeek plain(c), ckpt(c);
  plain->init_weights(3);
  ckpt->init_weights(3);
  ckpt->recompute = hp::RecomputePolicy::kFull;
  torch::manual_seed(4);
  const int64_t B = 2, T = 8;
  at::Tensor tokens = at::randint(c.vocab, {B, T}, at::kLong);
  at::Tensor a = plain->forward(tokens), b = ckpt->forward(tokens);
  EXPECT_TRUE(at::equal(a, b));
  a.pow(2).mean().backward();
  b.pow(2).mean().backward();
  auto pa = plain->named_parameters(), pb = ckpt->named_parameters();
  for (const auto& item : pa) {
    const at::Tensor& ga = item.value().grad();
    const at::Tensor& gb = pb[item.key()].grad();
    ASSERT_EQ(ga.defined(), gb.defined()) << item.key();
    if (ga.defined()) {
      EXPECT_TRUE(at::equal(ga, gb)) << item.key();
    }
  }
  for (size_t i = 0; i < ckpt->blocks.size(); ++i) {
    if (!ckpt->blocks[i]->moe) continue;
    EXPECT_EQ(ckpt->blocks[i]->moe->load.sum().item<double>(), static_cast<double>(B * T * c.experts_per_token))
        << "block " << i;
    EXPECT_TRUE(at::equal(ckpt->blocks[i]->moe->load, plain->blocks[i]->moe->load)) << "block " << i;
  }
}
