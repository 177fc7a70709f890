// The Llama-style model under fully_shard (every block, then the root) trains like the
// same model in one process on the global batch, with AdamW. In float64: at this init many
// gradient entries are tiny, and in float32 AdamW's normalization turns their last-bit
// differences (summation order) into update-sized ones (measured 6e-5 relative after 5
// steps); in float64 that noise stays far below AdamW's eps, so the two runs agree within
// 1e-10, while a wrong reduction moves parameters by O(lr).
#include <gtest/gtest.h>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "hp/fsdp/fully_shard.h"
#include "hp/models/llama.h"
#include "hp/runtime.h"
#include "fsdp/fsdp_test_util.h"

TEST(LlamaFsdp, MatchesSingleProcessTraining) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  hp::models::LlamaConfig c = hp::models::LlamaConfig::tiny();
  c.dim = 48;  // rows not divisible by 4 ranks: padding exercised
  c.vocab = 101;
  hp::models::Llama ref(c), m(c);
  ref->init_weights(7);
  m->init_weights(7);
  ref->to(at::kDouble);
  m->to(at::kDouble);
  hp::FullyShardOptions o;
  o.comm_fusion = true;
  auto [hs, params] = hp::test::shard_blocks_then_root(m, o);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  const int64_t B = 4, T = 9, local = B / n;
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step);
    at::Tensor all = at::randint(c.vocab, {B, T + 1}, at::kLong);
    at::Tensor x = all.narrow(1, 0, T), y = all.narrow(1, 1, T);
    ref_opt.zero_grad();
    ref->loss(x, y).backward();
    ref_opt.step();
    opt.zero_grad();
    at::Tensor logits = hp::call(m, x.narrow(0, r * local, local));
    torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocab}), y.narrow(0, r * local, local).reshape({-1}))
        .backward();
    opt.step();
  }
  double worst = hp::test::max_rel_to_reference(hs, hp::test::reference_in_handle_order(ref, "layers_"), w);
  EXPECT_LE(worst, 1e-10);
}
