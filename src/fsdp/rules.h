// Rules fully_shard follows and estimate_memory counts, written once so the two cannot
// drift apart.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hp/fsdp/mixed_precision.h"

namespace hp::detail {

// Reduce-scatters kept in flight during backward; their inputs are a block of gradients
// each.
constexpr size_t kReductionsInFlight = 2;
// Unsharded blocks held at once in backward: the one computing and the one prefetched.
constexpr int64_t kUnshardedBlocksHeld = 2;
// Groups that resharding after forward leaves gathered for backward: the root (its
// post-forward reshard waits for the backward) and the last module to finish forward, which
// the backward reaches first. Every other group is gathered again in backward.
constexpr int64_t kGroupsKeptForBackward = 2;

// With one shard and the compute dtype equal to the parameters', a module's tensors alias
// its shards: nothing is gathered, copied or freed.
inline bool params_alias_shards(int64_t shards, const GroupDtypes& d) { return shards == 1 && d.compute == d.param; }

}  // namespace hp::detail
