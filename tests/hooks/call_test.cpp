// The call boundary against plain forward calls computed here.
#include <gtest/gtest.h>

#include <algorithm>

#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <string>
#include <vector>

#include "hp/hooks/call.h"
#include "test_util.h"

namespace {

// A user's module: its only change is calling children through hp::call.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})));
  }
  at::Tensor forward(const at::Tensor& x, double scale) {
    return hp::call(norm, hp::call(fc, x)) * scale;
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Block);

}  // namespace

TEST(Call, WithoutHooksIsAPlainForward) {
  Block b;
  at::Tensor x = at::randn({2, 4});
  at::Tensor want = b->norm->forward(b->fc->forward(x)) * 0.5;
  EXPECT_TRUE(at::allclose(hp::call(b, x, 0.5), want));
  EXPECT_FALSE(hp::has_forward_hooks(*b));
}

TEST(Call, HooksRunInOrderAroundForwardIncludingChildren) {
  Block b;
  std::vector<std::string> log;
  auto h1 = hp::register_forward_hooks(*b, {[&](torch::nn::Module&) { log.push_back("pre block"); },
                                            nullptr, nullptr,
                                            [&](torch::nn::Module&) { log.push_back("post block"); }});
  auto h2 = hp::register_forward_hooks(*b->fc, {[&](torch::nn::Module& m) {
                                                  EXPECT_TRUE(hp::in_call(m));
                                                  log.push_back("pre fc");
                                                },
                                                nullptr, nullptr,
                                                [&](torch::nn::Module&) { log.push_back("post fc"); }});
  hp::call(b, at::randn({2, 4}), 1.0);
  EXPECT_EQ(log, (std::vector<std::string>{"pre block", "pre fc", "post fc", "post block"}));
  EXPECT_FALSE(hp::in_call(*b));
  hp::remove_forward_hooks(h1);
  hp::remove_forward_hooks(h2);
  EXPECT_FALSE(hp::has_forward_hooks(*b));
}

TEST(Call, CastsInputsAndOutputs) {
  torch::nn::Linear fc(3, 2);
  fc->to(at::kDouble);
  hp::register_forward_hooks(*fc, {nullptr,
                                   [](torch::nn::Module&, const at::Tensor& t, size_t) { return t.to(at::kDouble); },
                                   [](torch::nn::Module&, const at::Tensor& t) { return t.to(at::kFloat); },
                                   nullptr});
  at::Tensor x = at::randn({5, 3});  // float input, double module
  at::Tensor y = hp::call(fc, x);
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::allclose(y, fc->forward(x.to(at::kDouble)).to(at::kFloat)));
}

// Each tensor argument is cast with its own position; other arguments are passed through.
struct ThreeArgsImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& a, double scale, const at::Tensor& b) { return a * scale + b; }
};
TORCH_MODULE(ThreeArgs);

TEST(Call, InputCastsSeeArgumentPositions) {
  ThreeArgs m;
  std::vector<size_t> seen;
  hp::ForwardHooks h;
  h.cast_input = [&](torch::nn::Module&, const at::Tensor& t, size_t arg) {
    seen.push_back(arg);
    return arg == 2 ? t * 10 : t;  // only the third argument
  };
  hp::register_forward_hooks(*m, h);
  at::Tensor y = hp::call(m, at::ones({2}), 2.0, at::ones({2}));
  std::sort(seen.begin(), seen.end());  // the order arguments are evaluated in is unspecified
  EXPECT_EQ(seen, (std::vector<size_t>{0, 2}));
  EXPECT_TRUE(at::equal(y, at::full({2}, 12.0)));
}

TEST(Call, OnErrorMayReplaceTheException) {
  torch::nn::Linear fc(3, 2);
  hp::ForwardHooks h;
  h.on_error = [](torch::nn::Module& m, const std::exception& e) {
    throw hp::Error(std::string("while running ") + m.name() + ": " + e.what());
  };
  hp::register_forward_hooks(*fc, h);
  hp::test::expect_error([&] { hp::call(fc, at::randn({5, 7})); }, {"while running", "Linear"});
}

TEST(Call, ExceptionInForwardLeavesNoStaleMarker) {
  torch::nn::Linear fc(3, 2);
  EXPECT_ANY_THROW(hp::call(fc, at::randn({5, 7})));  // wrong width
  EXPECT_FALSE(hp::in_call(*fc));
}
