#include "hp/fsdp/master_weights.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "hp/core/error.h"

namespace hp {

FP32MasterOptimizer::FP32MasterOptimizer(const std::vector<FSDPHandle>& handles, const Factory& make)
    : handles_(handles) {
  at::NoGradGuard no_grad;
  for (const auto& h : handles_) {
    HP_CHECK(h != nullptr, "FP32MasterOptimizer: a handle is null");
    HP_CHECK(h->dtypes().main_grad, "FP32MasterOptimizer: module ", h->module().name(),
             " was sharded without apply_grad_on_fp32_main_grad; its gradients have no fp32 main copy");
    auto params = h->parameters();
    auto grads = h->main_grads();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) continue;
      sharded_.push_back(params[i]);
      main_grads_.push_back(grads[i]);
      masters_.push_back(params[i].detach().to(at::kFloat, false, /*copy=*/true).set_requires_grad(true));
    }
  }
  inner_ = make(masters_);
  HP_CHECK(inner_ != nullptr, "FP32MasterOptimizer: the factory returned no optimizer");
}

void FP32MasterOptimizer::step() {
  at::NoGradGuard no_grad;
  // A parameter whose shard got no gradient since zero_grad (no rank produced one) is
  // skipped by the optimizer, as in one process: its master gets no gradient either.
  for (size_t i = 0; i < masters_.size(); ++i) {
    masters_[i].mutable_grad() = sharded_[i].grad().defined() ? main_grads_[i] : at::Tensor();
  }
  inner_->step();
  for (size_t i = 0; i < masters_.size(); ++i) sharded_[i].copy_(masters_[i]);
}

void FP32MasterOptimizer::zero_grad() {
  for (size_t i = 0; i < masters_.size(); ++i) {
    masters_[i].mutable_grad() = at::Tensor();
    main_grads_[i].zero_();
    sharded_[i].mutable_grad() = at::Tensor();
  }
}

}  // namespace hp
