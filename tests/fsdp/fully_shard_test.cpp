// fully_shard against the same model trained in one process on the global batch.
//
// Every rank builds the reference model too (same seed, same init) and trains it on the
// whole global batch; the sharded model trains on this rank's slice. After the steps, the
// sharded parameters are reassembled and compared with the reference.
#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include <map>

#include "fsdp_model.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"
#include "test_util.h"

using hp::test::TinyConfig;
using hp::test::TinyModel;

namespace {

struct Case {
  bool hsdp = false;
  bool reshard = true;
  bool fusion = false;
  bool frozen = false;           // freeze the final norm's bias
  int micro_steps = 1;           // gradient accumulation
  bool no_sync_first = false;    // set_requires_gradient_sync(false) on the first micro-step
  bool no_all_reduce_first = false;
  std::string name() const {
    return std::string(hsdp ? "hsdp" : "fsdp") + (reshard ? " reshard" : " keep") +
           (fusion ? " fused" : " unfused") + (frozen ? " frozen" : "") +
           (micro_steps > 1 ? " accum" : "") + (no_sync_first ? " no-sync" : "") +
           (no_all_reduce_first ? " no-all-reduce" : "");
  }
};

constexpr int kSteps = 10;
constexpr int64_t kGlobalBatch = 8;

// The global batch of step `step` (same on every rank).
std::pair<at::Tensor, at::Tensor> batch(const TinyConfig& c, int step) {
  torch::manual_seed(1000 + step);
  at::Tensor all = at::randint(c.vocab, {kGlobalBatch, c.seq + 1}, at::TensorOptions().dtype(at::kLong));
  return {all.narrow(1, 0, c.seq), all.narrow(1, 1, c.seq)};
}

torch::optim::AdamWOptions adam() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

// Full parameters of a handle, reassembled from every rank's rows.
std::vector<at::Tensor> gather_full(const hp::FSDPHandle& h, const hp::CommPtr& shard_group) {
  std::vector<at::Tensor> out;
  for (const auto& st : h->state_dict()) {
    at::Tensor full = at::zeros(st.global_shape, st.local.options());
    at::Tensor rows = full.dim() == 0 ? full.view({1}) : full;
    if (st.local.size(0) > 0) rows.narrow(0, st.row_offset, st.local.size(0)).copy_(st.local.detach());
    shard_group->all_reduce(full).wait();  // each row lives on exactly one shard rank
    out.push_back(full);
  }
  return out;
}

struct Result {
  std::vector<at::Tensor> params;  // reassembled, in handle order
  double max_rel = 0;
};

Result train(const Case& c) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  TinyConfig cfg;
  torch::manual_seed(0);
  TinyModel ref(cfg);
  torch::manual_seed(0);
  TinyModel m(cfg);
  if (c.frozen) {
    ref->nf->bias.set_requires_grad(false);
    m->nf->bias.set_requires_grad(false);
  }
  std::shared_ptr<hp::DeviceMesh> mesh;
  if (c.hsdp) {
    mesh = std::make_shared<hp::DeviceMesh>(world, std::vector<hp::MeshDim>{{"dp_replicate", 2}, {"dp_shard", -1}});
  } else {
    mesh = std::make_shared<hp::DeviceMesh>(world, std::vector<hp::MeshDim>{{"dp_shard", -1}});
  }
  hp::FullyShardOptions o;
  o.mesh = mesh;
  o.reshard_after_forward = c.reshard;
  o.comm_fusion = c.fusion;
  std::vector<hp::FSDPHandle> handles;
  for (auto& b : m->blocks) handles.push_back(hp::fully_shard(*b, o));
  hp::FSDPHandle root = hp::fully_shard(*m, o);
  handles.push_back(root);
  std::vector<at::Tensor> sharded;
  for (auto& h : handles) {
    for (auto& t : h->parameters()) sharded.push_back(t);
  }
  torch::optim::AdamW opt(sharded, adam());
  torch::optim::AdamW ref_opt(ref->parameters(), adam());

  const int64_t local = kGlobalBatch / n;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(cfg, step);
    ref_opt.zero_grad();
    ref->forward(x, y).backward();
    ref_opt.step();

    opt.zero_grad();
    at::Tensor lx = x.narrow(0, r * local, local), ly = y.narrow(0, r * local, local);
    const int64_t mb = local / c.micro_steps;
    for (int k = 0; k < c.micro_steps; ++k) {
      bool first = k == 0 && c.micro_steps > 1;
      if (c.no_sync_first) root->set_requires_gradient_sync(!first);
      if (c.no_all_reduce_first) root->set_requires_all_reduce(!first);
      at::Tensor loss = hp::call(m, lx.narrow(0, k * mb, mb), ly.narrow(0, k * mb, mb));
      (loss / c.micro_steps).backward();
    }
    opt.step();
  }

  // Reference parameters in the same order as the handles': each block's, then the rest.
  std::vector<at::Tensor> want;
  for (auto& b : ref->blocks) {
    for (auto& t : b->parameters()) want.push_back(t.detach());
  }
  for (const auto& item : ref->named_parameters()) {
    if (item.key().rfind("blocks_", 0) != 0) want.push_back(item.value().detach());
  }
  Result res;
  for (size_t hi = 0; hi < handles.size(); ++hi) {
    for (auto& t : gather_full(handles[hi], mesh->group(mesh->names().back()))) res.params.push_back(t);
  }
  EXPECT_EQ(res.params.size(), want.size()) << c.name();
  for (size_t i = 0; i < std::min(res.params.size(), want.size()); ++i) {
    double scale = want[i].abs().max().item<double>() + 1e-12;
    double rel = (res.params[i] - want[i]).abs().max().item<double>() / scale;
    res.max_rel = std::max(res.max_rel, rel);
  }
  return res;
}

}  // namespace

TEST(FullyShard, MatchesSingleProcessTraining) {
  const int n = hp::world()->size();
  std::map<std::string, std::vector<at::Tensor>> by_case;
  for (bool hsdp : {false, true}) {
    if (hsdp && n % 2 != 0) continue;
    for (bool reshard : {true, false}) {
      for (bool fusion : {false, true}) {
        Case c;
        c.hsdp = hsdp;
        c.reshard = reshard;
        c.fusion = fusion;
        Result res = train(c);
        EXPECT_LE(res.max_rel, 1e-5) << c.name() << " on " << n << " ranks";
        by_case[c.name()] = res.params;
      }
    }
  }
  // Fused and unfused collectives give bitwise identical parameters.
  for (const auto& [name, params] : by_case) {
    if (name.find("unfused") == std::string::npos) continue;
    std::string fused = name;
    fused.replace(fused.find("unfused"), 7, "fused");
    const auto& other = by_case.at(fused);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::equal(params[i], other[i])) << name << " vs " << fused << " param " << i;
    }
  }
}

TEST(FullyShard, FrozenParametersAndGradientAccumulation) {
  const int n = hp::world()->size();
  std::vector<Case> cases;
  Case frozen;
  frozen.frozen = true;
  cases.push_back(frozen);
  if (kGlobalBatch / n >= 2) {
    Case accum;
    accum.micro_steps = 2;
    accum.no_sync_first = true;
    cases.push_back(accum);
    accum.fusion = true;
    cases.push_back(accum);
    if (n % 2 == 0) {
      Case ar;
      ar.hsdp = true;
      ar.micro_steps = 2;
      ar.no_all_reduce_first = true;
      cases.push_back(ar);
      ar.fusion = true;
      cases.push_back(ar);
    }
  }
  for (const auto& c : cases) {
    Result res = train(c);
    EXPECT_LE(res.max_rel, 1e-5) << c.name() << " on " << n << " ranks";
  }
}
