// Muon's optimizer: the steps of the whole matrices one process holds, and of the pieces
// spread over ranks by the plan of muon_plan.cpp (hp/optim/muon.h).
#include "hp/optim/muon.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "adamw_step.h"
#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/optim/foreach_adamw.h"
#include "muon_plan.h"

namespace hp::optim {

using detail::exchange;
using detail::muon_group_of;

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

Muon::Muon(std::vector<torch::optim::OptimizerParamGroup> groups, MuonOptions defaults)
    : torch::optim::Optimizer(std::move(groups), std::make_unique<MuonOptions>(std::move(defaults))) {
  for (const auto& g : param_groups_) {
    if (const auto* m = dynamic_cast<const MuonOptions*>(&g.options())) {
      HP_CHECK(!m->ns().empty(), "Muon: a Muon group with no Newton-Schulz steps");
      HP_CHECK(m->momentum() >= 0 && m->momentum() < 1, "Muon: momentum=", m->momentum(), " is not in [0, 1)");
      HP_CHECK(m->ns_dtype() == at::kBFloat16 || m->ns_dtype() == at::kFloat || m->ns_dtype() == at::kDouble,
               "Muon: ns_dtype=", m->ns_dtype(), " is not supported yet (bfloat16, float32 or float64)");
      for (const auto& p : g.params()) {
        HP_CHECK(p.dim() == 2, "Muon: a parameter of shape ", p.sizes(),
                 " in a Muon group: only matrices (2-D) are supported yet (route it to AdamW)");
      }
    } else if (const auto* a = dynamic_cast<const torch::optim::AdamWOptions*>(&g.options())) {
      HP_CHECK(!a->amsgrad(), "Muon: the AdamW groups' amsgrad is not supported yet");
    } else {
      HP_CHECK(false, "Muon: a parameter group's options are neither MuonOptions nor AdamWOptions");
    }
  }
  // One group per parameter: Muon's and AdamW's states of one tensor would collide.
  std::set<const c10::TensorImpl*> seen;
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) {
      HP_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "Muon: a parameter of shape ", p.sizes(),
               " is in two groups");
    }
  }
}

Muon::~Muon() = default;

MuonParamState& Muon::muon_state(const at::Tensor& p) {
  const auto key = state_key(state_, p);
  auto it = state_.find(key);
  if (it == state_.end()) {
    auto s = std::make_unique<MuonParamState>();
    s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
    it = state_.emplace(key, std::move(s)).first;
  }
  auto* st = dynamic_cast<MuonParamState*>(it->second.get());
  HP_CHECK(st != nullptr, "Muon::muon_state: the parameter of shape ", p.sizes(), " is stepped by AdamW, not Muon");
  return *st;
}

namespace {

// Momentum, then the direction to orthogonalize (in the iteration's dtype).
at::Tensor direction_of(MuonParamState& s, const at::Tensor& p, const MuonOptions& o) {
  s.step(s.step() + 1);
  at::Tensor& m = s.momentum_buffer();
  m.mul_(o.momentum()).add_(p.grad());
  return (o.nesterov() ? p.grad().add(m, o.momentum()) : m).to(o.ns_dtype());
}

void apply_update(at::Tensor& p, const at::Tensor& orth, const MuonOptions& o, int64_t rows, int64_t cols) {
  if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
  p.add_(orth.to(p.device(), p.scalar_type()), -o.lr() * muon_scale(o.scale(), rows, cols, o.rms_target()));
}

// Runs the iteration on matrices of one shape and options as one batch.
std::vector<at::Tensor> orthogonalize(const std::vector<at::Tensor>& ds, const MuonOptions& o) {
  const at::Tensor orth = newton_schulz(at::stack(ds), o.ns(), o.ns_dtype(), o.eps());
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < orth.size(0); ++i) out.push_back(orth[i]);
  return out;
}

}  // namespace

// Every gradient usable, checked before any parameter moves: an error names the parameter.
static std::string check_gradients(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  try {
    for (const auto& group : groups) {
      const bool muon = dynamic_cast<const MuonOptions*>(&group.options()) != nullptr;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        HP_CHECK(!p.grad().is_sparse(), "Muon: sparse gradients are not supported yet");
        HP_CHECK(p.grad().sizes() == p.sizes(), "Muon: a gradient of shape ", p.grad().sizes(), " for a parameter of shape ",
                 p.sizes());
        HP_CHECK(!muon || p.dim() == 2, "Muon: a parameter of shape ", p.sizes(),
                 " in a Muon group: only matrices (2-D) are supported yet");
      }
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

torch::Tensor Muon::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  const std::string error = check_gradients(param_groups_);
  // Distributed: every rank agrees first (errors anywhere, which matrices have gradients),
  // so that a failure raises on all of them before anything is updated.
  std::vector<bool> active;
  if (plan_) {
    active = agree_on_step(error);
  } else {
    HP_CHECK(error.empty(), error);
  }
  for (auto& group : param_groups_) {
    const auto* o = dynamic_cast<const MuonOptions*>(&group.options());
    if (o == nullptr) {
      detail::foreach_adamw_group(group, state_);
      continue;
    }
    // Whole matrices held here: momentum and direction per parameter, then the directions
    // of one shape orthogonalized as one batch.
    std::map<std::vector<int64_t>, std::vector<std::pair<at::Tensor, at::Tensor>>> by_shape;  // (param, direction)
    for (auto& p : group.params()) {
      if (!p.grad().defined() || (plan_ && plan_->distributed.count(p.unsafeGetTensorImpl()))) continue;
      by_shape[p.sizes().vec()].emplace_back(p, direction_of(muon_state(p), p, *o));
    }
    for (auto& [shape, items] : by_shape) {
      std::vector<at::Tensor> ds;
      for (const auto& it : items) ds.push_back(it.second);
      const std::vector<at::Tensor> orth = orthogonalize(ds, *o);
      for (size_t i = 0; i < items.size(); ++i) apply_update(items[i].first, orth[i], *o, shape[0], shape[1]);
    }
  }
  if (plan_) step_distributed(active);
  return loss;
}

std::vector<bool> Muon::agree_on_step(const std::string& error) {
  Plan& plan = *plan_;
  const CommPtr& comm = plan.comm;
  const size_t n = plan.matrices.size();
  // One all-reduce: per matrix, how many of its holders have a gradient; last, how many
  // ranks failed the local checks.
  at::Tensor counts = at::zeros({static_cast<int64_t>(n) + 1}, at::kLong);
  for (const auto& [j, piece] : plan.mine) counts[static_cast<int64_t>(j)] = piece.first.grad().defined() ? 1 : 0;
  counts[static_cast<int64_t>(n)] = error.empty() ? 0 : 1;
  at::Tensor summed = counts.to(control_device(comm));
  comm->all_reduce(summed).wait();
  const at::Tensor got = summed.cpu();
  HP_CHECK(error.empty(), error);
  HP_CHECK(got[static_cast<int64_t>(n)].item<int64_t>() == 0, "Muon step failed on another rank (its error says why)");
  std::vector<bool> active(n, false);
  for (size_t j = 0; j < n; ++j) {
    const int64_t have = got[static_cast<int64_t>(j)].item<int64_t>();
    const auto holders = static_cast<int64_t>(plan.matrices[j].holders.size());
    HP_CHECK(have == 0 || have == holders, "Muon: '", plan.matrices[j].name, "' has a gradient on ", have, " of the ",
             holders, " ranks holding pieces of it: its pieces must all have one or none");
    active[j] = have > 0;
  }
  return active;
}

void Muon::step_distributed(const std::vector<bool>& active) {
  Plan& plan = *plan_;
  const CommPtr& comm = plan.comm;
  const size_t n = plan.matrices.size();
  // Pieces travel and whole matrices are assembled on the communicator's device (the same
  // rule on every rank, pieces or none), then the results go back to each parameter's.
  const c10::Device dev = control_device(comm);
  // Momentum and direction of this rank's pieces.
  std::map<size_t, at::Tensor> direction;
  std::map<size_t, const MuonOptions*> options;
  for (auto& [j, piece] : plan.mine) {
    if (!active[j]) continue;
    const MuonOptions* o = muon_group_of(param_groups_, piece.first);
    HP_INTERNAL_ASSERT(o != nullptr, "a distributed Muon piece outside the Muon groups");
    // In the dtype fixed at distribute() (the plan's), on the exchange's device.
    direction[j] = direction_of(muon_state(piece.first), piece.first, *o).to(dev, static_cast<at::ScalarType>(plan.dtype));
    options[j] = o;
  }
  if (plan.dtype < 0) return;  // no pieces anywhere
  const at::ScalarType dtype = static_cast<at::ScalarType>(plan.dtype);
  // The pieces to the computers; each computer assembles its matrices.
  const int me = comm->rank();
  std::map<size_t, at::Tensor> whole;
  for (size_t j = 0; j < n; ++j) {
    const auto& cs = plan.matrices[j].computers;
    if (!active[j] || std::find(cs.begin(), cs.end(), me) == cs.end()) continue;
    at::Tensor w = at::empty({plan.matrices[j].rows, plan.matrices[j].cols}, at::TensorOptions(dtype).device(dev));
    plan.mine.at(j).second.of(w).copy_(direction.at(j));
    whole[j] = w;
  }
  // (The transfer lists are the same on every rank: an empty one is skipped by all.)
  if (!plan.gather.empty()) {
    exchange(
        comm, plan.gather, active, dtype, dev, [&](const Plan::Transfer& t) { return direction.at(t.matrix); },
        [&](const Plan::Transfer& t, const at::Tensor& part) { t.box.of(whole.at(t.matrix)).copy_(part); });
  }
  // The iteration, batched by shape and options.
  std::map<std::tuple<int64_t, int64_t, const MuonOptions*>, std::vector<size_t>> batches;
  for (const auto& [j, w] : whole) batches[{w.size(0), w.size(1), options.at(j)}].push_back(j);
  std::map<size_t, at::Tensor> result;
  for (const auto& [key, js] : batches) {
    std::vector<at::Tensor> ds;
    for (size_t j : js) ds.push_back(whole.at(j));
    const std::vector<at::Tensor> orth = orthogonalize(ds, *std::get<2>(key));
    for (size_t i = 0; i < js.size(); ++i) result[js[i]] = orth[i];
  }
  // Each holder's box of the result: its own, or from the owner.
  std::map<size_t, at::Tensor> update;
  for (auto& [j, piece] : plan.mine) {
    if (active[j] && result.count(j)) update[j] = piece.second.of(result.at(j));
  }
  if (!plan.give.empty()) {
    exchange(
        comm, plan.give, active, dtype, dev, [&](const Plan::Transfer& t) { return t.box.of(result.at(t.matrix)); },
        [&](const Plan::Transfer& t, const at::Tensor& part) { update[t.matrix] = part.clone(); });
  }
  for (auto& [j, piece] : plan.mine) {
    if (!active[j]) continue;
    apply_update(piece.first, update.at(j), *options.at(j), plan.matrices[j].rows, plan.matrices[j].cols);
  }
}

}  // namespace hp::optim
