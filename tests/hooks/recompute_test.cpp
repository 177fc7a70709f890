// hp::recompute against the same module run without it: gradients, the recomputation's
// flag, and the memory it saves (counted by the library's allocator).
#include <gtest/gtest.h>

#include <torch/csrc/autograd/custom_function.h>
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

namespace {

// A Linear that counts its forwards (still a Linear to the recomputation's keeper).
struct CountingLinearImpl : torch::nn::LinearImpl {
  CountingLinearImpl(int64_t in, int64_t out) : torch::nn::LinearImpl(in, out) {}
  at::Tensor forward(const at::Tensor& x) {
    ++calls;
    return torch::nn::LinearImpl::forward(x);
  }
  int calls = 0;
};
TORCH_MODULE(CountingLinear);

// exp(u) rebuilt from its kept result: its backward is grad * exp(u), as autograd's.
struct KeptExp : torch::autograd::Function<KeptExp> {
  struct Kept {
    at::Tensor y;
  };
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& u, Kept kept) {
    ctx->save_for_backward({kept.y});
    return kept.y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0] * ctx->get_saved_variables()[0], at::Tensor()};
  }
};

// Three Linear calls, the middle one marked hp::recomputed_here, and a step standing for
// attention (exp) written as hp::keep_step.
struct StepModelImpl : torch::nn::Module {
  StepModelImpl() {
    for (int i = 0; i < 3; ++i) fc.push_back(register_module("fc" + std::to_string(i), CountingLinear(32, 32)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::nn::functional::gelu(hp::call(fc[0], x));
    at::Tensor u = hp::recomputed_here([&] { return hp::call(fc[1], h); });
    at::Tensor s = hp::keep_step(
        [&] {
          ++runs;
          return std::vector<at::Tensor>{(u * 0.1).exp()};
        },
        [&](const std::vector<at::Tensor>& kept) {
          ++replays;
          return KeptExp::apply(u * 0.1, KeptExp::Kept{kept[0]});
        });
    return hp::call(fc[2], s);
  }
  std::vector<CountingLinear> fc;
  int runs = 0, replays = 0;
};
TORCH_MODULE(StepModel);

}  // namespace

// Light recompute: the marked Linear runs again in backward, the others and the kept step do
// not (their results are kept), and the gradients are bitwise those without recompute.
TEST(Recompute, LightKeepsTheStepsAndRecomputesTheMarkedMatmuls) {
  hp::memory::install_counting_allocator();
  torch::manual_seed(5);
  StepModel m;
  m->to(at::kDouble);
  const at::Tensor x0 = at::randn({64, 32}, at::kDouble);
  auto grads = [&](const c10::optional<hp::RecomputePolicy>& policy, int64_t* held) {
    for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor x = x0.clone().requires_grad_(true);
    const int64_t before = hp::memory::current_bytes();
    at::Tensor y = policy ? hp::recompute_with(*policy, m, x) : hp::call(m, x);
    if (held != nullptr) *held = hp::memory::current_bytes() - before;
    y.pow(2).sum().backward();
    std::vector<at::Tensor> g = {x.grad().clone()};
    for (auto& p : m->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = grads(c10::nullopt, nullptr);
  for (auto& f : m->fc) f->calls = 0;
  m->runs = m->replays = 0;
  int64_t held = 0;
  const auto light = grads(hp::RecomputePolicy::kLight, &held);
  EXPECT_EQ(m->fc[0]->calls, 1) << "kept";
  EXPECT_EQ(m->fc[1]->calls, 2) << "marked: recomputed";
  EXPECT_EQ(m->fc[2]->calls, 1) << "kept";
  EXPECT_EQ(m->runs, 1);
  EXPECT_EQ(m->replays, 1);
  ASSERT_EQ(plain.size(), light.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(at::equal(plain[i], light[i])) << i;
  // Held from forward to backward, beyond the input: fc0's output, the step's and fc2's (the
  // call's output), 64 x 32 doubles each; not fc1's or gelu's.
  EXPECT_EQ(held, 3 * 64 * 32 * 8);
  // Outside a light recompute the marks change nothing: selective recomputes the step and
  // keeps fc1's output.
  for (auto& f : m->fc) f->calls = 0;
  m->runs = m->replays = 0;
  const auto sel = grads(hp::RecomputePolicy::kKeepMatmuls, nullptr);
  EXPECT_EQ(m->fc[1]->calls, 1);
  EXPECT_EQ(m->runs, 2);
  EXPECT_EQ(m->replays, 0);
}
