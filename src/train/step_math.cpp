// The step's arithmetic: learning rate schedule, global gradient norm, clipping, AdamW.
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/optim/foreach_adamw.h"
#include "hp/optim/muon.h"
#include "trainer_impl.h"

namespace hp::train {

namespace {

// The schedule's value at `step` for a peak and a floor.
double scheduled(const TrainConfig& c, int64_t step, double peak, double floor) {
  if (step < c.lr_warmup_steps) return peak * static_cast<double>(step + 1) / c.lr_warmup_steps;
  const int64_t decay_steps = std::max<int64_t>(1, c.train_steps - c.lr_warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - c.lr_warmup_steps + 1) / decay_steps);
  switch (c.lr_decay_style) {
    case LrDecay::kConstant:
      return peak;
    case LrDecay::kLinear:
      return peak - (peak - floor) * progress;
    case LrDecay::kCosine:
      break;
  }
  return floor + (peak - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace

double lr_at(const TrainConfig& c, int64_t step) { return scheduled(c, step, c.lr, c.min_lr); }

double muon_lr_at(const TrainConfig& c, int64_t step) {
  // lr's factor on Muon's peak; with lr 0 (no factor to take) the same shape down to 0.
  return c.lr > 0 ? c.muon_lr * (lr_at(c, step) / c.lr) : scheduled(c, step, c.muon_lr, 0.0);
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

std::string diverged_hint(const TrainConfig& c) {
  return c.clip_grad > 0 ? detail::str_cat("(try a lower lr than ", c.lr, "; clip_grad is ", c.clip_grad, ")")
                         : detail::str_cat("(try a lower lr than ", c.lr, ", or clip_grad > 0)");
}

namespace internal {

namespace {
// AdamW's options of the config (lr, betas, eps, weight_decay): one place for both optimizers.
torch::optim::AdamWOptions adamw_options(const TrainConfig& c) {
  return torch::optim::AdamWOptions(c.lr).betas({c.adam_beta1, c.adam_beta2}).eps(c.adam_eps).weight_decay(c.weight_decay);
}

}  // namespace

// AdamW (multi-tensor, same results as libtorch's) with weight decay on matrices
// (dim >= 2) and none on norm scales and vectors.
std::unique_ptr<torch::optim::Optimizer> make_adamw(const TrainConfig& c, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> decay, plain;
  for (const at::Tensor& p : params) {
    if (!p.requires_grad()) continue;
    (p.dim() >= 2 ? decay : plain).push_back(p);
  }
  auto opts = [&](double wd) { return adamw_options(c).weight_decay(wd); };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts(c.weight_decay)));
  if (!plain.empty()) groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(opts(0.0)));
  return std::make_unique<optim::ForeachAdamW>(std::move(groups), opts(c.weight_decay));
}

void check_finite(const TrainConfig& c, int64_t step, const char* what, double x) {
  if (!std::isfinite(x)) {
    throw TrainingDiverged(
        detail::str_cat("step ", step, ": the ", what, " is ", x, ": training diverged ", diverged_hint(c)));
  }
}

namespace {

optim::MuonOptions muon_options(const TrainConfig& c) {
  return optim::MuonOptions(c.muon_lr)
      .momentum(c.muon_momentum)
      .nesterov(c.muon_nesterov)
      .weight_decay(c.muon_weight_decay)
      .ns(optim::ns_steps(c.muon_ns_coefficients, c.muon_ns_steps))
      .ns_dtype(c.muon_ns_dtype)
      .scale(c.muon_update_scale)
      .rms_target(c.muon_update_rms);
}

optim::MuonRouting muon_routing(const TrainConfig& c) {
  optim::MuonRouting r;
  for (const std::string& t : c.model->token_tables()) {
    const bool taken = std::any_of(c.muon_to_muon.begin(), c.muon_to_muon.end(),
                                   [&](const std::string& p) { return optim::matches_pattern(t, p); });
    if (!taken) r.to_adamw.push_back(t);
  }
  r.to_adamw.insert(r.to_adamw.end(), c.muon_to_adamw.begin(), c.muon_to_adamw.end());
  r.to_muon = c.muon_to_muon;
  return r;
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c,
                                                        const std::vector<std::pair<std::string, at::Tensor>>& named,
                                                        const std::vector<ShardSpec>* boxes, const CommPtr& world) {
  if (c.optimizer == OptimizerKind::kAdamW) {
    std::vector<at::Tensor> params;
    for (const auto& [name, p] : named) params.push_back(p);
    return make_adamw(c, params);
  }
  auto opt = optim::make_muon(named, muon_options(c), adamw_options(c), muon_routing(c));
  if (boxes != nullptr) {
    HP_INTERNAL_ASSERT(boxes->size() == named.size(), "make_optimizer: ", boxes->size(), " boxes for ", named.size(),
                       " parameters");
    // Each rank's Muon parameters as pieces of the whole model's matrices, named by it.
    const std::vector<bool> muon = optim::route_to_muon(named, muon_routing(c));
    std::vector<optim::MatrixPiece> pieces;
    for (size_t i = 0; i < named.size(); ++i) {
      if (muon[i]) pieces.push_back({named[i].second, named[i].first, (*boxes)[i]});
    }
    opt->distribute(world, pieces, c.muon_scheme);
  }
  return opt;
}

void set_lr(torch::optim::Optimizer& opt, const TrainConfig& c, int64_t step) {
  // The schedule's lr for AdamW's groups; Muon's peak scaled by the same factor.
  const double lr = lr_at(c, step), muon_lr = muon_lr_at(c, step);
  for (auto& g : opt.param_groups()) {
    const bool muon = dynamic_cast<optim::MuonOptions*>(&g.options()) != nullptr;
    g.options().set_lr(muon ? muon_lr : lr);
  }
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

std::pair<at::Tensor, at::Tensor> inputs_and_targets(const at::Tensor& batch, int64_t seq, const cp::ContextParallel* cp) {
  at::Tensor x = batch.narrow(1, 0, seq), y = batch.narrow(1, 1, seq);
  if (!cp) return {x, y};
  const cp::SequenceSplit split = cp->split_of(seq);
  return {cp::shard(x, 1, split, cp->rank()), cp::shard(y, 1, split, cp->rank())};
}

at::Tensor next_token_loss(TrainModel& m, const at::Tensor& batch, int64_t seq, bool hooked,
                           const cp::ContextParallel* cp) {
  auto [x, y] = inputs_and_targets(batch, seq, cp);
  m.set_targets(y);
  return m.loss_of_logits(m.forward(x, hooked), y);
}


}  // namespace internal

namespace {

// The whole model's trained parameters (without storage: names and shapes are what is
// routed) and which of them Muon takes.
struct Routed {
  std::unique_ptr<TrainModel> model;
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::vector<bool> muon;
};

Routed route(const TrainConfig& c) {
  Routed r;
  r.model = make_model(c, /*deferred=*/true);
  for (const auto& p : r.model->root().named_parameters()) {
    if (p.value().requires_grad()) r.named.emplace_back(p.key(), p.value());
  }
  // The overrides against the whole model: a pattern matching nothing is a mistake (a
  // typo would otherwise route nothing, silently), and so is one parameter in both lists.
  auto matching = [&](const std::string& pattern) {
    std::vector<std::string> names;
    for (const auto& [name, p] : r.named) {
      if (optim::matches_pattern(name, pattern)) names.push_back(name);
    }
    return names;
  };
  for (const auto& [key, patterns] : {std::make_pair("muon_to_adamw", &c.muon_to_adamw),
                                      std::make_pair("muon_to_muon", &c.muon_to_muon)}) {
    for (const std::string& p : *patterns) {
      HP_CHECK(!matching(p).empty(), c.source, ": ", key, ": the pattern '", p, "' matches no parameter of the model");
    }
  }
  for (const std::string& a : c.muon_to_adamw) {
    for (const std::string& name : matching(a)) {
      for (const std::string& m : c.muon_to_muon) {
        HP_CHECK(!optim::matches_pattern(name, m), c.source, ": parameter '", name, "' matches both muon_to_adamw's '",
                 a, "' and muon_to_muon's '", m, "'");
      }
    }
  }
  r.muon = optim::route_to_muon(r.named, internal::muon_routing(c));
  return r;
}

}  // namespace

namespace internal {

std::vector<RoutedParam> routed_params(const TrainConfig& c) {
  const Routed r = route(c);  // Muon's routing; under adamw every parameter is AdamW's
  const bool muon = c.optimizer == OptimizerKind::kMuon;
  std::vector<RoutedParam> out;
  for (size_t i = 0; i < r.named.size(); ++i) {
    out.push_back({r.named[i].first, r.named[i].second.numel(), muon && r.muon[i]});
  }
  return out;
}

}  // namespace internal

std::vector<std::pair<int64_t, int64_t>> muon_matrix_shapes(const TrainConfig& c) {
  if (c.optimizer != OptimizerKind::kMuon) return {};
  const Routed r = route(c);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t i = 0; i < r.named.size(); ++i) {
    if (r.muon[i]) out.emplace_back(r.named[i].second.size(0), r.named[i].second.size(1));
  }
  return out;
}

std::string describe_optimizer(const TrainConfig& c) {
  if (c.optimizer == OptimizerKind::kAdamW) return "optimizer: adamw for every parameter";
  const Routed r = route(c);
  const auto& named = r.named;
  const auto& muon = r.muon;
  int64_t n[2] = {0, 0}, elements[2] = {0, 0};
  for (size_t i = 0; i < named.size(); ++i) {
    ++n[muon[i] ? 0 : 1];
    elements[muon[i] ? 0 : 1] += named[i].second.numel();
  }
  std::ostringstream os;
  os << "optimizer groups: muon " << n[0] << " matrices (" << elements[0] << " parameters), adamw " << n[1]
     << " tensors (" << elements[1] << ": the embedding, output head, norms and vectors";
  if (!c.muon_to_adamw.empty() || !c.muon_to_muon.empty()) {
    os << ", as muon_to_adamw and muon_to_muon route them";
  }
  os << ")";
  return os.str();
}

}  // namespace hp::train
