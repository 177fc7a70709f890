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

#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace hp::optim {

// The key of parameter `p` in a libtorch optimizer's state map (`optimizer.state()`): the
// printed address of its TensorImpl in libtorch 1.x, the address itself in 2.x.
template <typename StateMap>
typename StateMap::key_type state_key(const StateMap&, const at::Tensor& p) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;  // as libtorch 1.x prints it (c10::guts::to_string)
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

class ForeachAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace hp::optim
