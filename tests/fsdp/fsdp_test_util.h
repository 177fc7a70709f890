// Helpers of the fully_shard tests: sharded parameters reassembled and compared with a
// one-process reference.
#pragma once

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "hp/fsdp/fully_shard.h"

namespace hp::test {

// fully_shard on each block of `model` (a holder with a `blocks` vector), then on the
// model itself: the handles in that order and all their sharded parameters (for the
// optimizer), the usual bottom-up application.
struct Sharded {
  std::vector<FSDPHandle> handles;
  std::vector<at::Tensor> params;
};
template <typename Model>
Sharded shard_blocks_then_root(Model& model, const FullyShardOptions& o = {}) {
  Sharded s;
  for (auto& b : model->blocks) s.handles.push_back(fully_shard(*b, o));
  s.handles.push_back(fully_shard(*model, o));
  for (auto& h : s.handles) {
    for (auto& p : h->parameters()) s.params.push_back(p);
  }
  return s;
}

// The full tensor of a sharded parameter from every shard rank's rows `local`: float64 for
// a float64 parameter, float32 otherwise.
inline at::Tensor reassemble(const ShardedTensor& st, const at::Tensor& local, const CommPtr& shard_group) {
  // The N-D spec names the same rows as row_offset and the local tensor (shifted by where
  // a tensor-parallel piece starts: a multiple of the piece's rows).
  const int64_t piece_rows = st.global_shape.empty() ? 1 : st.global_shape[0];
  if (st.spec.lengths.empty() || st.spec.lengths[0] != (local.dim() == 0 ? 1 : local.size(0)) ||
      (st.spec.lengths[0] > 0 && piece_rows > 0 && (st.spec.offsets[0] - st.row_offset) % piece_rows != 0)) {
    throw std::runtime_error("shard spec " + st.spec.to_string() + " disagrees with the shard of '" + st.name + "'");
  }
  const at::ScalarType dt = local.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor full = at::zeros(st.global_shape, local.options().dtype(dt));
  at::Tensor rows = full.dim() == 0 ? full.view({1}) : full;
  if (local.size(0) > 0) rows.narrow(0, st.row_offset, local.size(0)).copy_(local.detach());
  shard_group->all_reduce(full).wait();  // each row lives on exactly one shard rank
  return full;
}

// A reference model's parameters in the order of handles made block by block, then the
// root: each block's parameters, then those whose names do not start with `block_prefix`.
template <typename Model>
std::vector<at::Tensor> reference_in_handle_order(Model& model, const std::string& block_prefix) {
  std::vector<at::Tensor> out;
  for (auto& b : model->blocks) {
    for (auto& t : b->parameters()) out.push_back(t.detach());
  }
  for (const auto& item : model->named_parameters()) {
    if (item.key().rfind(block_prefix, 0) != 0) out.push_back(item.value().detach());
  }
  return out;
}

// Largest |a - b| / max |b| between every handle's reassembled parameters and `want`,
// computed in float64; 1e30 when the lists differ in length or shapes.
inline double max_rel_to_reference(const std::vector<FSDPHandle>& handles, const std::vector<at::Tensor>& want,
                                   const CommPtr& shard_group) {
  double worst = 0;
  size_t i = 0;
  for (const auto& h : handles) {
    for (const auto& st : h->state_dict()) {
      if (i >= want.size()) return 1e30;  // more parameters than the reference
      at::Tensor full = reassemble(st, st.local, shard_group);
      at::Tensor b = want[i++].to(at::kDouble);
      if (!full.sizes().equals(b.sizes())) return 1e30;
      full = full.to(at::kDouble);
      worst = std::max(worst, (full - b).abs().max().item<double>() / (b.abs().max().item<double>() + 1e-12));
    }
  }
  return i == want.size() ? worst : 1e30;
}

}  // namespace hp::test
