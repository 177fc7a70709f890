#include "hp/models/tensor_parallel.h"

#include "hp/core/error.h"
#include "hp/tp/parallelize.h"

namespace hp::models {

void check_tensor_parallel(const LlamaConfig& c, int64_t tp) {
  HP_CHECK(tp >= 1, "tensor_parallel must be at least 1, got ", tp);
  if (tp == 1) return;
  HP_CHECK(c.heads % tp == 0, "tensor_parallel=", tp, ": heads=", c.heads, " is not divisible by it");
  HP_CHECK(c.kv_heads % tp == 0, "tensor_parallel=", tp, ": kv_heads=", c.kv_heads,
           " is not divisible by it (each rank needs whole key/value heads)");
  HP_CHECK(c.vocab % tp == 0, "tensor_parallel=", tp, ": vocab=", c.vocab, " is not divisible by it");
  HP_CHECK(c.hidden_dim() % tp == 0, "tensor_parallel=", tp, ": the MLP hidden size ", c.hidden_dim(),
           " is not divisible by it");
  HP_CHECK(!c.tie_embeddings, "tensor_parallel=", tp, " with tie_embeddings is not supported yet");
}

void parallelize_llama(Llama& model, const CommPtr& group, const TensorParallelOptions& o) {
  using namespace hp::tp;
  check_tensor_parallel(model->config, group->size());
  // Between blocks: the residual stream's placement.
  const Placement stream = o.sequence_parallel ? Shard(1) : Replicate();
  ParallelizePlan plan = {
      {"tok_emb", RowwiseParallel().input(Replicate()).output(stream)},
      {"layers_*.attn", PrepareModuleInput({stream, c10::nullopt, c10::nullopt}, {Replicate(), c10::nullopt, c10::nullopt})},
      {"layers_*.attn.wq", ColwiseParallel()},
      {"layers_*.attn.wk", ColwiseParallel()},
      {"layers_*.attn.wv", ColwiseParallel()},
      {"layers_*.attn.wo", RowwiseParallel().output(stream)},
      {"layers_*.mlp", PrepareModuleInput({stream}, {Replicate()})},
      {"layers_*.mlp.w1", ColwiseParallel()},
      {"layers_*.mlp.w3", ColwiseParallel()},
      {"layers_*.mlp.w2", RowwiseParallel().output(stream)},
      {"output", ColwiseParallel().input(stream).output(o.loss_parallel ? Shard(-1) : Replicate())},
  };
  if (o.sequence_parallel) {
    plan.push_back({"layers_*.attn_norm", SequenceParallel()});
    plan.push_back({"layers_*.ffn_norm", SequenceParallel()});
    plan.push_back({"norm", SequenceParallel()});
  }
  parallelize_module(*model, group, plan, ParallelizeOptions{o.reduce_dtype});
  if (o.loss_parallel) model->vocab_parallel_loss = group;
}

}  // namespace hp::models
