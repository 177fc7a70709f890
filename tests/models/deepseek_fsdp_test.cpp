// The DeepSeek-V3-style model under fully_shard trains like one process on the global
// batch, balancing bias included. Each rank routes its own tokens, so an expert may get
// tokens on one rank and none on another (a zero gradient there).
// float64 and AdamW: the runs differ only by summation order, far below AdamW's eps at this
// precision, so they agree within 1e-10 (a wrong reduction moves parameters by O(lr)).
#include <gtest/gtest.h>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "hp/fsdp/fully_shard.h"
#include "hp/models/deepseek.h"
#include "hp/runtime.h"
#include "fsdp/fsdp_test_util.h"

TEST(DeepSeekFsdp, MatchesSingleProcessTrainingWithBalancingBias) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  hp::models::DeepSeekConfig c = hp::models::DeepSeekConfig::tiny();
  c.bias_update_rate = 0.05;
  hp::models::DeepSeek ref(c), m(c);
  ref->init_weights(5);
  m->init_weights(5);
  ref->to(at::kDouble);
  m->to(at::kDouble);
  auto [hs, params] = hp::test::shard_blocks_then_root(m);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  auto ce = [&](const at::Tensor& logits, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocab}), y.reshape({-1}));
  };
  // Even ranks see varied tokens (every expert busy); odd ranks one repeated token, whose
  // hidden states are all alike, so most experts get no tokens there.
  const int64_t B = 2 * n, T = 16, local = B / n;
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(300 + step);
    at::Tensor all = at::randint(c.vocab, {B, T + 1}, at::kLong);
    for (int q = 1; q < n; q += 2) all.narrow(0, q * local, local).fill_(7 + step);
    at::Tensor x = all.narrow(1, 0, T), y = all.narrow(1, 1, T);
    ref_opt.zero_grad();
    ce(ref->forward(x), y).backward();
    ref_opt.step();
    ref->update_balancing_bias();
    opt.zero_grad();
    ce(hp::call(m, x.narrow(0, r * local, local)), y.narrow(0, r * local, local)).backward();
    opt.step();
    m->update_balancing_bias(w);
  }
  for (size_t i = 1; i < m->blocks.size(); ++i) {
    EXPECT_TRUE(at::equal(m->blocks[i]->moe->bias, ref->blocks[i]->moe->bias)) << "block " << i;
  }
  double worst = hp::test::max_rel_to_reference(hs, hp::test::reference_in_handle_order(ref, "layers_"), w);
  EXPECT_LE(worst, 1e-10);
}
