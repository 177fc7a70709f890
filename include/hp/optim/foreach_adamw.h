// ForeachAdamW: libtorch's AdamW, stepped with multi-tensor (_foreach_) kernels.
//
// torch::optim::AdamW updates one parameter at a time: about ten kernels per parameter,
// which for a model of many small layers makes the optimizer step launch-bound on a GPU.
// ForeachAdamW keeps AdamW's options, state (exp_avg, exp_avg_sq, step per parameter) and
// serialization, so it is a drop-in replacement, and applies the same operations in the
// same order to all parameters of a group at once. On the CPU, where foreach ops loop
// over the same per-tensor kernels, it is bitwise identical to torch::optim::AdamW.
// amsgrad falls back to torch::optim::AdamW's own step.
#pragma once

#include <torch/optim/adamw.h>

#include <vector>

namespace hp::optim {

class ForeachAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace hp::optim
