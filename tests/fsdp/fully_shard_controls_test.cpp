// fully_shard's runtime controls and corner shapes, against references computed here.
#include <gtest/gtest.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "hp/core/memory.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"
#include "fsdp/fsdp_model.h"
#include "fsdp_test_util.h"
#include "test_util.h"

namespace {

// y = b(a(x)) plus an unused branch c: c's parameters get no gradient.
struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() {
    a = register_module("a", torch::nn::Linear(5, 3));  // weight dim 0 = 3 < 4 ranks
    b = register_module("b", torch::nn::Linear(3, 2));
    c = register_module("c", torch::nn::Linear(3, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return hp::call(b, hp::call(a, x)); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(TwoLayer);

// Gradient of sum(model(x)) over the global batch, computed in one process.
std::vector<at::Tensor> reference_grads(const at::Tensor& x) {
  torch::manual_seed(3);
  TwoLayer ref;
  hp::call(ref, x).sum().backward();
  std::vector<at::Tensor> g;
  for (auto& p : ref->parameters()) g.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
  return g;
}

std::vector<at::Tensor> full_grads(const hp::FSDPHandle& h) {
  auto w = hp::world();
  std::vector<at::Tensor> out;
  auto params = h->parameters();
  auto sd = h->state_dict();
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor full = at::zeros(sd[i].global_shape);
    if (params[i].size(0) > 0 && params[i].grad().defined()) {
      full.narrow(0, sd[i].row_offset, params[i].size(0)).copy_(params[i].grad());
    }
    w->all_reduce(full).wait();
    out.push_back(full);
  }
  return out;
}

}  // namespace

TEST(FullyShardControls, ReduceOpSumDivideFactorAndUnusedParameters) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  torch::manual_seed(11);
  at::Tensor x = at::randn({4 * n, 5});
  std::vector<at::Tensor> want = reference_grads(x);  // sum over the global batch
  for (int mode = 0; mode < 3; ++mode) {
    torch::manual_seed(3);
    TwoLayer m;
    hp::FSDPHandle h = hp::fully_shard(*m);
    if (mode == 1) h->set_reduce_op(hp::ReduceOp::SUM);
    if (mode == 2) h->set_gradient_divide_factor(0.5);
    hp::call(m, x.narrow(0, 4 * r, 4)).sum().backward();
    auto got = full_grads(h);
    // Each rank's loss is a sum over its rows: SUM over ranks gives the global gradient,
    // AVG divides it by n, a divide factor f divides the SUM by f.
    double scale = mode == 0 ? 1.0 / n : mode == 1 ? 1.0 : 2.0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::allclose(got[i], want[i] * scale, 1e-5, 1e-6)) << "mode " << mode << " param " << i;
    }
    // c got a gradient on no rank: its .grad stays undefined on every rank, as in one
    // process (not a zero gradient AdamW would decay and step with).
    auto params = h->parameters();
    EXPECT_FALSE(params[4].grad().defined()) << "mode " << mode;
    EXPECT_FALSE(params[5].grad().defined()) << "mode " << mode;
  }
}

namespace {

// y = b(a(x)) (+ c(a(x)) on the rows where `use_c` says so): c's parameters get a gradient
// in some steps, on some ranks, or nowhere.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    a = register_module("a", torch::nn::Linear(5, 3));
    b = register_module("b", torch::nn::Linear(3, 2));
    c = register_module("c", torch::nn::Linear(3, 2));
  }
  at::Tensor forward(const at::Tensor& x, bool use_c) {
    at::Tensor h = hp::call(a, x);
    at::Tensor y = hp::call(b, h);
    return use_c ? y + hp::call(c, h) : y;
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Branchy);

// The model to shard and its one-process reference: the same values, in float64.
std::pair<Branchy, Branchy> twin_branchy(uint64_t seed) {
  torch::manual_seed(seed);
  Branchy ref;
  torch::manual_seed(seed);
  Branchy m;
  ref->to(at::kDouble);
  m->to(at::kDouble);
  return {ref, m};
}

}  // namespace

// Parameters that get no gradient in a step (a branch not taken): with gradients set to
// none between steps, AdamW must skip them exactly as in one process. float64, so the only
// difference allowed is summation order (1e-10); the old behaviour (a zero gradient on
// every rank) applies weight decay and momentum to c and misses by ~1e-3. Also: c used on
// rank 0 only gets the same gradient on every rank (the others contribute zeros).
TEST(FullyShardControls, UnusedParametersMatchOneProcess) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  const std::vector<bool> uses = {true, false, true, false, false};  // c's use, step by step
  for (bool fusion : {false, true}) {
    for (bool c_own_group : {false, true}) {
      SCOPED_TRACE(std::string(fusion ? "fused" : "unfused") + (c_own_group ? ", c sharded alone" : ", c in the root"));
      auto [ref, m] = twin_branchy(21);
      hp::FullyShardOptions o;
      o.comm_fusion = fusion;
      std::vector<hp::FSDPHandle> hs = {hp::fully_shard(*m->a, o)};
      if (c_own_group) hs.push_back(hp::fully_shard(*m->c, o));
      hs.push_back(hp::fully_shard(*m, o));
      std::vector<at::Tensor> params;
      for (auto& h : hs) {
        for (auto& t : h->parameters()) params.push_back(t);
      }
      auto adam = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
      torch::optim::AdamW opt(params, adam), ref_opt(ref->parameters(), adam);
      for (size_t step = 0; step < uses.size(); ++step) {
        torch::manual_seed(100 + static_cast<int>(step));
        at::Tensor x = at::randn({2 * n, 5}, at::kDouble);
        for (auto& t : ref->parameters()) t.mutable_grad() = at::Tensor();  // zero_grad(set_to_none)
        for (auto& t : params) t.mutable_grad() = at::Tensor();
        (hp::call(ref, x, uses[step]).pow(2).sum() / n).backward();
        ref_opt.step();
        hp::call(m, x.narrow(0, 2 * r, 2), uses[step]).pow(2).sum().backward();
        for (auto& h : hs) {  // c's shard has a gradient exactly when c ran
          if (&h->module() != m->c.get()) continue;
          for (auto& t : h->parameters()) EXPECT_EQ(t.grad().defined(), uses[step]) << "step " << step;
        }
        opt.step();
      }
      std::vector<at::Tensor> want;
      if (c_own_group) {
        want = {ref->a->weight, ref->a->bias, ref->c->weight, ref->c->bias, ref->b->weight, ref->b->bias};
      } else {
        want = {ref->a->weight, ref->a->bias, ref->b->weight, ref->b->bias, ref->c->weight, ref->c->bias};
      }
      EXPECT_LE(hp::test::max_rel_to_reference(hs, want, w), 1e-10);
    }
  }
  if (n == 1) return;
  // c used by rank 0's rows only: every rank gets the global gradient (AVG over ranks).
  auto [ref, m] = twin_branchy(22);
  // c in the root's group, which runs on every rank (a module that runs on some ranks only
  // would issue its collectives on those alone).
  hp::FSDPHandle hc = hp::fully_shard(*m);
  at::Tensor x = at::randn({2 * n, 5}, at::kDouble);
  at::Tensor ref_loss = hp::call(ref, x.narrow(0, 0, 2), true).pow(2).sum();
  for (int q = 1; q < n; ++q) ref_loss = ref_loss + hp::call(ref, x.narrow(0, 2 * q, 2), false).pow(2).sum();
  (ref_loss / n).backward();
  hp::call(m, x.narrow(0, 2 * r, 2), r == 0).pow(2).sum().backward();
  auto sd = hc->state_dict();
  auto ps = hc->parameters();
  for (size_t i = 4; i < 6; ++i) {  // c.weight, c.bias
    ASSERT_EQ(sd[i].name.rfind("c.", 0), 0u) << sd[i].name;
    ASSERT_TRUE(ps[i].grad().defined()) << "rank " << r << " param " << sd[i].name;
    at::Tensor full = hp::test::reassemble(sd[i], ps[i].grad(), w);
    at::Tensor want = i == 4 ? ref->c->weight.grad() : ref->c->bias.grad();
    // float64, one backward: the ranks' partial sums against one sum, summation order only.
    EXPECT_LE((full - want).abs().max().item<double>(), 1e-12 * (want.abs().max().item<double>() + 1));
  }
}

TEST(FullyShardControls, ExplicitUnshardReshardAndPrefetch) {
  torch::manual_seed(3);
  TwoLayer m;
  hp::FSDPHandle ha = hp::fully_shard(*m->a);
  hp::FSDPHandle hb = hp::fully_shard(*m->b);
  hp::FSDPHandle root = hp::fully_shard(*m);
  const bool one_shard = hp::world()->size() == 1;  // parameters alias their shards
  EXPECT_EQ(ha->is_unsharded(), false);
  ha->unshard(/*async=*/true);
  ha->wait_for_unshard();
  EXPECT_TRUE(ha->is_unsharded());
  EXPECT_EQ(m->a->weight.sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_GT(m->a->weight.storage().nbytes(), 0u);
  ha->reshard();
  if (!one_shard) {
    EXPECT_FALSE(ha->is_unsharded());
    EXPECT_EQ(m->a->weight.storage().nbytes(), 0u);
  } else {
    EXPECT_GT(m->a->weight.storage().nbytes(), 0u);  // nothing to free: it is the shard
  }
  // a prefetches b in forward: when b's forward starts, b was gathered by a's pre hook.
  ha->set_modules_to_forward_prefetch({hb});
  bool b_ready_before_its_hook = false;
  hp::ForwardHooks probe;
  probe.pre = [&](torch::nn::Module&) { b_ready_before_its_hook = hb->unshard_in_flight() || hb->is_unsharded(); };
  hp::register_forward_hooks(*m->a, probe);  // runs after a's own pre hook (and its prefetch)
  at::Tensor x = at::randn({4, 5});
  at::Tensor y = hp::call(m, x);
  EXPECT_TRUE(b_ready_before_its_hook || one_shard);
  // The forward is the plain computation on the full parameters: an unsharded copy built
  // from the same seed, never touched by fully_shard, is the reference; and an explicit
  // unshard gathers exactly its parameters.
  torch::manual_seed(3);
  TwoLayer plain;
  at::Tensor want = plain->b->forward(plain->a->forward(x));
  // fp32, the same ops on the same values; the tolerance covers only BLAS blocking that may
  // differ between the two calls (a wrong gather is off by O(1)).
  EXPECT_TRUE(at::allclose(y, want, 1e-6, 1e-7));
  ha->unshard();
  hb->unshard();
  EXPECT_TRUE(at::equal(m->a->weight, plain->a->weight));
  EXPECT_TRUE(at::equal(m->a->bias, plain->a->bias));
  EXPECT_TRUE(at::equal(m->b->weight, plain->b->weight));
  ha->reshard();
  hb->reshard();
}

namespace {
// A module with a buffer (running statistics kind) and a parameter to ignore.
struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    scale = register_buffer("scale", at::full({4}, 2.0));
    keep = register_parameter("keep", at::ones({3}));
  }
  at::Tensor forward(const at::Tensor& x) { return hp::call(lin, x) * scale + keep.sum(); }
  torch::nn::Linear lin{nullptr};
  at::Tensor scale, keep;
};
TORCH_MODULE(WithBuffer);
}  // namespace

TEST(FullyShardControls, IgnoredParametersAndBuffersStayWhole) {
  WithBuffer m;
  hp::FullyShardOptions o;
  o.ignored_params = {m->keep};
  hp::FSDPHandle h = hp::fully_shard(*m, o);
  // lin.weight and lin.bias are sharded; keep and the buffer are left alone.
  EXPECT_EQ(h->parameters().size(), 2u);
  EXPECT_EQ(m->keep.storage().nbytes(), 3u * 4);
  EXPECT_TRUE(at::equal(m->scale, at::full({4}, 2.0)));
  at::Tensor y = hp::call(m, at::ones({2, 4}));
  y.sum().backward();
  EXPECT_TRUE(at::equal(m->scale, at::full({4}, 2.0)));
  // The ignored parameter keeps its ordinary, unreduced local gradient.
  ASSERT_TRUE(m->keep.grad().defined());
  EXPECT_TRUE(at::equal(m->keep.grad(), at::full({3}, 8.0)));  // d(sum over 2x4 outputs of keep.sum())
}

TEST(FullyShardControls, ReshardAfterBackwardAndLastBackward) {
  if (hp::world()->size() == 1) GTEST_SKIP() << "one shard aliases its parameters: nothing to reshard";
  torch::manual_seed(3);
  TwoLayer m;
  hp::FSDPHandle ha = hp::fully_shard(*m->a);
  hp::FSDPHandle root = hp::fully_shard(*m);
  at::Tensor x = at::randn({4, 5});
  // Defaults: resharded after backward.
  hp::call(m, x).sum().backward();
  EXPECT_FALSE(ha->is_unsharded());
  // Not the last backward: stay gathered for the next micro-batch.
  root->set_is_last_backward(false);
  hp::call(m, x).sum().backward();
  EXPECT_TRUE(ha->is_unsharded());
  root->set_is_last_backward(true);
  ha->reshard();
  // reshard_after_backward off on a, with reshard after forward off too.
  ha->set_reshard_after_backward(false);
  hp::call(m, x).sum().backward();
  EXPECT_TRUE(ha->is_unsharded());
  ha->reshard();
  // Explicit backward prefetch of a from the root: gathered before a's backward starts.
  ha->set_reshard_after_backward(true);
  root->set_modules_to_backward_prefetch({ha});
  hp::call(m, x).sum().backward();
  EXPECT_FALSE(ha->is_unsharded());
  for (auto& p : ha->parameters()) EXPECT_TRUE(p.grad().defined());
}

// In backward, each parameter's unsharded storage is freed as soon as its gradient has
// been accumulated, not when the whole module is done: while the first layer's gradient
// is being computed, the second layer's weight (whose gradient came first) is gone and the
// first layer's is still there. Not when the module stays gathered after this backward.
TEST(FullyShardControls, ParametersFreedAsTheirGradientsArrive) {
  struct Net : torch::nn::Module {
    Net() {
      l1 = register_module("l1", torch::nn::Linear(6, 5));
      l2 = register_module("l2", torch::nn::Linear(5, 4));
    }
    at::Tensor forward(const at::Tensor& x) { return hp::call(l2, hp::call(l1, x)); }
    torch::nn::Linear l1{nullptr}, l2{nullptr};
  };
  auto net = std::make_shared<Net>();
  hp::FullyShardOptions o;
  o.reshard_after_forward = false;
  o.mp_policy.param_dtype = at::kBFloat16;  // never aliased, even with one shard
  hp::FSDPHandle h = hp::fully_shard(*net, o);
  std::vector<std::pair<size_t, size_t>> seen;  // (l2.weight bytes, l1.weight bytes) at l1's gradient
  net->l1->weight.register_hook([&](const at::Tensor&) {
    seen.emplace_back(net->l2->weight.storage().nbytes(), net->l1->weight.storage().nbytes());
  });
  at::Tensor x = at::randn({3, 6});
  hp::call(net, x).sum().backward();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].first, 0u) << "l2.weight still allocated after its gradient arrived";
  EXPECT_GT(seen[0].second, 0u) << "l1.weight freed before its gradient was computed";
  EXPECT_FALSE(h->is_unsharded());
  // Staying gathered for another micro-batch: nothing is freed.
  h->set_is_last_backward(false);
  hp::call(net, x).sum().backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[1].first, 0u);
  EXPECT_TRUE(h->is_unsharded());
  h->set_is_last_backward(true);
  h->reshard();
}

// reshard_after_forward_group_size: after forward each rank holds its group's share of
// every unsharded (padded) parameter, no unsharded storage, and backward all-gathers over
// the group of 2 (traced under its own communicator), with the gradients of one process.
TEST(FullyShardControls, ReshardAfterForwardToGroupsOfTwo) {
  auto w = hp::world();
  if (w->size() % 2 != 0 || w->size() < 4) GTEST_SKIP() << "needs a group of 2 smaller than the world";
  const int n = w->size();
  torch::manual_seed(3);
  TwoLayer m;
  hp::FullyShardOptions o;
  o.reshard_after_forward_group_size = 2;
  auto h = hp::fully_shard(*m, o);
  torch::manual_seed(4);
  at::Tensor x = at::randn({2 * n, 5});
  at::Tensor xs = x.narrow(0, 2 * w->rank(), 2);
  // Padded numel of every parameter: dim 0 rounded up to a multiple of the world.
  int64_t padded = 0;
  for (const auto& st : h->state_dict()) {
    int64_t row = 1;
    for (size_t d = 1; d < st.global_shape.size(); ++d) row *= st.global_shape[d];
    padded += (st.global_shape[0] + n - 1) / n * n * row;
  }
  hp::call(m, xs).sum().backward();  // warm-up
  for (auto& p : h->parameters()) p.mutable_grad() = at::Tensor();
  const int64_t before = hp::memory::current_bytes();
  {
    // Without grad mode no backward follows: nothing is kept after forward.
    at::NoGradGuard no_grad;
    at::Tensor out = hp::call(m, xs);
    EXPECT_LT(hp::memory::current_bytes() - before, padded / 2 * 4) << "the group's shares were kept";
  }
  hp::trace::enable(::testing::TempDir() + "hp_group_trace");
  hp::trace::clear();
  at::Tensor loss = hp::call(m, xs).sum();
  EXPECT_FALSE(h->is_unsharded());
  for (auto& t : m->parameters()) EXPECT_EQ(t.storage().nbytes(), 0u);
  // Held after forward: half of every padded parameter (fp32), plus the tiny activations.
  const int64_t held = hp::memory::current_bytes() - before;
  EXPECT_GE(held, padded / 2 * 4);
  EXPECT_LT(held, padded / 2 * 4 + 4096);
  loss.backward();
  hp::trace::disable();
  int gathered_in_pairs = 0;
  for (const auto& e : hp::trace::events()) {
    if (e.cat == "comm" && e.name == "all_gather" && e.args.find("post-forward2") != std::string::npos) ++gathered_in_pairs;
  }
  EXPECT_EQ(gathered_in_pairs, 6) << "one all-gather per parameter over the pair, before backward";
  auto want = reference_grads(x);
  auto got = full_grads(h);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    // The mean over ranks of sums of per-rank slices: the global sum divided by n.
    EXPECT_TRUE(at::allclose(got[i], want[i] / n, 1e-5, 1e-6)) << "parameter " << i;
  }
}

// The root of a model whose blocks are sharded keeps its parameters from forward to its
// backward (which starts first and would gather them again at once), and so does the last
// block to finish forward (the first block backward reaches); the other blocks reshard.
// Without grad mode (no backward follows) they reshard too; after backward everything is
// resharded. A forward whose backward never came leaves nothing kept into the next
// forward: an optimizer step in between must be seen. (Their gradients: every parity test
// runs with this.)
TEST(FullyShardControls, RootKeepsItsParametersForBackward) {
  auto w = hp::world();
  if (w->size() < 2) GTEST_SKIP() << "one rank holds everything: nothing is resharded";
  hp::test::TinyConfig c;
  torch::manual_seed(5);
  hp::test::TinyModel m(c);
  std::vector<hp::FSDPHandle> blocks;
  for (auto& b : m->blocks) blocks.push_back(hp::fully_shard(*b));
  auto root = hp::fully_shard(*m);
  at::Tensor x = at::randint(c.vocab, {2, c.seq}), y = at::randint(c.vocab, {2, c.seq});
  {
    at::NoGradGuard ng;
    hp::call(m, x, y);
    EXPECT_FALSE(root->is_unsharded()) << "kept without a backward to follow";
    for (auto& b : blocks) EXPECT_FALSE(b->is_unsharded()) << "kept without a backward to follow";
  }
  at::Tensor loss = hp::call(m, x, y);
  EXPECT_TRUE(root->is_unsharded()) << "the root resharded after forward";
  for (size_t i = 0; i + 1 < blocks.size(); ++i) EXPECT_FALSE(blocks[i]->is_unsharded()) << "block " << i;
  EXPECT_TRUE(blocks.back()->is_unsharded()) << "the last block resharded after forward";
  loss.backward();
  EXPECT_FALSE(root->is_unsharded());
  for (auto& b : blocks) EXPECT_FALSE(b->is_unsharded());

  // A forward with no backward, then a change of the shards (as an optimizer step makes),
  // then a forward: it must compute with the changed values, not what the first one kept.
  // Reference: the same model in one process (every rank holds the same initial values).
  torch::manual_seed(5);
  hp::test::TinyModel ref(c);
  hp::call(m, x, y);  // grad mode on, never backpropagated: the root and the last block kept
  ASSERT_TRUE(blocks.back()->is_unsharded());
  {
    at::NoGradGuard ng;
    for (auto& p : root->parameters()) p.mul_(0.5);  // the local shards
    for (auto& b : blocks) {
      for (auto& p : b->parameters()) p.mul_(0.5);
    }
    for (auto& p : ref->parameters()) p.mul_(0.5);
  }
  at::Tensor got = hp::call(m, x, y), want = hp::call(ref, x, y);
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << got.item<double>() << " vs " << want.item<double>();
  got.backward();
}
