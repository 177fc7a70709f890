#include "hp/mesh/shard_spec.h"

#include <algorithm>
#include <sstream>

#include "hp/core/error.h"

namespace hp {

namespace {

// Piece `s.index` of a dim segment [start, start + len) split into s.count pieces.
void apply_split(int64_t* start, int64_t* len, const DimSplit& s, int64_t dim) {
  HP_CHECK(s.count >= 1, "shard spec: dim ", dim, " split over '", s.mesh_dim, "' into ", s.count,
           " pieces; the count must be >= 1");
  HP_CHECK(s.index >= 0 && s.index < s.count, "shard spec: dim ", dim, " piece ", s.index, " of ", s.count,
           " over '", s.mesh_dim, "' is out of range");
  const int64_t per = (*len + s.count - 1) / s.count;
  const int64_t begin = std::min(*len, s.index * per);
  *start += begin;
  *len = std::min(per, *len - begin);
}

}  // namespace

int64_t ShardSpec::numel() const {
  int64_t n = 1;
  for (int64_t l : lengths) n *= l;
  return n;
}

std::string ShardSpec::to_string() const {
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < lengths.size(); ++d) {
    os << (d ? ", " : "") << offsets[d] << ":" << offsets[d] + lengths[d];
  }
  os << "] of [";
  for (size_t d = 0; d < global_shape.size(); ++d) os << (d ? ", " : "") << global_shape[d];
  os << "]";
  bool first = true;
  for (size_t d = 0; d < splits.size(); ++d) {
    if (splits[d].empty()) continue;
    os << (first ? " (" : ", ") << "dim " << d << " over ";
    for (size_t k = 0; k < splits[d].size(); ++k) {
      os << (k ? " then " : "") << splits[d][k].mesh_dim << "/" << splits[d][k].count;
    }
    first = false;
  }
  if (!first) os << ")";
  return os.str();
}

ShardSpec make_shard_spec(const std::vector<int64_t>& global_shape, const std::vector<std::vector<DimSplit>>& splits) {
  HP_CHECK(splits.size() <= global_shape.size(), "shard spec: ", splits.size(), " dims of splits for a tensor of ",
           global_shape.size(), " dims");
  ShardSpec s;
  s.global_shape = global_shape;
  s.offsets.assign(global_shape.size(), 0);
  s.lengths = global_shape;
  s.splits.assign(global_shape.size(), {});
  for (size_t d = 0; d < splits.size(); ++d) {
    for (const auto& sp : splits[d]) {
      apply_split(&s.offsets[d], &s.lengths[d], sp, static_cast<int64_t>(d));
      s.splits[d].push_back(sp);
    }
  }
  return s;
}

ShardSpec split_further(const ShardSpec& outer, int64_t dim, const DimSplit& split) {
  HP_CHECK(dim >= 0 && dim < static_cast<int64_t>(outer.global_shape.size()), "shard spec: dim ", dim,
           " of a tensor of ", outer.global_shape.size(), " dims");
  ShardSpec s = outer;
  apply_split(&s.offsets[dim], &s.lengths[dim], split, dim);
  s.splits[dim].push_back(split);
  return s;
}

bool intersect(const ShardSpec& a, const ShardSpec& b, BoxOverlap* out) {
  HP_CHECK(a.global_shape == b.global_shape, "shard spec: intersecting boxes of different tensors (",
           a.to_string(), " and ", b.to_string(), ")");
  BoxOverlap o;
  for (size_t d = 0; d < a.global_shape.size(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    if (hi <= lo) return false;
    o.global_offsets.push_back(lo);
    o.offsets_in_a.push_back(lo - a.offsets[d]);
    o.offsets_in_b.push_back(lo - b.offsets[d]);
    o.lengths.push_back(hi - lo);
  }
  if (out) *out = std::move(o);
  return true;
}

}  // namespace hp
