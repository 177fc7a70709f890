// Context parallelism against attention over the whole sequence in one process.
//
// Every rank draws the same whole sequence (queries, keys, values and the output's
// gradient, float64), takes its own piece with shard() (so each CP rank holds different
// tokens), and runs ContextParallel::attention on it. The reference is attention written
// out here: scores, a causal mask by position, softmax and the weighted sum over the whole
// sequence, differentiated by autograd. Output and gradients of the piece must match the
// reference's same tokens within 1e-12 (float64: the methods differ from it only in the
// order of the sums and in the log-sum-exp merge).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../test_util.h"
#include "hp/core/trace.h"
#include "hp/cp/context_parallel.h"
#include "hp/runtime.h"

namespace {

using hp::cp::ContextParallel;
using hp::cp::Mask;
using hp::cp::Method;
using hp::cp::SequenceSplit;
using hp::cp::Split;
const auto kF64 = at::TensorOptions().dtype(at::kDouble);

std::vector<int64_t> values(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// ---- the split, by hand -------------------------------------------------------------------

TEST(SequenceSplit, HeadTailTakesChunksRAndTheirMirror) {
  // S 8, cp 4: 8 chunks of one token; rank r holds r and 7 - r.
  EXPECT_EQ(values(SequenceSplit(8, 4).order()), (std::vector<int64_t>{0, 7, 1, 6, 2, 5, 3, 4}));
  // S 8, cp 2: 4 chunks of two tokens; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(values(SequenceSplit(8, 2).positions(0)), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(values(SequenceSplit(8, 2).positions(1)), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(values(SequenceSplit(12, 3).order()), (std::vector<int64_t>{0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7}));
  EXPECT_EQ(values(SequenceSplit(6, 3, Split::kContiguous).positions(2)), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(values(SequenceSplit(6, 1).positions(0)), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
}

TEST(SequenceSplit, ShardAndRestoreAreInverse) {
  // Tokens and their positions travel together: the piece of arange(S) is the positions.
  for (Split sp : {Split::kHeadTail, Split::kContiguous}) {
    const SequenceSplit s(24, 3, sp);
    at::Tensor x = at::randn({2, 24, 5}, kF64);
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < 3; ++r) {
      pieces.push_back(hp::cp::shard(x, 1, s, r));
      EXPECT_TRUE(at::equal(hp::cp::shard(at::arange(24), 0, s, r), s.positions(r)));
    }
    EXPECT_TRUE(at::equal(hp::cp::restore(at::cat(pieces, 1), 1, s), x));
  }
}

TEST(SequenceSplit, BadSizesAreClearErrors) {
  hp::test::expect_error([] { SequenceSplit(10, 2); }, {"10 tokens is not divisible by the 4 chunks", "head_tail", "cp=2"});
  hp::test::expect_error([] { SequenceSplit(6, 4); }, {"6 tokens is shorter than the 8 chunks"});
  hp::test::expect_error([] { SequenceSplit(7, 2, Split::kContiguous); }, {"7 tokens is not divisible by the 2 chunks"});
  hp::test::expect_error([] { SequenceSplit(8, 0); }, {"cp must be at least 1, got 0"});
  hp::test::expect_error([] { hp::cp::shard(at::zeros({2, 6}), 1, SequenceSplit(8, 2), 0); },
                         {"size 6 along dim 1 is not the split's sequence of 8"});
}

// ---- attention against the whole sequence --------------------------------------------------

// Attention over the whole sequence, written out: kv heads repeated for their query heads.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Mask mask) {
  const int64_t group = q.size(1) / k.size(1), S = q.size(2);
  at::Tensor s = q.matmul(k.repeat_interleave(group, 1).transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  if (mask == Mask::kCausal) s = s.masked_fill(at::ones({S, S}, at::kBool).triu(1), -INFINITY);
  return s.softmax(-1).matmul(v.repeat_interleave(group, 1));
}

struct Whole {
  at::Tensor q, k, v, g;  // the whole sequence, and the output's gradient
  at::Tensor out, dq, dk, dv;
};

// heads 8, kv heads 4 (so ulysses divides at cp 1, 2, 4); q/k head size 6, v head size 4
// (as MLA's differ).
Whole whole_sequence(int64_t S, Mask mask) {
  at::manual_seed(77);
  Whole w;
  w.q = at::randn({2, 8, S, 6}, kF64).requires_grad_(true);
  w.k = at::randn({2, 4, S, 6}, kF64).requires_grad_(true);
  w.v = at::randn({2, 4, S, 4}, kF64).requires_grad_(true);
  w.g = at::randn({2, 8, S, 4}, kF64);
  w.out = reference_attention(w.q, w.k, w.v, mask);
  auto grads = torch::autograd::grad({w.out}, {w.q, w.k, w.v}, {w.g});
  w.dq = grads[0], w.dk = grads[1], w.dv = grads[2];
  return w;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

using Case = std::tuple<Method, Split, Mask>;

class Attention : public ::testing::TestWithParam<Case> {};

TEST_P(Attention, MatchesTheWholeSequenceInOneProcess) {
  auto world = hp::world();
  const auto [method, split, mask] = GetParam();
  const int cp = world->size();
  if (method == Method::kUlysses && 4 % cp != 0) GTEST_SKIP() << "4 kv heads over cp=" << cp;
  ContextParallel ctx(world, {method, split});
  const int64_t S = 24;
  const Whole w = whole_sequence(S, mask);
  const SequenceSplit s = ctx.split_of(S);
  auto piece = [&](const at::Tensor& t) { return hp::cp::shard(t.detach(), 2, s, ctx.rank()); };
  at::Tensor q = piece(w.q).requires_grad_(true), k = piece(w.k).requires_grad_(true), v = piece(w.v).requires_grad_(true);
  at::Tensor out = ctx.attention(q, k, v, mask);
  ASSERT_EQ(out.sizes(), piece(w.out).sizes());
  EXPECT_LE(max_diff(out, piece(w.out)), 1e-12);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {piece(w.g)});
  EXPECT_LE(max_diff(grads[0], piece(w.dq)), 1e-12) << "dq";
  EXPECT_LE(max_diff(grads[1], piece(w.dk)), 1e-12) << "dk";
  EXPECT_LE(max_diff(grads[2], piece(w.dv)), 1e-12) << "dv";
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  const auto [m, sp, mask] = i.param;
  return std::string(hp::cp::method_name(m)) + "_" + hp::cp::split_name(sp) + (mask == Mask::kCausal ? "_causal" : "_full");
}

INSTANTIATE_TEST_SUITE_P(
    CP, Attention,
    ::testing::Values(Case{Method::kRing, Split::kHeadTail, Mask::kCausal}, Case{Method::kRing, Split::kContiguous, Mask::kCausal},
                      Case{Method::kRing, Split::kContiguous, Mask::kNone},
                      Case{Method::kAllGather, Split::kHeadTail, Mask::kCausal},
                      Case{Method::kAllGather, Split::kContiguous, Mask::kCausal},
                      Case{Method::kAllGather, Split::kContiguous, Mask::kNone},
                      Case{Method::kUlysses, Split::kHeadTail, Mask::kCausal},
                      Case{Method::kUlysses, Split::kContiguous, Mask::kNone}),
    case_name);

// A float32 run of the ring against the float64 reference: the merge and the backward's
// recomputed probabilities in float32, each block's sums over at most S terms of values
// of order 1: within a few hundred float32 ulps (2^-23 ≈ 1.2e-7) of the exact values.
TEST(AttentionFloat32, RingWithinFloat32Rounding) {
  auto world = hp::world();
  ContextParallel ctx(world, {Method::kRing, Split::kHeadTail});
  const Whole w = whole_sequence(24, Mask::kCausal);
  const SequenceSplit s = ctx.split_of(24);
  auto piece = [&](const at::Tensor& t) { return hp::cp::shard(t.detach(), 2, s, ctx.rank()); };
  auto f32 = [&](const at::Tensor& t) { return piece(t).to(at::kFloat).requires_grad_(true); };
  at::Tensor q = f32(w.q), k = f32(w.k), v = f32(w.v);
  at::Tensor out = ctx.attention(q, k, v, Mask::kCausal);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  auto grads = torch::autograd::grad({out}, {q, k, v}, {piece(w.g).to(at::kFloat)});
  EXPECT_LE(max_diff(out.to(at::kDouble), piece(w.out)), 1e-5);
  EXPECT_LE(max_diff(grads[0].to(at::kDouble), piece(w.dq)), 1e-5);
  EXPECT_LE(max_diff(grads[1].to(at::kDouble), piece(w.dk)), 1e-5);
  EXPECT_LE(max_diff(grads[2].to(at::kDouble), piece(w.dv)), 1e-5);
}

// ---- work and communication, counted --------------------------------------------------------

// Under head-tail every rank computes 2cp+1 blocks of c×c scores (c = S / 2cp): 3 at its
// own keys (two diagonal, masked) and 2 for every other rank's. Contiguous: rank r
// computes r + 1 blocks (its diagonal and the r ranks before it).
TEST(Work, HeadTailBalancesTheCausalWork) {
  auto world = hp::world();
  const int cp = world->size();
  for (Split sp : {Split::kHeadTail, Split::kContiguous}) {
    ContextParallel ctx(world, {Method::kRing, sp});
    const Whole w = whole_sequence(24, Mask::kCausal);
    const SequenceSplit s = ctx.split_of(24);
    auto piece = [&](const at::Tensor& t) { return hp::cp::shard(t.detach(), 2, s, ctx.rank()); };
    ctx.attention(piece(w.q), piece(w.k), piece(w.v), Mask::kCausal);
    const auto& st = ctx.stats();
    if (sp == Split::kHeadTail) {
      const int64_t c = 24 / (2 * cp);
      EXPECT_EQ(st.blocks, 2 * cp + 1);
      EXPECT_EQ(st.masked_blocks, 2);
      EXPECT_EQ(st.score_elements, (2 * cp + 1) * c * c);
    } else {
      const int64_t L = 24 / cp;
      EXPECT_EQ(st.blocks, ctx.rank() + 1);
      EXPECT_EQ(st.masked_blocks, 1);
      EXPECT_EQ(st.score_elements, (ctx.rank() + 1) * L * L);
    }
  }
}

// Comm ops per call, from the trace: ring cp−1 exchanges forward and 2cp−1 backward (keys
// cp−1, gradients cp); allgather one all-gather forward, one all-gather and one
// reduce-scatter backward; ulysses 4 all-to-alls each way. Bytes: the ring forward sends
// the packed K and V (float64) cp−1 times.
TEST(Communication, CollectivesPerCall) {
  auto world = hp::world();
  const int cp = world->size();
  if (cp == 1) GTEST_SKIP() << "one rank";
  const Whole w = whole_sequence(24, Mask::kCausal);
  auto count = [] {
    std::map<std::string, int> n;
    for (const auto& e : hp::trace::events()) {
      if (e.cat == "comm") n[e.name] += 1;
    }
    hp::trace::clear();
    return n;
  };
  for (Method m : {Method::kRing, Method::kAllGather, Method::kUlysses}) {
    if (m == Method::kUlysses && 4 % cp != 0) continue;
    ContextParallel ctx(world, {m, Split::kHeadTail});
    const SequenceSplit s = ctx.split_of(24);
    auto piece = [&](const at::Tensor& t) { return hp::cp::shard(t.detach(), 2, s, ctx.rank()).requires_grad_(true); };
    at::Tensor q = piece(w.q), k = piece(w.k), v = piece(w.v);
    hp::trace::enable(::testing::TempDir() + "hp_cp_trace");
    hp::trace::clear();
    at::Tensor out = ctx.attention(q, k, v, Mask::kCausal);
    const auto forward = count();
    const int64_t forward_bytes = ctx.stats().bytes_sent;
    torch::autograd::grad({out}, {q, k, v}, {hp::cp::shard(w.g, 2, s, ctx.rank())});
    const auto backward = count();
    hp::trace::disable();
    using M = std::map<std::string, int>;
    switch (m) {
      case Method::kRing:
        EXPECT_EQ(forward, (M{{"batch_send_recv", cp - 1}}));
        EXPECT_EQ(backward, (M{{"batch_send_recv", 2 * cp - 1}}));
        EXPECT_EQ(forward_bytes, (cp - 1) * (k.numel() + v.numel()) * 8);
        break;
      case Method::kAllGather:
        EXPECT_EQ(forward, (M{{"all_gather", 1}}));
        EXPECT_EQ(backward, (M{{"all_gather", 1}, {"reduce_scatter", 1}}));
        break;
      case Method::kUlysses:
        EXPECT_EQ(forward, (M{{"all_to_all", 4}}));
        EXPECT_EQ(backward, (M{{"all_to_all", 4}}));
        break;
    }
  }
}

// The exchanges' estimator (cp::attention_traffic, which the planner sums) against what the
// communicator counts (Communicator::traffic: ops, and the bytes this rank sends), forward
// and backward, for each method: float64 inputs (so float64 gradient accumulators), 8 query
// heads over 4 key/value heads, MLA-like head sizes (6 for q and k, 4 for v).
TEST(Communication, TrafficIsTheEstimators) {
  auto world = hp::world();
  const int cp = world->size();
  if (cp == 1) GTEST_SKIP() << "one rank";
  const Whole w = whole_sequence(24, Mask::kCausal);
  for (Method m : {Method::kRing, Method::kAllGather, Method::kUlysses}) {
    if (m == Method::kUlysses && 4 % cp != 0) continue;
    SCOPED_TRACE(hp::cp::method_name(m));
    ContextParallel ctx(world, {m, Split::kHeadTail});
    const SequenceSplit s = ctx.split_of(24);
    auto piece = [&](const at::Tensor& t) { return hp::cp::shard(t.detach(), 2, s, ctx.rank()).requires_grad_(true); };
    at::Tensor q = piece(w.q), k = piece(w.k), v = piece(w.v);
    const hp::CommTraffic start = world->traffic();
    at::Tensor out = ctx.attention(q, k, v, Mask::kCausal);
    const hp::CommTraffic mid = world->traffic();
    torch::autograd::grad({out}, {q, k, v}, {hp::cp::shard(w.g, 2, s, ctx.rank())});
    const hp::CommTraffic end = world->traffic();
    hp::cp::AttentionShape shape;
    shape.cp = cp;
    shape.tokens = static_cast<double>(q.size(0) * q.size(2));
    shape.kv_width = static_cast<double>(k.size(1) * k.size(3) + v.size(1) * v.size(3));
    shape.q_out_width = static_cast<double>(q.size(1) * (q.size(3) + v.size(3)));
    shape.elem_bytes = 8;
    shape.grad_bytes = 8;
    const hp::cp::AttentionCost cost = hp::cp::attention_traffic(m, shape);
    EXPECT_EQ(static_cast<double>(mid.bytes_sent - start.bytes_sent), hp::bytes_sent(cost.forward));
    EXPECT_EQ(static_cast<double>(mid.ops - start.ops), hp::op_count(cost.forward));
    EXPECT_EQ(static_cast<double>(end.bytes_sent - mid.bytes_sent), hp::bytes_sent(cost.backward));
    EXPECT_EQ(static_cast<double>(end.ops - mid.ops), hp::op_count(cost.backward));
  }
}

// ---- bad input --------------------------------------------------------------------------------

TEST(Errors, ClearBeforeAnythingIsSent) {
  auto world = hp::world();
  const int cp = world->size();
  const int64_t T = 6;
  at::Tensor q = at::randn({1, 4, T, 3}, kF64), k = at::randn({1, 2, T, 3}, kF64), v = at::randn({1, 2, T, 3}, kF64);
  ContextParallel head_tail(world, {Method::kRing, Split::kHeadTail});
  hp::test::expect_error([&] { head_tail.attention(q, k, v, Mask::kNone); },
                         {"head_tail split balances a causal mask", "contiguous"});
  hp::test::expect_error([&] { head_tail.attention(q, k.narrow(2, 0, 4), v, Mask::kCausal); },
                         {"batch and tokens differ"});
  hp::test::expect_error([&] { head_tail.attention(q.narrow(1, 0, 3), k, v, Mask::kCausal); },
                         {"3 query heads are not a multiple of 2 key/value heads"});
  if (cp > 1) {
    ContextParallel ulysses(world, {Method::kUlysses, Split::kHeadTail});
    const int64_t h = cp + 1;  // heads not divisible by cp
    at::Tensor kh = at::randn({1, h, T, 3}, kF64);
    hp::test::expect_error([&] { ulysses.attention(at::randn({1, h, T, 3}, kF64), kh, kh, Mask::kCausal); },
                           {"ulysses needs the " + std::to_string(h) + " query heads and " + std::to_string(h) +
                                " key/value heads",
                            "divisible by cp=" + std::to_string(cp)});
    // 3 tokens per rank: an odd local piece cannot hold two head-tail chunks.
    at::Tensor q3 = at::randn({1, 4, 3, 3}, kF64), kv3 = at::randn({1, 2, 3, 3}, kF64);
    hp::test::expect_error([&] { head_tail.attention(q3, kv3, kv3, Mask::kCausal); }, {"not divisible by the"});
  }
}

}  // namespace
