// fully_shard against the same model trained in one process on the global batch.
//
// Every rank builds the reference model too (same seed, same init) and trains it on the
// whole global batch; the sharded model trains on this rank's slice. After the steps, the
// sharded parameters are reassembled and compared with the reference.
#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include <map>

#include "fsdp_model.h"
#include "fsdp_test_util.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/master_weights.h"
#include "hp/runtime.h"
#include "test_util.h"

using hp::test::TinyConfig;
using hp::test::TinyModel;

namespace {

// Mixed-precision policies of the correctness matrix.
enum class Policy {
  kFp64,              // everything fp64: the parallel algorithm alone (see kAlgoBound)
  kFp32,              // everything fp32
  kBf16Fp32Reduce,    // fp32 model, bf16 compute, fp32 reduce
  kBf16ReduceUnset,   // fp32 model, bf16 compute, reduce unset (= bf16)
  kFp32MainGrad,      // fp32 model, fp32 reduce, fp32 main grad (the seed-001 setting)
  kBf16Master,        // bf16 model, fp32 main grad, fp32 master weights
  kPureBf16,          // bf16 model, compute and reduce unset (the seed-000 setting)
};

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::kFp64: return "fp64";
    case Policy::kFp32: return "fp32";
    case Policy::kBf16Fp32Reduce: return "bf16+fp32-reduce";
    case Policy::kBf16ReduceUnset: return "bf16+reduce-unset";
    case Policy::kFp32MainGrad: return "fp32+fp32-reduce+main-grad";
    case Policy::kBf16Master: return "bf16-params+main-grad+master";
    case Policy::kPureBf16: return "pure-bf16";
  }
  return "?";
}

struct Case {
  bool hsdp = false;
  bool reshard = true;
  int group = 0;                 // reshard_after_forward_group_size
  bool fusion = false;
  bool per_submodule = false;    // wait_per_submodule, with each block prefetching the next
  bool frozen = false;           // freeze the final norm's bias
  int micro_steps = 1;           // gradient accumulation
  bool no_sync_first = false;    // set_requires_gradient_sync(false) on the first micro-step
  bool no_all_reduce_first = false;
  Policy policy = Policy::kFp64;
  bool host_built = false;       // the model stays on the CPU; FullyShardOptions::device moves it
  std::string name() const {
    return std::string(hsdp ? "hsdp" : "fsdp") + (reshard ? " reshard" : " keep") +
           (group ? " to groups of " + std::to_string(group) : "") +
           (fusion ? " fused" : " unfused") + (per_submodule ? " per-submodule" : "") + (frozen ? " frozen" : "") +
           (micro_steps > 1 ? " accum" : "") + (no_sync_first ? " no-sync" : "") +
           (no_all_reduce_first ? " no-all-reduce" : "") + (host_built ? " host-built" : "") + " " +
           policy_name(policy);
  }
};

constexpr int kSteps = 10;
// Bound of the float64 runs, where the point is the parallel algorithm: sharded and
// single-process training differ only in summation order (~1e-16 relative per operation),
// which AdamW cannot grow to update size at this precision (its eps = 1e-8 dwarfs the noise
// of any near-zero gradient). A wrong reduction moves parameters by O(lr) = 1e-2.
constexpr double kAlgoBound = 1e-10;
constexpr int64_t kGlobalBatch = 8;

// The global batch of step `step` (same on every rank).
std::pair<at::Tensor, at::Tensor> batch(const TinyConfig& c, int step) {
  torch::manual_seed(1000 + step);
  at::Tensor all = at::randint(c.vocab, {kGlobalBatch, c.seq + 1}, at::TensorOptions().dtype(at::kLong));
  return {all.narrow(1, 0, c.seq), all.narrow(1, 1, c.seq)};
}

torch::optim::AdamWOptions adam() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }


struct Result {
  std::vector<at::Tensor> params;  // reassembled, in handle order
  double max_rel = 0;              // parameters after the steps
  double grad_rel = 0;             // gradients of the first step
  bool ownership_ok = true;        // autograd's gradients and the user's inputs intact
};

// Largest |a - b| relative to the largest |b|, over matching lists; 1e30 when the lists
// are empty or differ in length or in any shape.
double max_rel(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  if (got.empty() || got.size() != want.size()) return 1e30;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i].sizes().equals(want[i].sizes())) return 1e30;
    at::Tensor a = got[i].to(at::kDouble), b = want[i].to(at::kDouble);
    double scale = b.abs().max().item<double>() + 1e-12;
    worst = std::max(worst, (a - b).abs().max().item<double>() / scale);
  }
  return worst;
}

// Parameters (or their gradients) of a reference model, in the handles' order: each
// block's, then the rest.
std::vector<at::Tensor> in_handle_order(TinyModel& model, bool grads) {
  std::vector<at::Tensor> out;
  auto take = [&](const at::Tensor& t) {
    if (!grads) out.push_back(t.detach());
    else if (t.requires_grad()) out.push_back(t.grad().defined() ? t.grad() : at::zeros_like(t));
  };
  for (auto& b : model->blocks) {
    for (auto& t : b->parameters()) take(t);
  }
  for (const auto& item : model->named_parameters()) {
    if (item.key().rfind("blocks_", 0) != 0) take(item.value());
  }
  return out;
}

Result train(const Case& c) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  const bool bf16_model = c.policy == Policy::kBf16Master || c.policy == Policy::kPureBf16;
  const bool bf16_compute =
      c.policy != Policy::kFp64 && c.policy != Policy::kFp32 && c.policy != Policy::kFp32MainGrad;
  TinyConfig cfg;
  // The reference: `ref` holds what the optimizer steps (fp32, or bf16 for pure bf16);
  // `work` runs forward/backward in the compute dtype when that differs, with the same
  // casts fully_shard applies.
  // Built on the CPU from the seed, then moved to the test device (HP_TEST_DEVICE).
  const c10::Device dev = hp::test::test_device();
  torch::manual_seed(0);
  TinyModel ref(cfg);
  torch::manual_seed(0);
  TinyModel m(cfg);
  torch::manual_seed(0);
  TinyModel work(cfg);
  for (TinyModel* mm : {&ref, &m, &work}) {
    if (!(c.host_built && mm == &m)) (*mm)->to(dev);
  }
  if (c.policy == Policy::kFp64) {
    for (TinyModel* mm : {&ref, &m, &work}) (*mm)->to(at::kDouble);
  }
  if (bf16_model) {
    m->to(at::kBFloat16);
    if (c.policy == Policy::kPureBf16) {
      ref->to(at::kBFloat16);
    } else {
      at::NoGradGuard g;
      for (auto& t : ref->parameters()) t.copy_(t.to(at::kBFloat16));  // masters start rounded
    }
  }
  const bool use_work = bf16_compute && c.policy != Policy::kPureBf16;
  if (use_work) work->to(at::kBFloat16);
  if (c.frozen) {
    for (TinyModel* mm : {&ref, &m, &work}) (*mm)->nf->bias.set_requires_grad(false);
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
  o.reshard_after_forward_group_size = c.group;
  o.comm_fusion = c.fusion;
  o.wait_per_submodule = c.per_submodule;
  if (c.host_built) o.device = dev;
  switch (c.policy) {
    case Policy::kFp64: case Policy::kFp32: case Policy::kPureBf16: break;
    case Policy::kBf16Fp32Reduce: o.mp_policy.param_dtype = at::kBFloat16; o.mp_policy.reduce_dtype = at::kFloat; break;
    case Policy::kBf16ReduceUnset: o.mp_policy.param_dtype = at::kBFloat16; break;
    case Policy::kFp32MainGrad:
      o.mp_policy.reduce_dtype = at::kFloat;
      o.mp_policy.apply_grad_on_fp32_main_grad = true;
      break;
    case Policy::kBf16Master:
      o.mp_policy.reduce_dtype = at::kFloat;
      o.mp_policy.apply_grad_on_fp32_main_grad = true;
      break;
  }
  std::vector<hp::FSDPHandle> handles;
  for (auto& b : m->blocks) handles.push_back(hp::fully_shard(*b, o));
  hp::FSDPHandle root = hp::fully_shard(*m, o);
  handles.push_back(root);
  if (c.per_submodule) {
    for (size_t i = 0; i + 1 < m->blocks.size(); ++i) handles[i]->set_modules_to_forward_prefetch({handles[i + 1]});
  }
  std::vector<at::Tensor> sharded;
  for (auto& h : handles) {
    for (auto& t : h->parameters()) sharded.push_back(t);
  }
  std::unique_ptr<hp::FP32MasterOptimizer> master;
  std::unique_ptr<torch::optim::AdamW> opt;
  if (c.policy == Policy::kBf16Master) {
    master = std::make_unique<hp::FP32MasterOptimizer>(handles, [](std::vector<at::Tensor> ps) {
      return std::make_unique<torch::optim::AdamW>(ps, adam());
    });
  } else {
    opt = std::make_unique<torch::optim::AdamW>(sharded, adam());
  }
  torch::optim::AdamW ref_opt(ref->parameters(), adam());
  const int64_t local = kGlobalBatch / n;

  // Seed-001 check: keep the gradients autograd produces for the module's parameters
  // (and copies of their values) through the first step.
  std::vector<std::pair<at::Tensor, at::Tensor>> autograd_grads;
  bool capture = true;
  for (auto& t : m->parameters()) {
    if (!t.requires_grad()) continue;
    t.register_hook([&autograd_grads, &capture](const at::Tensor& g) {
      if (capture) autograd_grads.emplace_back(g, g.clone());
    });
  }

  Result res;
  for (int step = 0; step < kSteps; ++step) {
    auto [cx, cy] = batch(cfg, step);
    at::Tensor x = cx.to(dev), y = cy.to(dev);
    ref_opt.zero_grad();
    if (use_work) {
      at::NoGradGuard g;
      auto wp = work->parameters();
      auto rp = ref->parameters();
      for (size_t i = 0; i < wp.size(); ++i) wp[i].copy_(rp[i]);
    }
    if (use_work || c.policy == Policy::kPureBf16) {
      // The same casts as the sharded run: each rank's slice computes bf16 gradients,
      // which are averaged over the ranks (in fp32 here) and given to the optimizer in
      // its parameters' dtype.
      TinyModel& fwd = use_work ? work : ref;
      auto wp = fwd->parameters();
      auto rp = ref->parameters();
      std::vector<at::Tensor> acc(wp.size());
      for (int rr = 0; rr < n; ++rr) {
        for (auto& t : wp) t.mutable_grad() = at::Tensor();
        fwd->forward(x.narrow(0, rr * local, local), y.narrow(0, rr * local, local)).backward();
        for (size_t i = 0; i < wp.size(); ++i) {
          if (!wp[i].grad().defined()) continue;
          at::Tensor g = wp[i].grad().to(at::kFloat);
          acc[i] = acc[i].defined() ? acc[i] + g : g;
        }
      }
      for (size_t i = 0; i < wp.size(); ++i) {
        if (acc[i].defined()) rp[i].mutable_grad() = (acc[i] / n).to(rp[i].scalar_type());
      }
    } else {
      ref->forward(x, y).backward();
    }

    if (master) master->zero_grad(); else opt->zero_grad();
    at::Tensor lx = x.narrow(0, r * local, local), ly = y.narrow(0, r * local, local);
    at::Tensor lx_copy = lx.clone(), ly_copy = ly.clone();
    const int64_t mb = local / c.micro_steps;
    for (int k = 0; k < c.micro_steps; ++k) {
      bool first = k == 0 && c.micro_steps > 1;
      if (c.no_sync_first) root->set_requires_gradient_sync(!first);
      if (c.no_all_reduce_first) root->set_requires_all_reduce(!first);
      at::Tensor loss = hp::call(m, lx.narrow(0, k * mb, mb), ly.narrow(0, k * mb, mb));
      (loss / c.micro_steps).backward();
    }
    if (step == 0) {
      // Gradients of the first step, reassembled, against the reference's.
      std::vector<at::Tensor> got;
      for (auto& h : handles) {
        auto params = h->parameters();
        auto mains = h->main_grads();
        for (size_t i = 0; i < params.size(); ++i) {
          if (!params[i].requires_grad()) continue;
          at::Tensor g = mains[i].defined() ? mains[i] : params[i].grad();
          got.push_back(g);
        }
      }
      std::vector<at::Tensor> gathered;
      size_t gi = 0;
      for (auto& h : handles) {
        for (const auto& st : h->state_dict()) {
          if (!st.local.requires_grad()) continue;
          gathered.push_back(hp::test::reassemble(st, got[gi++], mesh->group(mesh->names().back())));
        }
      }
      res.grad_rel = max_rel(gathered, in_handle_order(ref, /*grads=*/true));
    }
    ref_opt.step();
    if (master) master->step(); else opt->step();
    if (step == 0) {
      capture = false;
      for (auto& [g, copy] : autograd_grads) {
        bool intact = g.storage().nbytes() >= static_cast<size_t>(g.numel()) * g.element_size() &&
                      at::equal(g, copy);
        res.ownership_ok = res.ownership_ok && intact;
      }
      res.ownership_ok = res.ownership_ok && !autograd_grads.empty() && at::equal(lx, lx_copy) &&
                         at::equal(ly, ly_copy);
      autograd_grads.clear();
    }
  }

  // With master weights the fp32 masters are what is trained; compare those.
  size_t mi = 0;
  for (auto& h : handles) {
    for (const auto& st : h->state_dict()) {
      at::Tensor local = master && st.local.requires_grad() ? master->masters()[mi++] : st.local;
      res.params.push_back(hp::test::reassemble(st, local, mesh->group(mesh->names().back())));
    }
  }
  std::vector<at::Tensor> want = in_handle_order(ref, /*grads=*/false);
  for (auto& w : want) w = w.to(w.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  EXPECT_EQ(res.params.size(), want.size()) << c.name();
  res.max_rel = max_rel(res.params, want);
  return res;
}

}  // namespace

// The whole matrix with fully_shard's overlap on (prefetches, reductions behind backward)
// and off (each collective waited for where it is issued: what HP_FSDP_OVERLAP=auto picks
// on a node without a spare core per rank, as these); the two give bitwise the same
// parameters, case by case (the same reductions of the same values, only timed apart).
class FullyShardOverlap : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { hp::set_fsdp_overlap(GetParam()); }
  void TearDown() override { hp::reset_fsdp_overlap(); }
};

// Each overlap setting's parameters per case, for the comparison of the two.
std::map<bool, std::map<std::string, std::vector<at::Tensor>>>& parity_params() {
  static std::map<bool, std::map<std::string, std::vector<at::Tensor>>> p;
  return p;
}

TEST_P(FullyShardOverlap, MatchesSingleProcessTraining) {
  const int n = hp::world()->size();
  const bool overlap = GetParam();
  ASSERT_EQ(hp::fsdp_overlap(), overlap);
  std::map<std::string, std::vector<at::Tensor>>& by_case = parity_params()[overlap];
  by_case.clear();
  // Trains one case against single-process training; its parameters after the steps.
  auto run = [n, overlap](const Case& c) {
    Result res = train(c);
    EXPECT_LE(res.max_rel, kAlgoBound) << c.name() << " on " << n << " ranks, overlap " << overlap;
    EXPECT_LE(res.grad_rel, kAlgoBound) << c.name() << " on " << n << " ranks (gradients), overlap " << overlap;
    return res.params;
  };
  for (bool hsdp : {false, true}) {
    if (hsdp && n % 2 != 0) continue;
    for (bool reshard : {true, false}) {
      for (bool fusion : {false, true}) {
        Case c;
        c.hsdp = hsdp;
        c.reshard = reshard;
        c.fusion = fusion;
        by_case[c.name()] = run(c);
      }
    }
  }
  // Resharded after forward to groups of 2 (each rank keeps half of every parameter and
  // gathers over its pair before backward): at 4 ranks a group smaller than dp_shard, at 2
  // the whole of it; in HSDP 2 x 2 too.
  if (n % 2 == 0) {
    for (bool hsdp : {false, true}) {
      for (bool fusion : {false, true}) {
        Case c;
        c.hsdp = hsdp;
        c.group = 2;
        c.fusion = fusion;
        if (hsdp && n != 4) continue;
        by_case[c.name()] = run(c);
      }
    }
  }
  // Waiting per submodule (each block prefetching the next): the same gathers waited for
  // later, so the same parameters bit for bit as waiting for each block at its start.
  for (bool hsdp : {false, true}) {
    for (int group : {0, 2}) {
      if ((hsdp || group) && n % 2 != 0) continue;
      if (hsdp && group && n != 4) continue;
      Case c;
      c.hsdp = hsdp;
      c.group = group;
      c.per_submodule = true;
      const std::vector<at::Tensor> params = run(c);
      c.per_submodule = false;
      const auto& other = by_case.at(c.name());
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::equal(params[i], other[i])) << c.name() << " per submodule, param " << i;
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
  // The other setting's run, when it came first: bitwise the same.
  auto other = parity_params().find(!overlap);
  if (other == parity_params().end()) return;
  for (const auto& [name, params] : by_case) {
    const auto& theirs = other->second.at(name);
    ASSERT_EQ(params.size(), theirs.size()) << name;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::equal(params[i], theirs[i])) << name << ": overlap on and off differ, param " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FullyShard, FullyShardOverlap, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "on" : "off"; });

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
    EXPECT_LE(res.max_rel, kAlgoBound) << c.name() << " on " << n << " ranks";
    EXPECT_LE(res.grad_rel, kAlgoBound) << c.name() << " on " << n << " ranks (gradients)";
  }
}

// A model built on the host and sharded onto the test device by FullyShardOptions::device
// (hp-train's path: its models are built on the CPU) trains as one moved there first.
TEST(FullyShard, HostBuiltModelShardsOntoTheDevice) {
  const int n = hp::world()->size();
  std::vector<Case> cases(3);
  cases[1].fusion = true;
  cases[2].policy = Policy::kBf16Master;
  for (auto& c : cases) {
    c.host_built = true;
    Result res = train(c);
    // bf16 with fp32 masters: MixedPrecisionPoliciesAndOwnership's bound for it (the
    // reference applies the same casts; fp32 summation order only).
    const double bound = c.policy == Policy::kFp64 ? kAlgoBound : 1e-4;
    EXPECT_LE(res.max_rel, bound) << c.name() << " on " << n << " ranks";
    EXPECT_LE(res.grad_rel, bound) << c.name() << " on " << n << " ranks (gradients)";
  }
}

// Every policy, fused and unfused, against a single-process reference applying the same
// casts: bf16 forward/backward of each rank's slice, gradients cast to the reduce dtype
// and averaged. With an fp32 reduction that is the same arithmetic up to summation order;
// a bf16 reduction (reduce unset) rounds each pairwise step in an order the reference does
// not copy, so it is compared within bf16 precision. The gradients autograd produced and
// the user's inputs must be intact after the step (seed defect 001), for every policy.
TEST(FullyShard, MixedPrecisionPoliciesAndOwnership) {
  const int n = hp::world()->size();
  for (Policy pol : {Policy::kFp32, Policy::kBf16Fp32Reduce, Policy::kBf16ReduceUnset, Policy::kFp32MainGrad,
                     Policy::kBf16Master}) {
    for (bool fusion : {false, true}) {
      Case c;
      c.policy = pol;
      c.fusion = fusion;
      c.hsdp = n == 4;
      Result res = train(c);
      bool bf16_reduce = pol == Policy::kBf16ReduceUnset;
      double tol = (bf16_reduce && n > 1) ? 5e-2 : 1e-4;
      double gtol = bf16_reduce ? 2e-2 : 1e-4;
      EXPECT_LE(res.max_rel, tol) << c.name() << " on " << n << " ranks";
      EXPECT_LE(res.grad_rel, gtol) << c.name() << " on " << n << " ranks (gradients)";
      EXPECT_TRUE(res.ownership_ok) << c.name() << ": a gradient autograd produced, or an input, was freed or changed";
    }
  }
  // Resharding to groups of 2 keeps the shares in the all-gather (compute) dtype.
  if (n % 2 == 0) {
    for (Policy pol : {Policy::kBf16Fp32Reduce, Policy::kBf16Master}) {
      Case c;
      c.policy = pol;
      c.group = 2;
      c.fusion = pol == Policy::kBf16Master;
      Result res = train(c);
      EXPECT_LE(res.max_rel, 1e-4) << c.name() << " on " << n << " ranks";
      EXPECT_LE(res.grad_rel, 1e-4) << c.name() << " on " << n << " ranks (gradients)";
      EXPECT_TRUE(res.ownership_ok) << c.name();
    }
  }
}

// Seed defect 000: bf16 parameters and compute, reduce_dtype unset, HSDP with fused
// collectives. Every buffer resolves to bf16 (no default fp32), the reduction runs in
// bf16, and training follows a pure-bf16 single-process run within bf16 precision.
TEST(FullyShard, PureBf16HsdpFusedReduceUnset) {
  const int n = hp::world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "HSDP needs an even world";
  Case c;
  c.policy = Policy::kPureBf16;
  c.hsdp = true;
  c.fusion = true;
  Result res = train(c);
  EXPECT_LE(res.grad_rel, 3e-2) << c.name();
  EXPECT_LE(res.max_rel, 5e-2) << c.name();
  EXPECT_TRUE(res.ownership_ok);
}
