// Tensor (and sequence) parallel plans of the reference models.
//
// Llama: the embedding rowwise (vocabulary-parallel), attention q/k/v colwise and o
// rowwise, the MLP's gate and up colwise and down rowwise, norms sequence-parallel, the
// output head colwise; each rank keeps heads / tp query heads and kv_heads / tp key/value
// heads. With sequence parallelism the residual stream between blocks is split on the
// sequence dim (one all-gather and one reduce-scatter per attention and per MLP, each way);
// without it, it is whole on every rank (one all-reduce per attention and per MLP, each
// way). With loss parallelism the logits stay split on the vocabulary and loss() reduces
// them without gathering (two all-reduces); without it they are gathered.
//
// DeepSeek-V3: the same around the blocks; MLA's down-projections (wq_a, wkv_a) and their
// norms run replicated inside the attention region and their gradients (each rank's heads
// contribute a part) are summed over the group; the up-projections (wq_b, wkv_b) are
// colwise on the replicated latents and wo rowwise. MoE: the router replicated (gradient
// summed), the shared and every routed expert colwise / rowwise along their hidden dim with
// their outputs left Partial, and one reduction at the MoE's output. Routing runs on the
// whole (replicated) tokens on every rank, so each rank routes identically and the
// balancing-bias load counts each token once per data-parallel rank (update it over the
// data-parallel group, which excludes tp). Dense layers as Llama's MLP. When expert_parallel
// was applied first (the MoEs hold part of their experts): each rank's MoE runs on its own
// piece of the sequence (sequence parallel required), the experts whole, the router and the
// shared experts replicated with their gradients summed over tp; nothing moves over tp in
// the MoE, and the load is then summed over the tp ranks too.
//
// MoELlama (Qwen3-MoE, Mixtral): Llama's attention plan (the per-head query and key norms
// replicated, their gradients summed over the group) and DeepSeek's MoE plan.
#pragma once

#include <c10/util/Optional.h>

#include <cstdint>

#include "hp/comm/communicator.h"
#include "hp/models/deepseek.h"
#include "hp/models/llama.h"
#include "hp/models/moe_llama.h"

namespace hp::models {

struct TensorParallelOptions {
  bool sequence_parallel = true;
  bool loss_parallel = true;
  // Dtype of the gradient reductions over the group (the mixed-precision reduce dtype).
  c10::optional<at::ScalarType> reduce_dtype;
};

// Raises hp::Error naming the field when `c` cannot be split over `tp` ranks (heads,
// kv_heads, vocab or the MLP's hidden size not divisible; tied embeddings).
void check_tensor_parallel(const LlamaConfig& c, int64_t tp);

void check_tensor_parallel(const DeepSeekConfig& c, int64_t tp);
void check_tensor_parallel(const MoELlamaConfig& c, int64_t tp);

// Applies the plans above to `model` over `group`. Apply before fully_shard.
void parallelize_llama(Llama& model, const CommPtr& group, const TensorParallelOptions& o = {});
void parallelize_deepseek(DeepSeek& model, const CommPtr& group, const TensorParallelOptions& o = {});
void parallelize_moe_llama(MoELlama& model, const CommPtr& group, const TensorParallelOptions& o = {});
inline void parallelize(Llama& m, const CommPtr& g, const TensorParallelOptions& o = {}) { parallelize_llama(m, g, o); }
inline void parallelize(DeepSeek& m, const CommPtr& g, const TensorParallelOptions& o = {}) {
  parallelize_deepseek(m, g, o);
}
inline void parallelize(MoELlama& m, const CommPtr& g, const TensorParallelOptions& o = {}) {
  parallelize_moe_llama(m, g, o);
}

}  // namespace hp::models
