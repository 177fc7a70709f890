// fully_shard's bad-input errors: each raised clearly, before a hang or a crash.
#include <gtest/gtest.h>

#include "fsdp_model.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"
#include "test_util.h"

using hp::test::expect_error;
using hp::test::TinyConfig;
using hp::test::TinyModel;

TEST(FullyShardErrors, ShapesThatDifferAcrossRanksAreCaughtAtFullyShard) {
  auto w = hp::world();
  if (w->size() == 1) GTEST_SKIP() << "needs two ranks";
  TinyConfig c;
  c.ffn = 26 + w->rank();  // every rank builds a different MLP
  TinyModel m(c);
  expect_error([&] { hp::fully_shard(*m->blocks[0]); }, {"fc1.weight", "differs on other ranks"});
}

TEST(FullyShardErrors, AppliedTwiceToOneModule) {
  TinyModel m(TinyConfig{});
  hp::fully_shard(*m->blocks[0]);
  expect_error([&] { hp::fully_shard(*m->blocks[0]); }, {"already applied", "BlockImpl"});
}

// Three dims are fine when one is named dp_shard (the others: dp_replicate, or dims that
// are not data-parallel); without that name fully_shard cannot tell which dim to shard.
TEST(FullyShardErrors, MeshOfThreeDimsWithoutDpShard) {
  auto w = hp::world();
  auto mesh = std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"pp", 1}, {"dp", 1}, {"fsdp", -1}});
  TinyModel m(TinyConfig{});
  hp::FullyShardOptions o;
  o.mesh = mesh;
  expect_error([&] { hp::fully_shard(*m->blocks[0], o); }, {"dp_shard", "got 3 dims"});
}

TEST(FullyShardErrors, ReshardAfterForwardGroupSize) {
  const int n = hp::world()->size();
  TinyModel m(TinyConfig{});
  hp::FullyShardOptions o;
  o.reshard_after_forward_group_size = n + 1;  // never divides n
  expect_error([&] { hp::fully_shard(*m->blocks[0], o); },
               {"reshard_after_forward_group_size=" + std::to_string(n + 1), "does not divide",
                std::to_string(n) + " ranks"});
  o.reshard_after_forward_group_size = -2;
  expect_error([&] { hp::fully_shard(*m->blocks[0], o); }, {"reshard_after_forward_group_size=-2", "positive"});
  o.reshard_after_forward_group_size = 1;
  o.reshard_after_forward = false;
  expect_error([&] { hp::fully_shard(*m->blocks[0], o); }, {"reshard_after_forward=false", "needs true"});
  // Nothing was applied by the failed calls: a valid one still works.
  o.reshard_after_forward = true;
  EXPECT_NE(hp::fully_shard(*m->blocks[0], o), nullptr);
}

namespace {
// A root whose forward calls a sharded block without hp::call.
struct BypassImpl : torch::nn::Module {
  explicit BypassImpl(const TinyConfig& c) { block = register_module("block", hp::test::Block(c)); }
  at::Tensor forward(const at::Tensor& x) { return block->forward(x); }
  hp::test::Block block{nullptr};
};
TORCH_MODULE(Bypass);
}  // namespace

TEST(FullyShardErrors, SharedModuleRunOutsideTheCallBoundaryIsNamed) {
  if (hp::world()->size() == 1) {
    GTEST_SKIP() << "with one shard the module's parameters alias their shards and are never freed, "
                    "so a direct forward is correct";
  }
  TinyConfig c;
  Bypass root(c);
  hp::fully_shard(*root->block);
  hp::fully_shard(*root);
  at::Tensor x = at::randn({2, c.seq, c.dim});
  expect_error([&] { hp::call(root, x); }, {"BlockImpl (fully_shard #", "outside hp::call", "n1.weight"});
  // Through hp::call it works.
  EXPECT_EQ(hp::call(root->block, x).sizes(), x.sizes());
}

namespace {
// A module whose forward reads its child's weight itself before calling the child
// (`early`), or calls the child's forward directly, bypassing hp::call (`direct`).
struct EarlyReadImpl : torch::nn::Module {
  EarlyReadImpl(int64_t dim, bool direct) : direct(direct) {
    first = register_module("first", torch::nn::Linear(dim, dim));
    second = register_module("second", torch::nn::Linear(dim, dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = hp::call(first, x);
    if (direct) return second->forward(h);
    if (!early) return hp::call(second, h);
    at::Tensor scale = second->weight.sum();  // read before hp::call(second)
    return hp::call(second, h) * scale;
  }
  bool direct, early = true;
  torch::nn::Linear first{nullptr}, second{nullptr};
};
TORCH_MODULE(EarlyRead);
}  // namespace

// wait_per_submodule waits for a parameter only when its submodule is called through
// hp::call: a read before that, which autograd records, is an error naming the parameter
// and its submodule (raised when the submodule is called, or at the end of the module's
// forward for one never called), not a value from a gather still in flight.
TEST(FullyShardErrors, WaitPerSubmoduleNamesAParameterReadBeforeItsSubmodule) {
  if (hp::world()->size() == 1) {
    GTEST_SKIP() << "with one shard the parameters alias their shards: nothing is gathered";
  }
  hp::FullyShardOptions o;
  o.wait_per_submodule = true;
  const at::Tensor x = at::randn({3, 8});
  for (bool direct : {false, true}) {
    EarlyRead m(8, direct);
    hp::fully_shard(*m, o);
    expect_error([&] { hp::call(m, x); },
                 {"wait_per_submodule", "'second.weight'", "submodule second", "hp::call(submodule"});
    // The module stays usable, and without grad mode the whole module is waited for at its
    // start: the same forward reads gathered parameters.
    at::NoGradGuard no_grad;
    EXPECT_EQ(hp::call(m, x).sizes(), x.sizes());
  }
  // Called as the contract says, the module runs.
  EarlyRead ok(8, false);
  ok->early = false;
  hp::fully_shard(*ok, o);
  EXPECT_EQ(hp::call(ok, x).sizes(), x.sizes());
  o.comm_fusion = true;
  EarlyRead fused(8, false);
  expect_error([&] { hp::fully_shard(*fused, o); }, {"wait_per_submodule with comm_fusion", "not supported yet"});
}

namespace {
// A module with a parameter of its own (waited for at its start) and a Linear child.
struct ScaledImpl : torch::nn::Module {
  explicit ScaledImpl(int64_t dim) {
    scale = register_parameter("scale", torch::ones({dim}));
    lin = register_module("lin", torch::nn::Linear(dim, dim));
  }
  at::Tensor forward(const at::Tensor& x) { return hp::call(lin, x) * scale; }
  at::Tensor scale;
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Scaled);
// A root that reads its second child's own parameter between the first child, which
// prefetches the second, and the second's call.
struct ReadsAheadImpl : torch::nn::Module {
  explicit ReadsAheadImpl(int64_t dim) {
    a = register_module("a", torch::nn::Linear(dim, dim));
    b = register_module("b", Scaled(dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = hp::call(a, x);  // issues b's gather (a prefetches b)
    h = h * b->scale.sum();          // b's gather is in flight
    return hp::call(b, h);
  }
  torch::nn::Linear a{nullptr};
  Scaled b{nullptr};
};
TORCH_MODULE(ReadsAhead);
}  // namespace

// A module's own parameter is waited for at its start; read earlier, while a prefetch of
// it is in flight, the error says so.
TEST(FullyShardErrors, WaitPerSubmoduleNamesAModulesOwnParameterReadBeforeItsStart) {
  if (hp::world()->size() == 1) GTEST_SKIP() << "with one shard nothing is gathered";
  if (!hp::fsdp_overlap()) GTEST_SKIP() << "the prefetch needs overlap on (the tests' default)";
  hp::FullyShardOptions o;
  o.wait_per_submodule = true;
  ReadsAhead m(8);
  hp::FSDPHandle b = hp::fully_shard(*m->b, o);
  hp::FSDPHandle a = hp::fully_shard(*m->a, o);
  a->set_modules_to_forward_prefetch({b});
  hp::fully_shard(*m, o);
  expect_error([&] { hp::call(m, at::randn({3, 8})); },
               {"wait_per_submodule", "'scale'", "the module's own start"});
}

TEST(FullyShardErrors, NoGradientIsInFlightWhenBackwardReturns) {
  // Reductions finish inside backward (an end-of-backward callback waits for them), so an
  // optimizer step can never see a gradient that is still being reduced. With more than
  // one rank the last block's reduction is still held when the embedding's output gradient
  // arrives (the flag can be true); once backward returns nothing is.
  const bool reduces = hp::world()->size() > 1;  // one rank: the reduction is a cast, done at once
  TinyConfig c;
  TinyModel m(c);
  std::vector<hp::FSDPHandle> hs;
  for (auto& b : m->blocks) hs.push_back(hp::fully_shard(*b));
  hs.push_back(hp::fully_shard(*m));
  int seen_in_flight = -1;
  hp::ForwardHooks probe;
  probe.cast_output = [&](torch::nn::Module&, const at::Tensor& t) {
    at::Tensor out = t.view_as(t);  // a hook of our own on the embedding's output
    out.register_hook([&](const at::Tensor&) { seen_in_flight = hs[c.layers - 1]->gradients_in_flight() ? 1 : 0; });
    return out;
  };
  hp::register_forward_hooks(*m->emb, probe);
  at::Tensor x = at::randint(c.vocab, {2, c.seq}, at::kLong);
  hp::call(m, x, x).backward();
  EXPECT_EQ(seen_in_flight, reduces ? 1 : 0) << "the last block's reduction, seen from inside backward";
  for (auto& h : hs) {
    EXPECT_FALSE(h->gradients_in_flight());
    for (auto& p : h->parameters()) EXPECT_TRUE(p.grad().defined());
  }
}

// The state machines (src/fsdp/group.h): the parameters cannot be resharded, nor the
// gradients reduced, while the module's forward runs. The error names the module and both
// states, nothing has been freed or issued, and the module trains normally afterwards.
TEST(FullyShardErrors, IllegalStateTransitionsNameTheModuleAndBothStates) {
  TinyConfig c;
  TinyModel m(c);
  hp::FullyShardOptions o;
  o.mp_policy.param_dtype = at::kBFloat16;  // the unsharded parameters have storage of their own, even at world 1
  for (auto& b : m->blocks) hp::fully_shard(*b, o);
  hp::FSDPHandle root = hp::fully_shard(*m, o);
  std::function<void()> inside;  // run inside the root's forward, before the embedding
  hp::ForwardHooks probe;
  probe.pre = [&](torch::nn::Module&) {
    if (inside) inside();
  };
  hp::register_forward_hooks(*m->emb, probe);
  at::Tensor x = at::randint(c.vocab, {2, c.seq}, at::kLong);
  inside = [&] { root->reshard(); };
  expect_error([&] { hp::call(m, x, x); },
               {"TinyModelImpl (fully_shard #", "from unsharded to sharded", "training state forward"});
  inside = [&] { root->reduce_grads(); };
  expect_error([&] { hp::call(m, x, x); },
               {"TinyModelImpl (fully_shard #", "from training state forward to post-backward"});
  inside = nullptr;
  hp::call(m, x, x).backward();
  for (auto& p : root->parameters()) EXPECT_TRUE(p.grad().defined());
}
