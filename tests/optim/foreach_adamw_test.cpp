// ForeachAdamW against libtorch's AdamW: bitwise the same parameters and state on the CPU,
// over steps where some parameters get no gradient, with two groups (with and without
// weight decay) and a learning rate changed between steps.
#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include "hp/optim/foreach_adamw.h"

namespace {

std::vector<torch::optim::OptimizerParamGroup> groups(const std::vector<at::Tensor>& p) {
  std::vector<torch::optim::OptimizerParamGroup> g;
  g.emplace_back(std::vector<at::Tensor>{p[0], p[1]},
                 std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
  g.emplace_back(std::vector<at::Tensor>{p[2]},
                 std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).weight_decay(0)));
  return g;
}

}  // namespace

TEST(ForeachAdamW, BitwiseTheSameAsTorchAdamW) {
  torch::manual_seed(0);
  std::vector<at::Tensor> a = {at::randn({7, 5}), at::randn({3}), at::randn({4, 2, 3})};
  std::vector<at::Tensor> b;
  for (auto& t : a) {
    t.set_requires_grad(true);
    b.push_back(t.detach().clone().set_requires_grad(true));
  }
  torch::optim::AdamW ref(groups(a), torch::optim::AdamWOptions(1e-2));
  hp::optim::ForeachAdamW mine(groups(b), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      // Parameter 1 gets no gradient on steps 2 and 3: its step count falls behind.
      if (i == 1 && (step == 2 || step == 3)) {
        a[i].mutable_grad() = at::Tensor();
        b[i].mutable_grad() = at::Tensor();
        continue;
      }
      at::Tensor g = at::randn(a[i].sizes()) * (step + 1);
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    for (auto* opt : {static_cast<torch::optim::Optimizer*>(&ref), static_cast<torch::optim::Optimizer*>(&mine)}) {
      for (auto& grp : opt->param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(grp.options()).lr(1e-2 / (step + 1));
      }
      opt->step();
    }
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i << " after step " << step;
    }
  }
  // The state is the same too (so a checkpoint of one loads into the other).
  for (size_t i = 0; i < a.size(); ++i) {
    // Keys as libtorch's own AdamW makes them (both optimizers' maps use that format).
    auto& sa = static_cast<torch::optim::AdamWParamState&>(*ref.state().at(hp::optim::state_key(ref.state(), a[i])));
    auto& sb = static_cast<torch::optim::AdamWParamState&>(*mine.state().at(hp::optim::state_key(mine.state(), b[i])));
    EXPECT_EQ(sa.step(), sb.step());
    EXPECT_TRUE(at::equal(sa.exp_avg(), sb.exp_avg()));
    EXPECT_TRUE(at::equal(sa.exp_avg_sq(), sb.exp_avg_sq()));
  }
}
