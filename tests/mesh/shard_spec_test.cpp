// N-D shard specs against hand-computed boxes, fully_shard's own dim-0 plan, and a naive
// resharding: every element moved from one layout's boxes to another's through intersect()
// lands where slicing the global tensor puts it.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "hp/fsdp/shard_plan.h"
#include "hp/mesh/shard_spec.h"
#include "test_util.h"

using hp::DimSplit;
using hp::ShardSpec;

TEST(ShardSpec, DimZeroSplitIsFullyShardsPlan) {
  for (int64_t dim0 = 0; dim0 < 14; ++dim0) {
    for (int n = 1; n <= 5; ++n) {
      for (int k = 0; k < n; ++k) {
        hp::ShardPlan p = hp::plan_shard({dim0, 3}, n, k);
        ShardSpec s = hp::make_shard_spec({dim0, 3}, {{{"dp_shard", n, k}}});
        EXPECT_EQ(s.offsets[0], std::min(dim0, p.row_offset)) << dim0 << " " << n << " " << k;
        EXPECT_EQ(s.lengths[0], p.rows) << dim0 << " " << n << " " << k;
        EXPECT_EQ(s.lengths[1], 3);
      }
    }
  }
}

TEST(ShardSpec, NestedAndTwoDimSplitsByHand) {
  // dim 0 of 10 rows over tp/2, then each piece over dp_shard/2: 5 rows -> 3 + 2.
  const int64_t want_off[2][2] = {{0, 3}, {5, 8}}, want_len[2][2] = {{3, 2}, {3, 2}};
  for (int t = 0; t < 2; ++t) {
    for (int d = 0; d < 2; ++d) {
      ShardSpec s = hp::make_shard_spec({10, 4}, {{{"tp", 2, t}, {"dp_shard", 2, d}}});
      EXPECT_EQ(s.offsets[0], want_off[t][d]);
      EXPECT_EQ(s.lengths[0], want_len[t][d]);
      // The same box by splitting a tensor-parallel piece further, as fully_shard does.
      ShardSpec tp = hp::make_shard_spec({10, 4}, {{{"tp", 2, t}}});
      ShardSpec f = hp::split_further(tp, 0, {"dp_shard", 2, d});
      EXPECT_EQ(f.offsets, s.offsets);
      EXPECT_EQ(f.lengths, s.lengths);
    }
  }
  // A rowwise weight [6, 8]: dim 1 over tp/2, dim 0 over dp_shard/4 (6 rows -> 2, 2, 2, 0).
  ShardSpec s = hp::make_shard_spec({6, 8}, {{{"dp_shard", 4, 3}}, {{"tp", 2, 1}}});
  EXPECT_EQ(s.offsets, (std::vector<int64_t>{6, 4}));
  EXPECT_EQ(s.lengths, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(s.empty());
  EXPECT_EQ(hp::make_shard_spec({6, 8}, {{{"dp_shard", 4, 1}}, {{"tp", 2, 1}}}).to_string(),
            "[2:4, 4:8] of [6, 8] (dim 0 over dp_shard/4, dim 1 over tp/2)");
}

namespace {

// Every box of a layout given as split counts per dim (one split per dim, all indices).
std::vector<ShardSpec> layout(const std::vector<int64_t>& shape, const std::vector<int64_t>& counts) {
  std::vector<ShardSpec> out;
  int64_t total = 1;
  for (int64_t c : counts) total *= c;
  for (int64_t r = 0; r < total; ++r) {
    std::vector<std::vector<DimSplit>> splits(shape.size());
    int64_t rest = r;
    for (size_t d = counts.size(); d-- > 0;) {
      splits[d].push_back({"m" + std::to_string(d), counts[d], rest % counts[d]});
      rest /= counts[d];
    }
    out.push_back(hp::make_shard_spec(shape, splits));
  }
  return out;
}

at::Tensor box_of(const at::Tensor& t, const std::vector<int64_t>& off, const std::vector<int64_t>& len) {
  at::Tensor v = t;
  for (size_t d = 0; d < off.size(); ++d) v = v.narrow(static_cast<int64_t>(d), off[d], len[d]);
  return v;
}

}  // namespace

// Resharding [7, 5, 3] from (3 x 2 x 1) boxes to (2 x 1 x 3) boxes through intersections.
TEST(ShardSpec, IntersectionsReshardEveryElementExactlyOnce) {
  const std::vector<int64_t> shape = {7, 5, 3};
  at::Tensor global = at::arange(7 * 5 * 3, at::kDouble).view({7, 5, 3});
  auto from = layout(shape, {3, 2, 1}), to = layout(shape, {2, 1, 3});
  int64_t moved = 0;
  for (const auto& b : to) {
    at::Tensor dst = at::full(b.lengths, -1.0, at::kDouble);
    for (const auto& a : from) {
      at::Tensor src = box_of(global, a.offsets, a.lengths).clone();  // what a's owner holds
      hp::BoxOverlap o;
      if (!hp::intersect(a, b, &o)) continue;
      box_of(dst, o.offsets_in_b, o.lengths).copy_(box_of(src, o.offsets_in_a, o.lengths));
      int64_t n = 1;
      for (int64_t l : o.lengths) n *= l;
      moved += n;
    }
    EXPECT_TRUE(at::equal(dst, box_of(global, b.offsets, b.lengths))) << b.to_string();
  }
  EXPECT_EQ(moved, global.numel());
}

TEST(ShardSpec, BadSplitsAreNamed) {
  hp::test::expect_error([] { hp::make_shard_spec({4}, {{{"tp", 0, 0}}}); }, {"dim 0", "'tp'", "count must be >= 1"});
  hp::test::expect_error([] { hp::make_shard_spec({4}, {{{"tp", 2, 2}}}); }, {"piece 2 of 2", "out of range"});
  hp::test::expect_error([] { hp::make_shard_spec({4}, {{}, {}}); }, {"2 dims of splits", "1 dims"});
  ShardSpec a = hp::make_shard_spec({4}, {}), b = hp::make_shard_spec({5}, {});
  hp::test::expect_error([&] { hp::intersect(a, b, nullptr); }, {"different tensors"});
}
