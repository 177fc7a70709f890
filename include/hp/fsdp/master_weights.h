// FP32MasterOptimizer: fp32 master copies of low-precision sharded parameters.
//
// With bf16 (or fp16) sharded parameters and apply_grad_on_fp32_main_grad, stepping the
// parameters themselves would round every update to bf16. This wrapper keeps an fp32
// master of each shard, steps an ordinary libtorch optimizer on the masters with the fp32
// main gradients, then writes the rounded masters back into the sharded parameters (as
// Megatron's distributed optimizer does). fp32 shards need no wrapper.
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

#include "hp/fsdp/fully_shard.h"

namespace hp {

class FP32MasterOptimizer {
 public:
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
  // `make` builds the inner optimizer over the fp32 masters. Every handle must use
  // apply_grad_on_fp32_main_grad.
  FP32MasterOptimizer(const std::vector<FSDPHandle>& handles, const Factory& make);

  // masters.grad = main gradients; inner step; sharded params = rounded masters.
  void step();
  // Clears the inner optimizer's gradients and the main gradients.
  void zero_grad();
  torch::optim::Optimizer& inner() { return *inner_; }
  const std::vector<at::Tensor>& masters() const { return masters_; }

 private:
  std::vector<FSDPHandle> handles_;
  std::vector<at::Tensor> sharded_, main_grads_, masters_;
  std::unique_ptr<torch::optim::Optimizer> inner_;
};

}  // namespace hp
