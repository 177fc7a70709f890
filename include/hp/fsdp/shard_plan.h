// Pure layout plans of fully_shard: how one parameter is split into dim-0 shards, and
// where each parameter's shard sits in a group's fused buffers. No ranks needed.
#pragma once

#include <cstdint>
#include <vector>

namespace hp {

// A parameter of global shape [dim0, rest...] split over `shards` ranks along dim 0.
// dim 0 is padded up to a multiple of the shard count, so every shard has rows_per_shard
// rows; shard k holds global rows [k * rows_per_shard, ...) of which `rows` are real
// (the rest is zero padding; rows may be 0 when dim0 < shards). A 0-d parameter is
// treated as shape [1].
struct ShardPlan {
  int64_t dim0 = 0;
  int64_t row_numel = 1;       // elements per dim-0 row
  int64_t rows_per_shard = 0;  // padded
  int64_t padded_dim0 = 0;
  int64_t row_offset = 0;      // first global row of this shard
  int64_t rows = 0;            // real rows in this shard
  int64_t shard_numel() const { return rows_per_shard * row_numel; }
  int64_t padded_numel() const { return padded_dim0 * row_numel; }
  int64_t numel() const { return dim0 * row_numel; }
};

ShardPlan plan_shard(const std::vector<int64_t>& shape, int shards, int index);

// Offsets (in elements) of each parameter's shard in a group's fused per-rank segment,
// each aligned to `align` elements; `total` is the segment length (aligned too).
struct FusedLayout {
  std::vector<int64_t> offsets;
  int64_t total = 0;
};

FusedLayout plan_fused(const std::vector<ShardPlan>& plans, int64_t align);

}  // namespace hp
