#include "hp/fsdp/memory_estimate.h"

#include <algorithm>

#include "hp/core/error.h"
#include "rules.h"

namespace hp {

MemoryEstimate estimate_memory(int64_t params, int64_t block, at::ScalarType param_dtype,
                               const MixedPrecisionPolicy& policy, const ParallelLayout& layout) {
  HP_CHECK(layout.dp_shard >= 1 && layout.dp_replicate >= 1, "layout: dp_shard=", layout.dp_shard,
           " and dp_replicate=", layout.dp_replicate, " must be positive");
  HP_CHECK(params >= 0 && block >= 0 && block <= params, "estimate_memory: block of ", block,
           " parameters in a model of ", params);
  const GroupDtypes d = resolve_dtypes(policy, param_dtype);
  auto bytes = [](at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); };
  const int64_t N = layout.dp_shard;
  const int64_t shard = (params + N - 1) / N;  // padding rounds up per parameter; at most N-1 each
  MemoryEstimate m;
  m.params = params;
  m.sharded_params = shard * bytes(d.param);
  m.sharded_grads = shard * bytes(d.sharded_grad);
  m.fp32_masters = (d.main_grad && d.param != at::kFloat) ? shard * 4 : 0;
  // AdamW's two moments take the dtype of what it steps: the fp32 masters when there are
  // any (FP32MasterOptimizer), else the sharded parameters.
  m.optimizer_state = 2 * shard * (m.fp32_masters ? 4 : bytes(d.param));
  // Backward peak: two unsharded blocks (current + prefetched) in the compute dtype, the
  // current block's gradients in the gradient dtype, two reduce-scatter inputs in the
  // reduce dtype. With one shard and an unchanged dtype parameters alias their shards.
  const bool aliased = detail::params_alias_shards(N, d);
  const int64_t reductions =
      N == 1 ? 0 : static_cast<int64_t>(detail::kReductionsInFlight) * block * bytes(d.reduce);
  if (layout.unsharded_through_step) {
    // A pipeline keeps every stage of the rank whole through the step (UNSHARD before its
    // first micro-batch, REDUCE_GRAD after its last), gradients accumulating unsharded (a
    // block's fresh gradient beside them before it is added).
    m.backward_peak_extra = (aliased ? 0 : params * bytes(d.compute)) + params * bytes(d.unsharded_accumulate) +
                            block * bytes(d.grad) + reductions;
    return m;
  }
  m.backward_peak_extra = (aliased ? 0 : detail::kUnshardedBlocksHeld * block * bytes(d.compute)) +
                          block * bytes(d.grad) + reductions;
  const int64_t k = layout.reshard_after_forward_group_size;
  HP_CHECK(k >= 0, "estimate_memory: reshard_after_forward_group_size=", k, " must be >= 0");
  HP_CHECK(k == 0 || N % k == 0, "estimate_memory: reshard_after_forward_group_size=", k,
           " does not divide dp_shard=", N);
  if (k > 0 && !aliased) m.post_forward_shares = (params + k - 1) / k * bytes(d.all_gather);
  return m;
}

std::string MemoryEstimate::to_string() const {
  auto mb = [](int64_t b) { return detail::str_cat(static_cast<double>(b) / 1e6, " MB"); };
  return detail::str_cat("params ", params, "; per rank: sharded params ", mb(sharded_params), ", grads ",
                         mb(sharded_grads), ", optimizer ", mb(optimizer_state), ", fp32 masters ", mb(fp32_masters),
                         ", backward peak extra ", mb(backward_peak_extra),
                         post_forward_shares ? detail::str_cat(", kept from forward ", mb(post_forward_shares)) : "",
                         ", total ", mb(total()));
}

CollectiveCounts estimate_collectives(int64_t groups, int64_t rounds, bool reshard_after_forward,
                                      int64_t dp_replicate) {
  HP_CHECK(groups >= 0 && rounds >= 0 && dp_replicate >= 1, "estimate_collectives: groups=", groups,
           ", rounds=", rounds, " and dp_replicate=", dp_replicate, " must be non-negative (dp_replicate positive)");
  CollectiveCounts c;
  const int64_t again = reshard_after_forward ? std::max<int64_t>(0, groups - detail::kGroupsKeptForBackward) : 0;
  c.all_gathers = rounds * (groups + again);
  c.reduce_scatters = rounds * groups;
  c.all_reduces = dp_replicate > 1 ? c.reduce_scatters : 0;
  c.flag_all_reduces = c.reduce_scatters + c.all_reduces;
  return c;
}

}  // namespace hp
