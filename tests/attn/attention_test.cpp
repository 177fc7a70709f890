// The tiled attention kernel (hp/attn) against attention written out here: the keys and
// values repeated for the query heads sharing them, the S x S scores, a causal mask by
// position, softmax and the weighted sum, differentiated by autograd. In float64 the two
// differ only in the order of the sums and the running rescaling: output and the gradients
// of q, k and v within 1e-12.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "../test_util.h"
#include "hp/attn/attention.h"
#include "hp/core/memory.h"

namespace {

using hp::attn::Mask;
using Positions = hp::attn::Run;  // (gtest's Test::Run hides a plain Run in a test body)
const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// Plain softmax attention; q/k positions give the causal mask (the key after the query is hidden).
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Mask mask, double scale,
                     const at::Tensor& q_pos, const at::Tensor& k_pos) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor kr = k.repeat_interleave(group, 1), vr = v.repeat_interleave(group, 1);
  at::Tensor s = at::matmul(q, kr.transpose(-2, -1)) * scale;
  if (mask == Mask::kCausal) {
    s = s.masked_fill(k_pos.unsqueeze(0) > q_pos.unsqueeze(1), -std::numeric_limits<double>::infinity());
  }
  return at::matmul(s.softmax(-1), vr);
}

struct Case {
  int64_t B, heads, kv_heads, S, d, dv, tile;
  Mask mask;
};

struct Grads {
  at::Tensor out, dq, dk, dv;
};

template <typename Fn>
Grads run(const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0, const at::Tensor& go, Fn&& fn) {
  at::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
             v = v0.clone().requires_grad_(true);
  at::Tensor out = fn(q, k, v);
  out.backward(go);
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

void expect_close(const Grads& a, const Grads& b, double tol) {
  EXPECT_LE((a.out - b.out).abs().max().item<double>(), tol);
  EXPECT_LE((a.dq - b.dq).abs().max().item<double>(), tol);
  EXPECT_LE((a.dk - b.dk).abs().max().item<double>(), tol);
  EXPECT_LE((a.dv - b.dv).abs().max().item<double>(), tol);
}

TEST(TiledAttention, MatchesPlainSoftmaxInFloat64) {
  const std::vector<Case> cases = {
      {2, 4, 4, 13, 8, 8, 1, Mask::kCausal},   // a tile of 1
      {2, 4, 4, 13, 8, 8, 5, Mask::kCausal},   // tiles that do not divide S
      {2, 4, 4, 13, 8, 8, 5, Mask::kNone},
      {1, 4, 4, 13, 8, 8, 64, Mask::kCausal},  // one tile larger than S
      {2, 6, 2, 16, 8, 8, 4, Mask::kCausal},   // grouped-query attention, 3 heads per key/value head
      {1, 4, 1, 11, 8, 8, 3, Mask::kNone},     // one key/value head for all
      {2, 4, 4, 12, 24, 16, 5, Mask::kCausal}, // MLA's unequal sizes (d 24 = 16 + 8, dv 16)
  };
  at::manual_seed(3);
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "heads " << c.heads << "/" << c.kv_heads << " S " << c.S << " tile " << c.tile
                                    << (c.mask == Mask::kCausal ? " causal" : " no mask"));
    const at::Tensor q = at::randn({c.B, c.heads, c.S, c.d}, kF64), k = at::randn({c.B, c.kv_heads, c.S, c.d}, kF64),
                     v = at::randn({c.B, c.kv_heads, c.S, c.dv}, kF64), go = at::randn({c.B, c.heads, c.S, c.dv}, kF64);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    const at::Tensor pos = at::arange(c.S, at::kLong);
    const Grads want = run(q, k, v, go, [&](auto& a, auto& b, auto& d) { return reference(a, b, d, c.mask, scale, pos, pos); });
    const Grads got =
        run(q, k, v, go, [&](auto& a, auto& b, auto& d) { return hp::attn::attention(a, b, d, c.mask, 0.0, c.tile); });
    expect_close(got, want, 1e-12);
  }
}

TEST(TiledAttention, RunsInAnyOrderAttendByTheirPositions) {
  // The queries hold positions 6-9 then 0-5 (two runs); the keys 0-9 in order.
  at::manual_seed(4);
  const at::Tensor q = at::randn({1, 2, 10, 4}, kF64), k = at::randn({1, 2, 10, 4}, kF64),
                   v = at::randn({1, 2, 10, 4}, kF64), go = at::randn({1, 2, 10, 4}, kF64);
  const std::vector<Positions> q_runs = {Positions{6, 4, 0}, Positions{0, 6, 4}}, k_runs = {Positions{0, 10, 0}};
  const at::Tensor q_pos = at::cat({at::arange(6, 10, at::kLong), at::arange(0, 6, at::kLong)});
  const at::Tensor k_pos = at::arange(10, at::kLong);
  const Grads want = run(q, k, v, go, [&](auto& a, auto& b, auto& d) { return reference(a, b, d, Mask::kCausal, 0.5, q_pos, k_pos); });
  for (int64_t tile : {1, 3, 16}) {
    const Grads got = run(q, k, v, go, [&](auto& a, auto& b, auto& d) {
      return hp::attn::attention(a, b, d, q_runs, k_runs, Mask::kCausal, 0.5, tile);
    });
    expect_close(got, want, 1e-12);
  }
}

TEST(TiledAttention, ThreeTokensByHand) {
  // One head of size 1, scale 1, causal. q = 1 and k = (0, ln 2, ln 3): query i weighs the
  // keys up to i by 1, 2, 3. v = (6, 12, 18): outputs 6, (6 + 24) / 3 = 10 and
  // (6 + 24 + 54) / 6 = 14. The gradient of their sum in v_j is the weight key j gets,
  // summed over the queries: 1 + 1/3 + 1/6, 2/3 + 2/6, 3/6.
  for (int64_t tile : {1, 2, 3, 4}) {
    SCOPED_TRACE(tile);
    at::Tensor q = at::ones({1, 1, 3, 1}, kF64).requires_grad_(true);
    at::Tensor k = at::tensor({0.0, std::log(2.0), std::log(3.0)}, kF64).view({1, 1, 3, 1}).requires_grad_(true);
    at::Tensor v = at::tensor({6.0, 12.0, 18.0}, kF64).view({1, 1, 3, 1}).requires_grad_(true);
    at::Tensor o = hp::attn::attention(q, k, v, Mask::kCausal, 1.0, tile);
    o.sum().backward();
    const at::Tensor out = o.view({3});
    EXPECT_NEAR(out[0].item<double>(), 6.0, 1e-13);
    EXPECT_NEAR(out[1].item<double>(), 10.0, 1e-13);
    EXPECT_NEAR(out[2].item<double>(), 14.0, 1e-13);
    const at::Tensor dv = v.grad().view({3});
    EXPECT_NEAR(dv[0].item<double>(), 1.5, 1e-13);
    EXPECT_NEAR(dv[1].item<double>(), 1.0, 1e-13);
    EXPECT_NEAR(dv[2].item<double>(), 0.5, 1e-13);
  }
}

TEST(TiledAttention, CountsTheTilesItComputes) {
  // S 10, tile 4, causal: query tiles [0,4) [4,8) [8,10) see 1, 2 and 3 key tiles, the last
  // of each on the diagonal: 6 blocks, 3 masked, 16 + 32 + 20 scores.
  hp::attn::TileCounts n;
  const at::Tensor x = at::randn({1, 1, 10, 2}, kF64);
  const std::vector<Positions> all = {Positions{0, 10, 0}};
  (void)hp::attn::attention(x, x, x, all, all, Mask::kCausal, 0.0, 4, &n);
  EXPECT_EQ(n.blocks, 6);
  EXPECT_EQ(n.masked_blocks, 3);
  EXPECT_EQ(n.score_elements, 68);
  hp::attn::TileCounts none;
  (void)hp::attn::attention(x, x, x, all, all, Mask::kNone, 0.0, 4, &none);
  EXPECT_EQ(none.blocks, 9);
  EXPECT_EQ(none.score_elements, 100);
}

TEST(TiledAttention, TheEstimatorsCountOfScoresIsTheKernels) {
  // What the families' FLOP counts use, against the kernel's own count, and S = 8 at tile 3
  // by hand: query tiles of 3, 3, 2 see 3, 6 and 8 keys: 9 + 18 + 16.
  EXPECT_EQ(hp::attn::causal_score_elements(8, 3), 43.0);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{8, 3}, {13, 5}, {16, 4}, {7, 1}, {9, 64}};
  for (auto [S, tile] : shapes) {
    hp::attn::TileCounts n;
    const at::Tensor x = at::randn({1, 1, S, 2}, kF64);
    const std::vector<Positions> all = {Positions{0, S, 0}};
    (void)hp::attn::attention(x, x, x, all, all, Mask::kCausal, 0.0, tile, &n);
    EXPECT_EQ(hp::attn::causal_score_elements(S, tile), static_cast<double>(n.score_elements)) << S << " " << tile;
  }
}

TEST(TiledAttention, LowPrecisionInputsComputeInFloat32) {
  // bf16 inputs: the kernel computes in float32 and rounds the output once, so against the
  // float64 reference on the same (rounded) inputs each output is off by at most its own
  // rounding, bf16's unit roundoff 2^-8 relative (8 significant bits), plus float32's sums
  // (well under 1e-5 at these sizes).
  at::manual_seed(5);
  const at::Tensor q = at::randn({1, 4, 40, 8}).to(at::kBFloat16), k = at::randn({1, 2, 40, 8}).to(at::kBFloat16),
                   v = at::randn({1, 2, 40, 8}).to(at::kBFloat16);
  const at::Tensor got = hp::attn::attention(q, k, v, Mask::kCausal, 0.0, 16);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  const at::Tensor pos = at::arange(40, at::kLong);
  const at::Tensor want = reference(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), Mask::kCausal,
                                    1.0 / std::sqrt(8.0), pos, pos);
  const at::Tensor err = (got.to(at::kDouble) - want).abs() - (want.abs() * std::ldexp(1.0, -8) + 1e-5);
  EXPECT_LE(err.max().item<double>(), 0.0);
}

TEST(TiledAttention, RefusesBadTilesAndRuns) {
  const at::Tensor x = at::randn({1, 2, 6, 4});
  hp::test::expect_error([&] { (void)hp::attn::attention(x, x, x, Mask::kCausal, 0.0, 0); }, {"tile=0"});
  hp::test::expect_error([&] { (void)hp::attn::attention(x, x, x, {Positions{0, 4, 0}}, {Positions{0, 6, 0}}, Mask::kNone, 0.0, 2); },
                         {"query runs cover 4 tokens", "6"});
  hp::test::expect_error([&] { (void)hp::attn::attention(x, x, x, {Positions{0, 6, 1}}, {Positions{0, 6, 0}}, Mask::kNone, 0.0, 2); },
                         {"outside the 6 tokens"});
  hp::test::expect_error([&] { (void)hp::attn::attention(x, at::randn({1, 3, 6, 4}), at::randn({1, 3, 6, 4}), Mask::kNone); },
                         {"2 query heads are not a multiple of 3"});
}

// Peak memory of one call, forward and backward, at S = 4096 (float32, 4 heads of 32, tile
// 128), above its inputs and the output's gradient, against what it must hold, counted
// here by hand:
//   kept from forward:   the output (S·H·dv) and one log-sum-exp per row and head (S·H);
//   backward's own:      delta (S·H) and the gradients dq, dk, dv (S·H·(2d + dv)), and the
//                        output's gradient in the compute dtype is the given one (float32);
//   while computing:     a tile's scores and their product (2 x H·t², one block at a time)
//                        and the per-tile rows (acc, the keys/values broadcast: a few H·t·d).
// Plain attention would hold the S x S probabilities: H·S² floats, 30 times that bound.
TEST(TiledAttention, PeakMemoryIsLinearInTheSequence) {
  hp::memory::install_counting_allocator();
  const int64_t S = 4096, H = 4, d = 32, t = 128;
  at::manual_seed(6);
  at::Tensor q = at::randn({1, H, S, d}).requires_grad_(true), k = at::randn({1, H, S, d}).requires_grad_(true),
             v = at::randn({1, H, S, d}).requires_grad_(true);
  const at::Tensor go = at::randn({1, H, S, d});
  const int64_t base = hp::memory::current_bytes();
  hp::memory::reset_peak();
  {
    at::Tensor out = hp::attn::attention(q, k, v, Mask::kCausal, 0.0, t);
    out.backward(go);
  }
  const double peak = static_cast<double>(hp::memory::peak_bytes() - base);
  const double f = 4.0;  // float32
  const double kept = f * S * H * (d + 1), backward = f * S * H * (1 + 3 * d);
  const double tiles = f * (2.0 * H * t * t + 8.0 * H * t * d);
  const double bound = kept + backward + tiles;
  RecordProperty("peak_bytes", std::to_string(static_cast<int64_t>(peak)));
  RecordProperty("bound_bytes", std::to_string(static_cast<int64_t>(bound)));
  EXPECT_LE(peak, 1.1 * bound) << "peak " << peak << " bytes, bound " << bound;
  EXPECT_GE(peak, bound / 1.1) << "the bound counts more than the kernel holds: peak " << peak << ", bound " << bound;
  std::printf("attention at S %lld: peak %.0f bytes, bound %.0f (%.3f)\n", static_cast<long long>(S), peak, bound,
              peak / bound);
  EXPECT_LT(bound * 25, f * H * S * S) << "the bound is not far below the S x S matrix";
}

}  // namespace
