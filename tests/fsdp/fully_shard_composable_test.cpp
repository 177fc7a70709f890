// fully_shard used the ways a model or a training loop composes modules, each against the
// same training in one process, in float64 (the parallel algorithm alone: 1e-10):
// - a block run more than once in one forward (twice in a row, and A-B-A);
// - two sharded models in one process with interleaved forwards and backwards, and with
//   their losses summed into one backward.
#include <gtest/gtest.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <string>
#include <vector>

#include "fsdp_test_util.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/recompute.h"
#include "hp/mesh/device_mesh.h"
#include "hp/runtime.h"

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(6, 6)); }  // 6 rows: padded at 4 ranks
  at::Tensor forward(const at::Tensor& x) { return at::tanh(hp::call(fc, x)) + x; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

// in -> blocks in the order `pattern` names them ("A", "B") -> head.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(std::string p) : pattern(std::move(p)) {
    in = register_module("in", torch::nn::Linear(5, 6));
    a = register_module("a", Block());
    b = register_module("b", Block());
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = hp::call(in, x);
    for (char ch : pattern) {
      Block& blk = ch == 'A' ? a : b;
      if (!recompute) {
        h = hp::call(blk, h);
      } else {
        h = hp::recompute_with(*recompute, blk, h);
      }
    }
    return hp::call(head, h);
  }
  std::string pattern;
  c10::optional<hp::RecomputePolicy> recompute;  // checkpoint the blocks
  torch::nn::Linear in{nullptr}, head{nullptr};
  Block a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

torch::optim::AdamWOptions adam() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

// A model and its one-process reference, built from one seed, in float64.
struct Pair {
  Net ref{nullptr}, m{nullptr};
  std::vector<hp::FSDPHandle> handles;  // a, b, root
  hp::CommPtr shard_group;
  std::unique_ptr<torch::optim::AdamW> opt, ref_opt;

  Pair(const std::string& pattern, uint64_t seed, const hp::FullyShardOptions& o,
       at::ScalarType dtype = at::kDouble) {
    torch::manual_seed(seed);
    ref = Net(pattern);
    torch::manual_seed(seed);
    m = Net(pattern);
    ref->to(dtype);
    m->to(dtype);
    handles = {hp::fully_shard(*m->a, o), hp::fully_shard(*m->b, o), hp::fully_shard(*m, o)};
    shard_group = o.mesh ? o.mesh->group("dp_shard") : hp::world();
    std::vector<at::Tensor> params;
    for (auto& h : handles) {
      for (auto& t : h->parameters()) params.push_back(t);
    }
    opt = std::make_unique<torch::optim::AdamW>(params, adam());
    ref_opt = std::make_unique<torch::optim::AdamW>(ref->parameters(), adam());
  }
  // This rank's loss on its rows of the global batch, and the reference's on all of them
  // (the reference steps at once; the sharded model after the caller's backward).
  at::Tensor losses(int step, uint64_t seed) {
    auto w = hp::world();
    const int n = w->size(), r = w->rank();
    torch::manual_seed(seed * 100 + step);
    at::Tensor x = at::randn({3 * n, 5}, at::kDouble);
    ref_opt->zero_grad();
    (hp::call(ref, x).pow(2).sum() / n).backward();
    ref_opt->step();
    opt->zero_grad();
    return hp::call(m, x.narrow(0, 3 * r, 3)).pow(2).sum();
  }
  double max_rel() {
    std::vector<at::Tensor> want;
    for (auto* t : {&ref->a->fc->weight, &ref->a->fc->bias, &ref->b->fc->weight, &ref->b->fc->bias, &ref->in->weight,
                    &ref->in->bias, &ref->head->weight, &ref->head->bias}) {
      want.push_back(*t);
    }
    return hp::test::max_rel_to_reference(handles, want, shard_group);
  }
  void expect_resharded(const std::string& what) {
    if (hp::world()->size() == 1) return;  // one shard: the parameters alias their shards
    for (auto& h : handles) EXPECT_FALSE(h->is_unsharded()) << what << ": " << h->module().name() << " left gathered";
  }
};

// FSDP fused and unfused, resharding after forward or not; and HSDP 2 x (n/2) at 4 ranks.
std::vector<hp::FullyShardOptions> layouts() {
  std::vector<hp::FullyShardOptions> out;
  auto w = hp::world();
  for (bool hsdp : {false, true}) {
    if (hsdp && w->size() != 4) continue;
    for (bool fusion : {false, true}) {
      for (bool reshard : {true, false}) {
        hp::FullyShardOptions o;
        o.comm_fusion = fusion;
        o.reshard_after_forward = reshard;
        if (hsdp) {
          o.mesh = std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"dp_replicate", 2}, {"dp_shard", -1}});
        }
        out.push_back(o);
      }
    }
  }
  return out;
}

std::string describe(const hp::FullyShardOptions& o) {
  return std::string(o.mesh ? "hsdp, " : "") + (o.comm_fusion ? "fused" : "unfused") +
         (o.reshard_after_forward ? ", reshard" : ", keep");
}

constexpr double kAlgoBound = 1e-10;  // float64: summation order only (see fully_shard_test)

}  // namespace

// A block run twice in a row, and blocks in the order A, B, A: each reused block's
// gradient is the sum over its runs, reduced once, and the block is resharded afterwards.
TEST(FullyShardComposable, ModuleRunMoreThanOnceInOneForward) {
  for (const std::string pattern : {"AA", "ABA", "BAAB"}) {
    for (const auto& o : layouts()) {
      SCOPED_TRACE(pattern + ", " + describe(o));
      Pair p(pattern, 7, o);
      for (int step = 0; step < 4; ++step) {
        p.losses(step, 7).backward();
        p.opt->step();
        if (o.reshard_after_forward) p.expect_resharded("step " + std::to_string(step));
      }
      EXPECT_LE(p.max_rel(), kAlgoBound);
    }
  }
}

// Two models in one process: forward A, forward B, backward A, backward B; and both
// losses summed into one backward. Each matches its own one-process reference.
TEST(FullyShardComposable, TwoRootsInterleaved) {
  for (bool summed : {false, true}) {
    for (const auto& o : layouts()) {
      SCOPED_TRACE(std::string(summed ? "summed losses" : "interleaved") + ", " + describe(o));
      Pair p1("AB", 11, o), p2("BA", 12, o);
      for (int step = 0; step < 4; ++step) {
        at::Tensor l1 = p1.losses(step, 11);
        at::Tensor l2 = p2.losses(step, 12);
        if (summed) {
          (l1 + l2).backward();
        } else {
          l1.backward();
          // p2's backward has not started: its modules must still be as its forward left them.
          l2.backward();
        }
        p1.opt->step();
        p2.opt->step();
        if (o.reshard_after_forward) {
          p1.expect_resharded("model 1, step " + std::to_string(step));
          p2.expect_resharded("model 2, step " + std::to_string(step));
        }
      }
      EXPECT_LE(p1.max_rel(), kAlgoBound) << "model 1";
      EXPECT_LE(p2.max_rel(), kAlgoBound) << "model 2";
    }
  }
}

// A pipeline-style schedule: several micro-batch backwards with gradient sync off, then an
// explicit reduce_grads() per module and one finalize_backward(). The same as one process
// on the whole batch, and bitwise the same as letting the last backward reduce.
TEST(FullyShardComposable, ExplicitReduceGradsAfterMicroBatches) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  const int micro = 3;
  for (const auto& o : layouts()) {
    SCOPED_TRACE(describe(o));
    Pair explicit_run("AB", 5, o), implicit_run("AB", 5, o);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(500 + step);
      at::Tensor x = at::randn({micro * 3 * n, 5}, at::kDouble);
      explicit_run.ref_opt->zero_grad();
      (hp::call(explicit_run.ref, x).pow(2).sum() / n).backward();
      explicit_run.ref_opt->step();
      for (Pair* p : {&explicit_run, &implicit_run}) {
        p->opt->zero_grad();
        const bool expl = p == &explicit_run;
        hp::FSDPHandle root = p->handles.back();
        for (int k = 0; k < micro; ++k) {
          root->set_requires_gradient_sync(!expl && k == micro - 1);
          at::Tensor xs = x.narrow(0, (r * micro + k) * 3, 3);
          hp::call(p->m, xs).pow(2).sum().backward();
          if (expl) {
            for (auto& h : p->handles) EXPECT_FALSE(h->gradients_in_flight());
          }
        }
        if (expl) {
          for (auto& h : p->handles) h->reduce_grads();
          bool in_flight = false;
          for (auto& h : p->handles) in_flight = in_flight || h->gradients_in_flight();
          EXPECT_EQ(in_flight, n > 1) << "reductions are issued by reduce_grads, finished by finalize_backward";
          root->finalize_backward();
          for (auto& h : p->handles) EXPECT_FALSE(h->gradients_in_flight());
          if (o.reshard_after_forward) p->expect_resharded("after reduce_grads");
        }
        p->opt->step();
      }
    }
    EXPECT_LE(explicit_run.max_rel(), kAlgoBound);
    for (size_t i = 0; i < explicit_run.handles.size(); ++i) {
      auto a = explicit_run.handles[i]->parameters(), b = implicit_run.handles[i]->parameters();
      for (size_t j = 0; j < a.size(); ++j) EXPECT_TRUE(at::equal(a[j], b[j])) << "handle " << i << " param " << j;
    }
  }
}

// Activation checkpointing of sharded blocks: the recomputation inside backward gathers the
// parameters and leaves the forward order, prefetching and reductions alone, so gradients
// and parameters are bitwise those of the same sharded run without checkpointing (fp32),
// for blocks used once and a block used twice (A-B-A).
TEST(FullyShardComposable, CheckpointedBlocksMatchBitwise) {
  for (const std::string pattern : {"AB", "ABA"}) {
    for (auto policy : {hp::RecomputePolicy::kFull, hp::RecomputePolicy::kKeepMatmuls}) {
      for (const auto& o : layouts()) {
        const bool full = policy == hp::RecomputePolicy::kFull;
        SCOPED_TRACE(pattern + (full ? ", full recompute, " : ", keep matmuls, ") + describe(o));
        Pair plain(pattern, 9, o, at::kFloat), ckpt(pattern, 9, o, at::kFloat);  // fp32: bitwise is the claim
        ckpt.m->recompute = policy;
        auto w = hp::world();
        const int n = w->size(), r = w->rank();
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(900 + step);
          at::Tensor x = at::randn({3 * n, 5});
          std::vector<std::vector<at::Tensor>> grads;
          for (Pair* p : {&plain, &ckpt}) {
            p->opt->zero_grad();
            hp::call(p->m, x.narrow(0, 3 * r, 3)).pow(2).sum().backward();
            std::vector<at::Tensor> g;
            for (auto& h : p->handles) {
              for (auto& t : h->parameters()) g.push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());
            }
            grads.push_back(g);
            p->opt->step();
            if (o.reshard_after_forward) p->expect_resharded("step " + std::to_string(step));
          }
          ASSERT_EQ(grads[0].size(), grads[1].size());
          for (size_t i = 0; i < grads[0].size(); ++i) {
            ASSERT_TRUE(grads[0][i].defined() && grads[1][i].defined()) << "param " << i;
            if (full) {
              EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << "step " << step << " param " << i;
            } else {
              // The kept matmuls' backward is written out (mm of the flattened rows), in an
              // order libtorch's linear backward may not share: fp32 rounding only.
              EXPECT_TRUE(at::allclose(grads[0][i], grads[1][i], 1e-5, 1e-6)) << "step " << step << " param " << i;
            }
          }
        }
      }
    }
  }
}
