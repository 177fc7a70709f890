// The DeepSeek-V3-style model against naive implementations written here.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "hp/core/memory.h"
#include "hp/models/deepseek.h"
#include "hp/models/family.h"
#include "light_recompute_util.h"
#include "models/deepseek_naive.h"
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
  // And 14 B in its MTP module, as the published folder stores it (with its copies of the
  // embedding and the head).
  DeepSeekConfig v3 = DeepSeekConfig::deepseek_v3();
  v3.mtp_layers = 1;
  EXPECT_NEAR((v3.mtp_module_params() + 2 * v3.vocab * v3.dim) / 1e9, 14, 0.6);
  c.mtp_layers = 1;
  hp::models::DeepSeek with_mtp(c);
  n = 0;
  for (const auto& p : with_mtp->parameters()) n += p.numel();
  EXPECT_EQ(n, c.num_params());
  EXPECT_EQ(c.num_params() - c.mtp_module_params(), DeepSeekConfig::tiny().num_params());
}

// Multi-token prediction: a forward with the targets trains the MTP module's loss (the
// module applied by hand in naive_deepseek_mtp) times mtp_loss_scale x loss_scale beside the
// next-token loss, whose value it leaves alone; the MTP loss is kept for the metrics. Not in a
// forward without gradients; a differentiated forward without the targets is an error.
TEST(DeepSeek, MultiTokenPredictionTrainsTheModuleAppliedByHand) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  c.mtp_layers = 1;
  c.mtp_loss_scale = 0.3;
  const int64_t B = 2, T = 7;
  hp::models::DeepSeek m(c), naive(c);  // the same seeded initial values
  m->to(at::kDouble);
  naive->to(at::kDouble);
  m->loss_scale = 0.5;
  at::manual_seed(5);
  const at::Tensor x = at::randint(c.vocab, {B, T}), y = at::randint(c.vocab, {B, T});

  m->set_targets(y);
  at::Tensor loss = m->loss_of_logits(m->forward(x), y);
  (0.5 * loss).backward();
  const auto [mtp_sum, count] = m->take_mtp_loss();
  EXPECT_EQ(count, 1);
  EXPECT_EQ(m->take_mtp_loss().second, 0) << "taken once";

  // Bounds: float64 throughout; the model and the hand computation differ only in the order
  // of a few reductions (the head run once on both rows, attention in tiles), ~1e-16 relative
  // each, on losses near 5.5 and gradients of order 1: 1e-13 absolute for the losses, 1e-12
  // for the logits and (relative to the largest entry, at least 1) the gradients.
  auto [logits, mtp] = hp::test::naive_deepseek_mtp(*naive, x, y);
  at::Tensor main = torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocab}), y.reshape({-1}));
  EXPECT_NEAR(loss.item<double>(), main.item<double>(), 1e-13) << "the reported loss is the next-token one";
  EXPECT_NEAR(mtp_sum, mtp.item<double>(), 1e-13);
  EXPECT_GT(std::fabs(mtp_sum - main.item<double>()), 1e-3);
  (0.5 * (main + 0.3 * mtp)).backward();
  auto want = naive->named_parameters();
  int64_t compared = 0;
  for (const auto& p : m->named_parameters()) {
    const at::Tensor g = p.value().grad(), w = want[p.key()].grad();
    ASSERT_TRUE(g.defined() && w.defined()) << p.key();
    EXPECT_LE((g - w).abs().max().item<double>(), 1e-12 * std::max(1.0, w.abs().max().item<double>())) << p.key();
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(want.size()));
  EXPECT_GT(m->mtp[0]->eh_proj->weight.grad().abs().max().item<double>(), 0);

  {  // Evaluation: the same logits, nothing trained or kept.
    at::NoGradGuard g;
    EXPECT_LE((m->forward(x) - logits).abs().max().item<double>(), 1e-12);
    EXPECT_EQ(m->take_mtp_loss().second, 0);
  }
  hp::test::expect_error([&] { m->forward(x); }, {"mtp_layers=1", "needs the targets", "set_targets"});
  m->set_targets(y.narrow(1, 0, 1));
  hp::test::expect_error([&] { m->forward(x.narrow(1, 0, 1)); }, {"at least 2 tokens, got 1"});
  c.mtp_layers = 2;
  hp::test::expect_error([&] { c.validate(); }, {"mtp_layers=2", "not supported yet"});
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

// Group-limited routing (DeepSeek-V3's): 12 experts in 4 groups of 3, each token's 3 experts
// from its 2 best groups (a group's score: its two best score + bias), weights scaled by 2.5.
TEST(DeepSeek, GroupLimitedRoutingPicksWithinTheBestGroupsAndScalesTheWeights) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  c.experts = 12;
  c.experts_per_token = 3;
  c.expert_groups = 4;
  c.groups_per_token = 2;
  c.routed_scale = 2.5;
  c.validate();
  at::manual_seed(3);
  hp::models::MoE moe(c);
  {
    at::NoGradGuard g;
    moe->bias.copy_(at::linspace(-0.05, 0.05, c.experts));  // small beside the scores' spread
  }
  const int T = 200;
  at::Tensor x = at::randn({T, c.dim});
  auto [chosen, w] = moe->route(x);
  at::Tensor scores = moe->gate->forward(x).sigmoid();
  int64_t outside_best_experts = 0;  // tokens whose best k experts overall are not all allowed
  for (int t = 0; t < T; ++t) {
    auto s = [&](int e) { return scores[t][e].item<double>() + moe->bias[e].item<double>(); };
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < 4; ++g) {
      std::vector<double> in = {s(3 * g), s(3 * g + 1), s(3 * g + 2)};
      std::sort(in.rbegin(), in.rend());
      groups.push_back({in[0] + in[1], g});
    }
    std::sort(groups.rbegin(), groups.rend());
    std::vector<std::pair<double, int>> allowed, every;
    for (int e = 0; e < c.experts; ++e) {
      every.push_back({s(e), e});
      if (e / 3 == groups[0].second || e / 3 == groups[1].second) allowed.push_back({s(e), e});
    }
    std::sort(allowed.rbegin(), allowed.rend());
    std::sort(every.rbegin(), every.rend());
    std::vector<int> want, got, best;
    double sum = 0;
    for (int k = 0; k < 3; ++k) {
      want.push_back(allowed[k].second);
      best.push_back(every[k].second);
      got.push_back(static_cast<int>(chosen[t][k].item<int64_t>()));
      sum += scores[t][allowed[k].second].item<double>();
    }
    for (int k = 0; k < 3; ++k) {
      EXPECT_NEAR(w[t][k].item<double>(), 2.5 * scores[t][got[k]].item<double>() / sum, 1e-6) << "token " << t;
    }
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    std::sort(best.begin(), best.end());
    EXPECT_EQ(got, want) << "token " << t;
    outside_best_experts += best != want;
  }
  EXPECT_GT(outside_best_experts, 0) << "the group limit never mattered: the test does not exercise it";
  // Bad groupings are refused before a model is built.
  DeepSeekConfig bad = c;
  bad.expert_groups = 5;
  hp::test::expect_error([&] { bad.validate(); }, {"expert_groups=5", "must divide experts=12"});
  bad = c;
  bad.groups_per_token = 1;
  bad.experts_per_token = 4;
  hp::test::expect_error([&] { bad.validate(); }, {"experts_per_token=4", "groups_per_token=1"});
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
 for (auto policy : {hp::RecomputePolicy::kFull, hp::RecomputePolicy::kLight}) {
  SCOPED_TRACE(policy == hp::RecomputePolicy::kFull ? "full" : "light");
  DeepSeekConfig c = DeepSeekConfig::tiny();
  hp::models::DeepSeek plain(c), ckpt(c);
  plain->init_weights(3);
  ckpt->init_weights(3);
  ckpt->recompute = policy;
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
}

// Light recompute keeps, per MoE block, what the family counts (ActivationCount::light: the
// block's input; wq_a, wkv_a and wo's outputs; attention's output and log-sum-exps; the
// router's scores, each routed expert's and the shared experts' three Linear outputs):
// measured as the bytes held after forward by a model of 3 blocks less one of 2 (the first
// dense, the others MoE), in float64. MLA's up-projections and the norms are not kept.
TEST(DeepSeek, LightRecomputeKeepsWhatTheFamilyCounts) {
  hp::memory::install_counting_allocator();
  DeepSeekConfig c = DeepSeekConfig::tiny();
  ASSERT_EQ(c.dense_layers, 1);
  const int64_t B = 2, T = 16;
  torch::manual_seed(7);
  const at::Tensor tokens = at::randint(c.vocab, {B, T}, at::kLong);
  auto held = [&](int64_t layers) { return hp::test::light_bytes_held<hp::models::DeepSeek>(c, layers, tokens); };
  auto args = hp::models::model_family("deepseek").preset("tiny");
  args->set_layers(3);
  const double per_token = args->activations_per_token(T).light;
  EXPECT_EQ(static_cast<double>(held(3) - held(2)), per_token * B * T * 8);
}

// The sequence-wise balance loss (DeepSeek-V3 eq. 17-20) against a loop written here, and
// its gradient: the MoE's output is unchanged, and the router gets loss_scale x the loss's
// gradient on top of the output's (float64).
TEST(DeepSeek, BalanceLossIsTheSequenceWiseFormulaScaledIntoBackward) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  c.aux_loss_coeff = 0.3;
  const int64_t B = 2, T = 5, E = c.experts, k = c.experts_per_token;
  at::manual_seed(11);
  hp::models::MoE moe(c);
  moe->to(at::kDouble);
  moe->loss_scale = 0.25;
  const at::Tensor x = at::randn({B, T, c.dim}, at::kDouble);
  auto gate_grad = [&](double coeff) {
    moe->c.aux_loss_coeff = coeff;
    moe->zero_grad();
    at::Tensor out = moe->forward(x);
    out.sum().backward();
    return std::make_pair(out.detach(), moe->gate->weight.grad().clone());
  };
  const auto [out0, g0] = gate_grad(0);
  const auto [out1, g1] = gate_grad(0.3);
  EXPECT_TRUE(at::equal(out0, out1)) << "the balance loss changed the output";

  // By hand: per sequence, f_e = E / (k T) x (tokens choosing e), P_e = the mean over its
  // tokens of e's score over the sum of all scores; 0.3 x sum_e f_e P_e, averaged over B.
  moe->zero_grad();
  at::Tensor scores = moe->gate->forward(x.reshape({-1, c.dim})).sigmoid();
  const at::Tensor chosen = moe->route_scores(scores.detach()).first;
  at::Tensor want = at::zeros({}, at::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t e = 0; e < E; ++e) {
      double picked = 0;
      at::Tensor share = at::zeros({}, at::kDouble);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < k; ++j) picked += chosen[b * T + t][j].item<int64_t>() == e ? 1 : 0;
        share = share + scores[b * T + t][e] / scores[b * T + t].sum() / static_cast<double>(T);
      }
      want = want + static_cast<double>(E) / static_cast<double>(k * T) * picked * share;
    }
  }
  want = 0.3 * want / static_cast<double>(B);
  const at::Tensor got = moe->balance_loss(scores, chosen, B, T);
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-14);
  want.backward();
  const at::Tensor by_hand = moe->gate->weight.grad();
  EXPECT_GT(by_hand.abs().max().item<double>(), 0);
  EXPECT_LE((g1 - g0 - 0.25 * by_hand).abs().max().item<double>(), 1e-12 * g1.abs().max().item<double>());
}

// A capacity limit keeps at most ceil(factor x tokens x k / experts) of each expert's slots:
// the highest router scores (probs; ties by token order) or the first tokens (position),
// against a loop here; the MoE's output then sums the kept slots alone, weights as routed.
TEST(DeepSeek, CapacityKeepsEachExpertsBestSlotsAndDropsTheRest) {
  for (auto policy : {hp::models::DropPolicy::kProbs, hp::models::DropPolicy::kPosition}) {
    DeepSeekConfig c = DeepSeekConfig::tiny();
    c.capacity_factor = 0.75;
    c.drop_policy = policy;
    at::manual_seed(5);
    hp::models::MoE moe(c);
    moe->to(at::kDouble);
    {
      at::NoGradGuard g;  // crowd experts 0 and 1 so that they overflow
      moe->bias.copy_(at::tensor({0.6, 0.5, 0., 0., 0., 0., 0., 0.}, at::kDouble));
    }
    const int64_t B = 2, T = 6, N = B * T, k = c.experts_per_token, E = c.experts;
    const at::Tensor x = at::randn({B, T, c.dim}, at::kDouble);
    const at::Tensor flat = x.reshape({-1, c.dim});
    const at::Tensor scores = moe->gate->forward(flat).sigmoid();
    auto [chosen, w] = moe->route_scores(scores);
    const at::Tensor keep = moe->capacity_keep(scores.gather(-1, chosen), chosen);
    const int64_t cap = static_cast<int64_t>(std::ceil(0.75 * N * k / E));  // 3
    int64_t dropped = 0;
    for (int64_t e = 0; e < E; ++e) {
      std::vector<std::pair<double, int64_t>> slots;  // (priority, slot), best first
      for (int64_t s = 0; s < N * k; ++s) {
        const int64_t t = s / k, j = s % k;
        if (chosen[t][j].item<int64_t>() != e) continue;
        const double p = policy == hp::models::DropPolicy::kProbs ? -scores[t][e].item<double>() : 0.0;
        slots.push_back({p, s});
      }
      std::stable_sort(slots.begin(), slots.end());
      for (size_t i = 0; i < slots.size(); ++i) {
        const int64_t s = slots[i].second;
        EXPECT_EQ(keep[s / k][s % k].item<bool>(), static_cast<int64_t>(i) < cap) << "expert " << e << " slot " << s;
      }
      dropped += std::max<int64_t>(0, static_cast<int64_t>(slots.size()) - cap);
    }
    EXPECT_GT(dropped, 0) << "nothing overflowed: the test does not exercise the limit";

    at::Tensor got = moe->forward(x).reshape({-1, c.dim});
    for (int64_t t = 0; t < N; ++t) {
      at::Tensor want = moe->shared->forward(flat[t].unsqueeze(0))[0];
      for (int64_t j = 0; j < k; ++j) {
        if (!keep[t][j].item<bool>()) continue;
        want = want + w[t][j] * moe->experts->list[chosen[t][j].item<int64_t>()]->forward(flat[t].unsqueeze(0))[0];
      }
      EXPECT_LE((got[t] - want).abs().max().item<double>(), 1e-12) << "token " << t;
    }
    EXPECT_EQ(moe->dropped.item<double>(), static_cast<double>(dropped));
  }
}

// Rows left out of routing (MoE::routed_rows: the multi-token prediction module's last
// position under context parallelism) are routed as if they were not there: the other rows'
// outputs, the experts' load and the slots a capacity drops are those of the MoE run on the
// other rows alone (a capacity that crowds experts 0 and 1, so a left-out row taking a slot
// would drop another); a left-out row's output is its shared expert's alone. Seen failing
// with the left-out rows counted in the capacity.
TEST(DeepSeek, RowsLeftOutOfRoutingAreRoutedAsIfAbsent) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  c.capacity_factor = 0.75;
  at::manual_seed(7);
  hp::models::MoE moe(c);
  moe->to(at::kDouble);
  {
    at::NoGradGuard g;
    moe->bias.copy_(at::tensor({0.6, 0.5, 0., 0., 0., 0., 0., 0.}, at::kDouble));
  }
  const int64_t N = 12;
  const at::Tensor x = at::randn({N, c.dim}, at::kDouble);
  at::Tensor routed = at::ones({N}, at::kBool);
  routed[3] = false;
  routed[11] = false;
  moe->routed_rows = routed;
  const at::Tensor got = moe->forward(x).detach();
  const at::Tensor load = moe->load.clone(), dropped = moe->dropped.clone();
  {
    at::NoGradGuard g;
    moe->load.zero_();
    moe->dropped.zero_();
  }
  moe->routed_rows = at::Tensor();
  const at::Tensor rows = routed.nonzero().squeeze(1);
  const at::Tensor want = moe->forward(x.index_select(0, rows)).detach();
  // float64: the two runs multiply different row counts (12 against 10) through the same
  // weights, so their sums may round apart by a few ulps of outputs of order 1 (~1e-15);
  // 1e-12 leaves that margin and is far below a misrouted row's error (order 0.1).
  EXPECT_LE((got.index_select(0, rows) - want).abs().max().item<double>(), 1e-12);
  EXPECT_TRUE(at::equal(load, moe->load)) << load << moe->load;
  EXPECT_GT(moe->dropped.item<double>(), 0) << "nothing overflowed: the test does not exercise the limit";
  EXPECT_EQ(dropped.item<double>(), moe->dropped.item<double>());
  for (int64_t t : {3, 11}) {  // the same float64 margin: the shared expert on 12 rows or 1
    EXPECT_LE((got[t] - moe->shared->forward(x[t].unsqueeze(0))[0].detach()).abs().max().item<double>(), 1e-12)
        << "row " << t;
  }
  moe->routed_rows = at::ones({N + 1}, at::kBool);
  hp::test::expect_error([&] { moe->forward(x); }, {"routed_rows", "13", "12 tokens"});
}

// A factor past experts / experts_per_token keeps every slot: at experts (the largest the
// config takes) and far past it (3e17, which overflowed the capacity and dropped every slot),
// nothing is dropped and the output is the run without a limit. Above experts the config
// refuses the factor, naming it.
TEST(DeepSeek, HugeCapacityFactorsKeepEverySlot) {
  DeepSeekConfig c = DeepSeekConfig::tiny();
  at::manual_seed(6);
  hp::models::MoE moe(c);
  moe->to(at::kDouble);
  const at::Tensor x = at::randn({2, 5, c.dim}, at::kDouble);
  const at::Tensor plain = moe->forward(x);
  for (double f : {static_cast<double>(c.experts), 3e17, 1e300}) {
    moe->c.capacity_factor = f;
    const at::Tensor flat = x.reshape({-1, c.dim});
    const at::Tensor scores = moe->gate->forward(flat).sigmoid();
    auto [chosen, w] = moe->route_scores(scores);
    EXPECT_TRUE(moe->capacity_keep(scores.gather(-1, chosen), chosen).all().item<bool>()) << f;
    EXPECT_TRUE(at::equal(moe->forward(x), plain)) << f;
  }
  c.capacity_factor = static_cast<double>(c.experts);
  EXPECT_NO_THROW(c.validate());
  c.capacity_factor = 3e17;
  hp::test::expect_error([&] { c.validate(); }, {"capacity_factor=3e+17", "above experts=8"});
}

// The published DeepSeek-V3 config.json (its values as released): its FP8 quantization and
// its yarn rotary scaling are read; it is the deepseek_v3 preset with that scaling. A config written by hf_config reads back as the model that wrote it.
TEST(DeepSeek, HuggingFaceConfigOfThePublishedModel) {
  const std::string published = R"({
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": false,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280})";
  // Its FP8 weights are read (hp/ckpt/float8.h); another quantization is refused by name.
  std::string other_quantization = published;
  other_quantization.replace(other_quantization.find("\"fp8\""), 5, "\"bitsandbytes\"");
  hp::test::expect_error([&] { hp::models::deepseek_config_from_hf(other_quantization, "v3/config.json"); },
                         {"'v3/config.json': quantization_config quant_method \"bitsandbytes\"", "not supported yet"});
  // Its yarn scaling read as published: factor 40 over 4096 positions, betas 32 and 1,
  // mscale and mscale_all_dim 1 (the attention scale times (0.1 ln 40 + 1)^2).
  const std::string text = published;
  const DeepSeekConfig got = hp::models::deepseek_config_from_hf(text, "v3/config.json");
  DeepSeekConfig want = DeepSeekConfig::deepseek_v3();
  want.max_seq = 163840;
  want.rope_scaling = hp::models::RopeScaling::kYarn;
  want.rope_factor = 40;
  want.rope_original_max_seq = 4096;
  want.rope_beta_fast = 32;
  want.rope_beta_slow = 1;
  want.rope_mscale = want.rope_mscale_all_dim = 1;
  EXPECT_EQ(got.mtp_layers, 0) << "num_nextn_predict_layers is not read: transformers writes 1 without the module";
  want.mtp_layers = 1;
  EXPECT_NO_THROW(hp::models::check_hf_config(want, published, "v3/config.json"));
  want.mtp_layers = 0;
  EXPECT_DOUBLE_EQ(got.attention_scale_factor(), (0.1 * std::log(40.0) + 1) * (0.1 * std::log(40.0) + 1));
  // A yarn factor that cannot be is refused by name.
  std::string bad_factor = published;
  const std::string factor = "\"factor\": 40";
  bad_factor.replace(bad_factor.find(factor), factor.size(), "\"factor\": -2");
  hp::test::expect_error([&] { hp::models::deepseek_config_from_hf(bad_factor, "v3/config.json"); },
                         {"rope_scaling factor -2 must be a finite number > 0"});
  EXPECT_EQ(hp::models::hf_config(got, at::kBFloat16), hp::models::hf_config(want, at::kBFloat16));
  EXPECT_EQ(got.num_params(), want.num_params());
  // What the model cannot be is refused by name.
  for (const auto& [key, bad] : std::vector<std::pair<std::string, std::string>>{
           {"scoring_func", "\"softmax\""}, {"topk_method", "\"greedy\""}, {"norm_topk_prob", "false"},
           {"hidden_act", "\"gelu\""}, {"rope_interleave", "false"}, {"q_lora_rank", "null"}, {"vocab_size", "\"x\""}}) {
    std::string t = text;
    const size_t at = t.find("\"" + key + "\"");
    if (at == std::string::npos) {
      t.insert(1, "\"" + key + "\": " + bad + ",");
    } else {  // the file's value replaced (JSON keeps a repeated key's last value)
      t.replace(at, t.find_first_of(",}", at) - at, "\"" + key + "\": " + bad);
    }
    hp::test::expect_error([&] { hp::models::deepseek_config_from_hf(t, "c.json"); }, {key});
  }
  DeepSeekConfig tiny = DeepSeekConfig::tiny();
  tiny.expert_groups = 4;
  tiny.groups_per_token = 2;
  tiny.routed_scale = 1.5;
  const DeepSeekConfig back = hp::models::deepseek_config_from_hf(hp::models::hf_config(tiny, at::kFloat), "t.json");
  EXPECT_NO_THROW(hp::models::check_hf_config(tiny, hp::models::hf_config(tiny, at::kFloat), "t.json"));
  EXPECT_EQ(back.num_params(), tiny.num_params());
  // num_nextn_predict_layers: written; a model may have fewer MTP modules than its folder
  // says (their tensors, where it holds them, are then refused unless
  // init_from_hf_drop_mtp), not more.
  DeepSeekConfig mtp = tiny;
  mtp.mtp_layers = 1;
  EXPECT_NE(hp::models::hf_config(mtp, at::kFloat).find("\"num_nextn_predict_layers\": 1"), std::string::npos);
  EXPECT_NO_THROW(hp::models::check_hf_config(mtp, hp::models::hf_config(mtp, at::kFloat), "t.json"));
  EXPECT_NO_THROW(hp::models::check_hf_config(tiny, hp::models::hf_config(mtp, at::kFloat), "t.json"));
  hp::test::expect_error([&] { hp::models::check_hf_config(mtp, hp::models::hf_config(tiny, at::kFloat), "t.json"); },
                         {"num_nextn_predict_layers=0", "model.mtp_layers=1", "t.json"});
  DeepSeekConfig other = tiny;
  other.groups_per_token = 1;
  hp::test::expect_error([&] { hp::models::check_hf_config(other, hp::models::hf_config(tiny, at::kFloat), "t.json"); },
                         {"model.groups_per_token=1 but topk_group=2", "t.json"});
}
