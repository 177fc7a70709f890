// The step's arithmetic: learning rate schedule, global gradient norm, clipping, AdamW.
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>

#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/optim/foreach_adamw.h"
#include "trainer_impl.h"

namespace hp::train {

double lr_at(const TrainConfig& c, int64_t step) {
  if (step < c.lr_warmup_steps) return c.lr * static_cast<double>(step + 1) / c.lr_warmup_steps;
  const int64_t decay_steps = std::max<int64_t>(1, c.train_steps - c.lr_warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - c.lr_warmup_steps + 1) / decay_steps);
  switch (c.lr_decay_style) {
    case LrDecay::kConstant:
      return c.lr;
    case LrDecay::kLinear:
      return c.lr - (c.lr - c.min_lr) * progress;
    case LrDecay::kCosine:
      break;
  }
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

bool eval_due(const TrainConfig& c, int64_t step) {
  return c.eval_interval > 0 && (step % c.eval_interval == 0 || step == c.train_steps);
}

double global_grad_norm(const std::vector<at::Tensor>& grads, const CommPtr& shards) {
  return global_grad_norm(grads, std::vector<bool>(grads.size(), false), shards, nullptr);
}

double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& split, const CommPtr& shards,
                        const CommPtr& tp) {
  return global_grad_norm(grads, split, shards, tp, nullptr);
}

double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& split, const CommPtr& shards,
                        const CommPtr& tp, const CommPtr& pp) {
  HP_CHECK(split.size() == grads.size(), "global_grad_norm: ", grads.size(), " gradients but ", split.size(),
           " split flags");
  // Summed where the gradients are, then moved to where the groups carry control values.
  c10::Device where = c10::kCPU;
  for (const at::Tensor& g : grads) {
    if (g.defined()) where = g.device();
  }
  at::Tensor sums = at::zeros({2}, at::TensorOptions().dtype(at::kDouble).device(where));  // [whole, tp pieces]
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (g.defined() && g.numel() > 0) sums[split[i] ? 1 : 0] += g.to(at::kDouble).square().sum();
  }
  for (const CommPtr& group : {shards, tp, pp}) {
    if (group && group->size() > 1) sums = sums.to(control_device(group));
  }
  if (shards && shards->size() > 1) shards->all_reduce(sums).wait();
  if (tp && tp->size() > 1) {
    at::Tensor pieces = sums.narrow(0, 1, 1).clone();
    tp->all_reduce(pieces).wait();
    sums[1] = pieces[0];
  }
  if (pp && pp->size() > 1) pp->all_reduce(sums).wait();
  return std::sqrt(sums.sum().item<double>());
}

double clip_grads_(const std::vector<at::Tensor>& grads, double max_norm, double norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  const double scale = max_norm / (norm + 1e-6);
  for (const at::Tensor& g : grads) {
    if (g.defined()) g.mul_(scale);
  }
  return scale;
}

namespace internal {

// AdamW (multi-tensor, same results as libtorch's) with weight decay on matrices
// (dim >= 2) and none on norm scales and vectors.
std::unique_ptr<torch::optim::Optimizer> make_adamw(const TrainConfig& c, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> decay, plain;
  for (const at::Tensor& p : params) {
    if (!p.requires_grad()) continue;
    (p.dim() >= 2 ? decay : plain).push_back(p);
  }
  auto opts = [&](double wd) {
    return torch::optim::AdamWOptions(c.lr).betas({c.adam_beta1, c.adam_beta2}).eps(c.adam_eps).weight_decay(wd);
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts(c.weight_decay)));
  if (!plain.empty()) groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(opts(0.0)));
  return std::make_unique<optim::ForeachAdamW>(std::move(groups), opts(c.weight_decay));
}

void check_finite(int64_t step, const char* what, double x) {
  if (!std::isfinite(x)) {
    throw TrainingDiverged(detail::str_cat("step ", step, ": the ", what, " is ", x,
                                           ": training diverged (try a lower lr, or clip_grad > 0)"));
  }
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

Validation open_validation(const TrainConfig& c, std::shared_ptr<const TokenDataset> given) {
  Validation v;
  if (c.eval_interval == 0) return v;
  v.data = given ? std::move(given) : make_validation_dataset(c);
  v.batches = validation_batches(c, *v.data);
  v.order = std::make_unique<DataSharder>(v.data->size(), c.global_batch_size, c.micro_batch_num, c.dp_size(), c.seed,
                                          /*shuffle=*/false);
  return v;
}

EvalStats eval_stats(const TrainConfig& c, const Validation& v, int64_t step, double loss, double seconds) {
  EvalStats ev;
  ev.step = step;
  ev.loss = loss;
  ev.perplexity = std::exp(loss);
  ev.tokens = v.batches * c.global_batch_size * c.seq_length;
  ev.seconds = seconds;
  return ev;
}

at::Tensor next_token_loss(TrainModel& m, const at::Tensor& batch, int64_t seq, bool hooked) {
  at::Tensor x = batch.narrow(1, 0, seq), y = batch.narrow(1, 1, seq);
  return m.loss_of_logits(m.forward(x, hooked), y);
}


}  // namespace internal

}  // namespace hp::train
