// N-D shard specs: which box of a global tensor one rank holds, and over which mesh dims
// each tensor dim was split. Pure functions, no ranks.
//
// A tensor dim may be split several times, outermost first: tensor parallel splits a
// Linear weight's dim 0 over "tp", then fully_shard splits each rank's piece again over
// "dp_shard" (nested splits, FSDP2's strided-shard case), or tensor parallel splits dim 1
// and fully_shard dim 0. Every split follows fully_shard's rule: the dim being split is
// padded up to a multiple of the split count, so piece k starts at k * ceil(len / count) and
// holds what is left of the dim there (possibly nothing).
//
// A checkpoint reshards by intersecting the boxes of the saved layout with the boxes of
// the new one: intersect() gives, for two boxes of one tensor, the overlapping box in
// global coordinates and where it starts inside each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp {

// One split of a tensor dim: over which mesh dim, into how many pieces, and which piece
// this rank holds.
struct DimSplit {
  std::string mesh_dim;
  int64_t count = 1;
  int64_t index = 0;
};

struct ShardSpec {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;  // of this rank's box, per dim
  std::vector<int64_t> lengths;  // of this rank's box, per dim (0 in some dim: empty box)
  // Per tensor dim, the splits applied to it, outermost first (empty: not split).
  std::vector<std::vector<DimSplit>> splits;

  int64_t numel() const;
  bool empty() const { return numel() == 0; }
  // "[4:8, 0:16] of [16, 16] (dim 0 over tp/2 then dp_shard/2)"
  std::string to_string() const;
};

// The box of `global_shape` after applying `splits` (per dim, outermost first). Raises
// hp::Error naming the dim for a split count < 1 or an index outside [0, count).
ShardSpec make_shard_spec(const std::vector<int64_t>& global_shape,
                          const std::vector<std::vector<DimSplit>>& splits);

// The spec of a piece of `outer` split again along `dim` (fully_shard over a tensor
// parallel shard): the piece's own offsets are relative to `outer`'s box.
ShardSpec split_further(const ShardSpec& outer, int64_t dim, const DimSplit& split);

struct BoxOverlap {
  std::vector<int64_t> global_offsets;  // where the overlap starts in the global tensor
  std::vector<int64_t> offsets_in_a;    // ... inside a's box
  std::vector<int64_t> offsets_in_b;    // ... inside b's box
  std::vector<int64_t> lengths;         // its extent (all > 0)
};

// The overlap of two boxes of the same global tensor, or false when they do not overlap
// (or one is empty). Raises hp::Error when the global shapes differ.
bool intersect(const ShardSpec& a, const ShardSpec& b, BoxOverlap* out);

}  // namespace hp
