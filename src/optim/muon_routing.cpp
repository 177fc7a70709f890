// Which parameters Muon steps (the hidden matrices, with the routing overrides) and the
// optimizer over a model's named parameters (hp/optim/muon.h).
#include <algorithm>

#include "hp/core/error.h"
#include "hp/core/pattern.h"
#include "hp/optim/muon.h"

namespace hp::optim {

bool matches_pattern(const std::string& name, const std::string& pattern) {
  return wildcard_match(pattern, name, /*star_crosses_dot=*/true);
}

std::vector<bool> route_to_muon(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                const MuonRouting& routing) {
  auto any = [](const std::string& name, const std::vector<std::string>& patterns) {
    return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return matches_pattern(name, p); });
  };
  std::vector<bool> out;
  for (const auto& [name, p] : named) {
    if (any(name, routing.to_adamw)) {
      out.push_back(false);
    } else if (any(name, routing.to_muon)) {
      HP_CHECK(p.dim() == 2, "Muon: parameter '", name, "' of shape ", p.sizes(),
               " matches a Muon pattern, but only matrices (2-D) are supported yet");
      out.push_back(true);
    } else {
      out.push_back(p.dim() == 2);
    }
  }
  return out;
}

std::unique_ptr<Muon> make_muon(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                const MuonOptions& muon, const torch::optim::AdamWOptions& adamw,
                                const MuonRouting& routing, int64_t* muon_count, int64_t* adamw_count) {
  const std::vector<bool> to_muon = route_to_muon(named, routing);
  std::vector<at::Tensor> m, decay, plain;
  int64_t nm = 0, na = 0;
  for (size_t i = 0; i < named.size(); ++i) {
    const at::Tensor& p = named[i].second;
    if (!p.requires_grad()) continue;
    if (to_muon[i]) {
      m.push_back(p);
      nm += p.numel();
    } else {
      (p.dim() >= 2 ? decay : plain).push_back(p);
      na += p.numel();
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!m.empty()) groups.emplace_back(m, std::make_unique<MuonOptions>(muon));
  if (!decay.empty()) groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(adamw));
  if (!plain.empty()) {
    groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  }
  if (muon_count) *muon_count = nm;
  if (adamw_count) *adamw_count = na;
  return std::make_unique<Muon>(std::move(groups), muon);
}

}  // namespace hp::optim
