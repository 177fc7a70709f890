// Private: the stateless parts of fully_shard's collectives, the copies in and out of the
// fused buffers. They take tensors and layouts and know nothing of groups or hooks.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "buffers.h"
#include "hp/fsdp/shard_plan.h"

namespace hp::detail {

// The fused all-gather's input: each padded shard (flattened) at its offset of `layout`,
// in dtype `dt`, the alignment gaps zero.
OwnedBuffer fused_gather_input(const std::vector<at::Tensor>& padded_shards, const FusedLayout& layout,
                               at::ScalarType dt);

// The fused all-gather's copy-out: `gathered` is [ranks, total], each rank's segment of
// parameter i at offsets[i]; dests[i] is that parameter's [ranks, len_i] destination.
void copy_out_gathered(const at::Tensor& gathered, const std::vector<int64_t>& offsets,
                       const std::vector<at::Tensor>& dests);

// Copies a flat gradient (numel elements) into dst [shards, shard_numel] as the padded
// dim-0 layout places it; dst is zero beforehand, so the padding stays zero. The
// reduce-scatter's input for one parameter (a segment of the fused input when fused).
void scatter_padded(const at::Tensor& dst, const at::Tensor& flat);

}  // namespace hp::detail
