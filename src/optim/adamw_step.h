// The arithmetic of ForeachAdamW for one parameter group, shared by ForeachAdamW and by
// Muon's AdamW groups.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "hp/core/error.h"
#include "hp/optim/foreach_adamw.h"

namespace hp::optim::detail {

// Steps `group` (AdamWOptions, not amsgrad) with `state`, the optimizer's state map.
template <typename StateMap>
void foreach_adamw_group(torch::optim::OptimizerParamGroup& group, StateMap& state) {
  auto& o = static_cast<torch::optim::AdamWOptions&>(group.options());
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  // Parameters are bucketed by their step count (a parameter without a gradient in some
  // step has taken fewer steps): each bucket shares its bias corrections.
  struct Bucket {
    std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq;
  };
  std::map<int64_t, Bucket> buckets;
  for (auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    HP_CHECK(!p.grad().is_sparse(), "AdamW: sparse gradients are not supported yet");
    const auto key = state_key(state, p);
    auto it = state.find(key);
    if (it == state.end()) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(0);
      s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      it = state.emplace(key, std::move(s)).first;
    }
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    s.step(s.step() + 1);
    Bucket& b = buckets[s.step()];
    b.params.push_back(p);
    b.grads.push_back(p.grad());
    b.exp_avg.push_back(s.exp_avg());
    b.exp_avg_sq.push_back(s.exp_avg_sq());
  }
  for (auto& [step, b] : buckets) {
    if (o.weight_decay() != 0) at::_foreach_mul_(b.params, 1 - o.lr() * o.weight_decay());
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    at::_foreach_mul_(b.exp_avg, beta1);
    at::_foreach_add_(b.exp_avg, b.grads, 1 - beta1);
    at::_foreach_mul_(b.exp_avg_sq, beta2);
    at::_foreach_addcmul_(b.exp_avg_sq, b.grads, b.grads, 1 - beta2);
    std::vector<at::Tensor> denom = at::_foreach_sqrt(b.exp_avg_sq);
    at::_foreach_div_(denom, std::sqrt(bias_correction2));
    at::_foreach_add_(denom, o.eps());
    at::_foreach_addcdiv_(b.params, b.exp_avg, denom, -o.lr() / bias_correction1);
  }
}

}  // namespace hp::optim::detail
