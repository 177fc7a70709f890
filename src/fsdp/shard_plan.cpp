#include "hp/fsdp/shard_plan.h"

#include "hp/core/error.h"

namespace hp {

ShardPlan plan_shard(const std::vector<int64_t>& shape, int shards, int index) {
  HP_CHECK(shards >= 1 && index >= 0 && index < shards, "shard index ", index,
           " is not in [0, ", shards, ")");
  ShardPlan p;
  p.dim0 = shape.empty() ? 1 : shape[0];
  for (size_t d = 1; d < shape.size(); ++d) p.row_numel *= shape[d];
  p.rows_per_shard = (p.dim0 + shards - 1) / shards;
  p.padded_dim0 = p.rows_per_shard * shards;
  p.row_offset = index * p.rows_per_shard;
  p.rows = std::max<int64_t>(0, std::min(p.rows_per_shard, p.dim0 - p.row_offset));
  return p;
}

FusedLayout plan_fused(const std::vector<ShardPlan>& plans, int64_t align) {
  HP_CHECK(align >= 1, "alignment ", align, " must be positive");
  FusedLayout l;
  int64_t off = 0;
  for (const auto& p : plans) {
    l.offsets.push_back(off);
    off += (p.shard_numel() + align - 1) / align * align;
  }
  l.total = off;
  return l;
}

}  // namespace hp
