#include "hp/optim/foreach_adamw.h"

#include <ATen/ATen.h>

#include "adamw_step.h"

namespace hp::optim {

torch::Tensor ForeachAdamW::step(LossClosure closure) {
  // amsgrad anywhere: libtorch's own step for every group (checked before anything runs).
  for (auto& group : param_groups_) {
    if (static_cast<torch::optim::AdamWOptions&>(group.options()).amsgrad()) return torch::optim::AdamW::step(closure);
  }
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) detail::foreach_adamw_group(group, state_);
  return loss;
}

}  // namespace hp::optim
