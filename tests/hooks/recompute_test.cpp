// hp::recompute against the same module run without it: gradients, the recomputation's
// flag, and the memory it saves (counted by the library's allocator).
#include <gtest/gtest.h>

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>

#include "hp/core/memory.h"
#include "hp/hooks/call.h"
#include "hp/hooks/recompute.h"

namespace {

// Two inputs, four Linear children, activations several times the size of the weights.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    for (int i = 0; i < 4; ++i) fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(32, 32)));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& gate) {
    if (hp::in_recompute()) ++recomputes;
    ++forwards;
    if (hp::in_differentiated_forward()) ++differentiated;
    at::Tensor h = x;
    for (auto& l : fc) h = torch::nn::functional::gelu(hp::call(l, h)) * gate + h;
    return h;
  }
  std::vector<torch::nn::Linear> fc;
  int forwards = 0, recomputes = 0;
  int differentiated = 0;  // forwards in_differentiated_forward() said true in
};
TORCH_MODULE(Mlp);

struct Grads {
  std::vector<at::Tensor> params;
  at::Tensor x, gate;
  int64_t peak_after_forward = 0;  // bytes held from forward to backward, above the inputs
};

Grads run(const c10::optional<hp::RecomputePolicy>& policy, Mlp& m, const at::Tensor& x0, const at::Tensor& g0) {
  for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
  at::Tensor x = x0.clone().requires_grad_(true), gate = g0.clone().requires_grad_(true);
  const int64_t before = hp::memory::current_bytes();
  at::Tensor y = policy ? hp::recompute_with(*policy, m, x, gate) : hp::call(m, x, gate);
  Grads out;
  out.peak_after_forward = hp::memory::current_bytes() - before;
  y.pow(2).sum().backward();
  for (auto& p : m->parameters()) out.params.push_back(p.grad().clone());
  out.x = x.grad().clone();
  out.gate = gate.grad().clone();
  return out;
}

}  // namespace

TEST(Recompute, FullRecomputeGivesBitwiseGradientsAndHoldsLess) {
  hp::memory::install_counting_allocator();
  torch::manual_seed(1);
  Mlp m;
  at::Tensor x = at::randn({64, 32}), gate = at::rand({64, 32});
  Grads plain = run(c10::nullopt, m, x, gate);
  EXPECT_EQ(m->recomputes, 0);
  Grads ckpt = run(hp::RecomputePolicy::kFull, m, x, gate);
  EXPECT_EQ(m->forwards, 3) << "one forward without recomputation, two with";
  EXPECT_EQ(m->recomputes, 1);
  EXPECT_FALSE(hp::in_recompute());
  // Every one of them is differentiated: the first forward under recompute runs without
  // grad mode, yet its backward recomputes it.
  EXPECT_EQ(m->differentiated, 3);
  for (size_t i = 0; i < plain.params.size(); ++i) EXPECT_TRUE(at::equal(plain.params[i], ckpt.params[i])) << i;
  EXPECT_TRUE(at::equal(plain.x, ckpt.x));
  EXPECT_TRUE(at::equal(plain.gate, ckpt.gate));
  // Kept from forward to backward: the plain run keeps every block's activations (several
  // [64, 32] tensors per Linear); the recomputed one only its output and its inputs.
  const int64_t act = 64 * 32 * 4;
  EXPECT_GE(plain.peak_after_forward, 8 * act);
  EXPECT_LE(ckpt.peak_after_forward, 2 * act);
}

TEST(Recompute, KeepMatmulsRecomputesTheRestOnly) {
  hp::memory::install_counting_allocator();
  torch::manual_seed(2);
  Mlp m;
  at::Tensor x = at::randn({64, 32}, at::kDouble), gate = at::rand({64, 32}, at::kDouble);
  m->to(at::kDouble);
  Grads plain = run(c10::nullopt, m, x, gate);
  Grads sel = run(hp::RecomputePolicy::kKeepMatmuls, m, x, gate);
  EXPECT_EQ(m->recomputes, 1);
  // The kept matmuls' backward is written out as two mm's of the flattened rows: float64,
  // summation order only.
  for (size_t i = 0; i < plain.params.size(); ++i) {
    EXPECT_TRUE(at::allclose(plain.params[i], sel.params[i], 1e-12, 1e-12)) << i;
  }
  EXPECT_TRUE(at::allclose(plain.x, sel.x, 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(plain.gate, sel.gate, 1e-12, 1e-12));
  // It keeps the four Linear outputs, not the rest.
  const int64_t act = 64 * 32 * 8;
  EXPECT_GE(sel.peak_after_forward, 4 * act);
  EXPECT_LT(sel.peak_after_forward, plain.peak_after_forward);
}

TEST(Recompute, WithoutGradModeItIsAPlainCall) {
  torch::manual_seed(3);
  Mlp m;
  at::Tensor x = at::randn({4, 32}), gate = at::rand({4, 32});
  at::NoGradGuard ng;
  at::Tensor y = hp::recompute(m, x, gate);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(at::equal(y, hp::call(m, x, gate)));
  EXPECT_EQ(m->differentiated, 0) << "a forward without gradients is not differentiated";
}

// A gradient hook registered with hp::on_gradient runs once per backward under recompute,
// with the whole gradient, as without it. libtorch 2.x also runs a leaf's own hooks where
// the recomputation computes the parameters' gradients: a plain register_hook there would
// run twice (and a summing hook, tensor parallelism's, would sum twice).
TEST(Recompute, GradientHooksRunOncePerBackward) {
  torch::manual_seed(3);
  Mlp m;
  at::Tensor x = at::randn({16, 32}), gate = at::rand({16, 32});
  const at::Tensor& w = m->fc[1]->weight;
  std::vector<at::Tensor> seen;
  hp::on_gradient(w, [&seen](const at::Tensor& g) {
    seen.push_back(g.clone());
    return g * 3;  // what the hook returns is what accumulates
  });
  for (auto policy : {hp::RecomputePolicy::kFull, hp::RecomputePolicy::kKeepMatmuls}) {
    seen.clear();
    Grads plain = run(c10::nullopt, m, x, gate);
    ASSERT_EQ(seen.size(), 1u);
    const at::Tensor reference = seen[0];
    EXPECT_TRUE(plain.params[2].equal(reference * 3));  // fc1.weight, after fc0's weight and bias
    seen.clear();
    Grads ckpt = run(policy, m, x, gate);
    ASSERT_EQ(seen.size(), 1u) << "policy " << static_cast<int>(policy);
    EXPECT_TRUE(seen[0].equal(reference));
    EXPECT_TRUE(ckpt.params[2].equal(reference * 3));
  }
}
