// Shard and fused-buffer layouts against hand-computed values.
#include <gtest/gtest.h>

#include "hp/fsdp/shard_plan.h"

TEST(ShardPlan, PadsDim0ToTheShardCount) {
  // 10 rows over 4 shards: 3 rows each, padded to 12; the last shard has 1 real row.
  std::vector<int64_t> rows, offsets;
  for (int k = 0; k < 4; ++k) {
    hp::ShardPlan p = hp::plan_shard({10, 7}, 4, k);
    EXPECT_EQ(p.rows_per_shard, 3);
    EXPECT_EQ(p.padded_dim0, 12);
    EXPECT_EQ(p.row_numel, 7);
    EXPECT_EQ(p.shard_numel(), 21);
    rows.push_back(p.rows);
    offsets.push_back(p.row_offset);
  }
  EXPECT_EQ(rows, (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 3, 6, 9}));
}

TEST(ShardPlan, Dim0SmallerThanTheShardCountAndScalars) {
  // 3 rows over 4 shards: one row each, the last shard empty.
  EXPECT_EQ(hp::plan_shard({3, 2}, 4, 2).rows, 1);
  EXPECT_EQ(hp::plan_shard({3, 2}, 4, 3).rows, 0);
  hp::ShardPlan s = hp::plan_shard({}, 2, 1);  // 0-d: one row of one element
  EXPECT_EQ(s.dim0, 1);
  EXPECT_EQ(s.rows_per_shard, 1);
  EXPECT_EQ(s.rows, 0);
  EXPECT_EQ(hp::plan_shard({}, 2, 0).rows, 1);
}

TEST(ShardPlan, FusedOffsetsAreAligned) {
  std::vector<hp::ShardPlan> plans = {hp::plan_shard({10, 7}, 4, 0), hp::plan_shard({5}, 4, 0),
                                      hp::plan_shard({16, 16}, 4, 0)};
  // shard numels 21, 2, 64; aligned to 16: offsets 0, 32, 48; total 112.
  hp::FusedLayout l = hp::plan_fused(plans, 16);
  EXPECT_EQ(l.offsets, (std::vector<int64_t>{0, 32, 48}));
  EXPECT_EQ(l.total, 112);
}
