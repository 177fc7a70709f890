#include "hp/models/tensor_parallel.h"

#include "hp/core/error.h"
#include "hp/tp/parallelize.h"

namespace hp::models {

namespace {

// The checks of a grouped-query model's split over `tp` ranks (heads, key/value heads,
// vocabulary); false where there is nothing to split.
template <typename Config>
bool check_gqa_split(const Config& c, int64_t tp) {
  HP_CHECK(tp >= 1, "tensor_parallel must be at least 1, got ", tp);
  if (tp == 1) return false;
  HP_CHECK(c.heads % tp == 0, "tensor_parallel=", tp, ": heads=", c.heads, " is not divisible by it");
  HP_CHECK(c.kv_heads % tp == 0, "tensor_parallel=", tp, ": kv_heads=", c.kv_heads,
           " is not divisible by it (each rank needs whole key/value heads)");
  HP_CHECK(c.vocab % tp == 0, "tensor_parallel=", tp, ": vocab=", c.vocab, " is not divisible by it");
  return true;
}

}  // namespace

void check_tensor_parallel(const LlamaConfig& c, int64_t tp) {
  if (!check_gqa_split(c, tp)) return;
  HP_CHECK(c.hidden_dim() % tp == 0, "tensor_parallel=", tp, ": the MLP hidden size ", c.hidden_dim(),
           " is not divisible by it");
}

void check_tensor_parallel(const DeepSeekConfig& c, int64_t tp) {
  HP_CHECK(tp >= 1, "tensor_parallel must be at least 1, got ", tp);
  if (tp == 1) return;
  HP_CHECK(c.heads % tp == 0, "tensor_parallel=", tp, ": heads=", c.heads, " is not divisible by it");
  HP_CHECK(c.vocab % tp == 0, "tensor_parallel=", tp, ": vocab=", c.vocab, " is not divisible by it");
  HP_CHECK(c.dense_layers == 0 || c.dense_hidden % tp == 0, "tensor_parallel=", tp, ": dense_hidden=",
           c.dense_hidden, " is not divisible by it");
  HP_CHECK(c.layers == c.dense_layers || c.expert_hidden % tp == 0, "tensor_parallel=", tp, ": expert_hidden=",
           c.expert_hidden, " is not divisible by it");
}

namespace {

using namespace hp::tp;

// The parts both models share: the embedding, the residual stream's norms, a dense SwiGLU
// MLP at `mlp`, and the output head. `stream` is the residual stream's placement between
// blocks.
void add_common(ParallelizePlan& plan, const Placement& stream, const TensorParallelOptions& o,
                const std::string& mlp) {
  plan.push_back({"tok_emb", RowwiseParallel().input(Replicate()).output(stream)});
  plan.push_back({mlp, PrepareModuleInput({stream}, {Replicate()})});
  plan.push_back({mlp + ".w1", ColwiseParallel()});
  plan.push_back({mlp + ".w3", ColwiseParallel()});
  plan.push_back({mlp + ".w2", RowwiseParallel().output(stream)});
  plan.push_back({"output", ColwiseParallel().input(stream).output(o.loss_parallel ? Shard(-1) : Replicate())});
  if (o.sequence_parallel) {
    plan.push_back({"layers_*.attn_norm", SequenceParallel()});
    plan.push_back({"layers_*.ffn_norm", SequenceParallel()});
    plan.push_back({"norm", SequenceParallel()});
  }
}

// A pipeline stage holds part of a model: its plan keeps the entries that name a module
// it has (the whole model has every one).
ParallelizePlan present(const ParallelizePlan& plan, torch::nn::Module& m) {
  ParallelizePlan out;
  const auto named = m.named_modules();
  for (const auto& item : plan) {
    for (const auto& kv : named) {
      if (match_module_name(item.first, kv.key())) {
        out.push_back(item);
        break;
      }
    }
  }
  return out;
}

// Attention's input gathered (or entered) once: (x, cos, sin).
PrepareModuleInput attention_input(const Placement& stream) {
  return PrepareModuleInput({stream, c10::nullopt, c10::nullopt}, {Replicate(), c10::nullopt, c10::nullopt});
}

// The MoE blocks' part of a plan (their modules at <blocks>.moe): see the file comment
// of tensor_parallel.h. Sets each MoE's tp and tp_sequence_pieces.
void add_moe(ParallelizePlan& plan, const std::string& blocks, const Placement& stream,
             const std::vector<MoEImpl*>& moes, const CommPtr& group, const TensorParallelOptions& o, const char* who) {
  const std::string moe = blocks + ".moe";
  // Under expert parallelism (applied first: the MoEs hold part of their experts) each
  // expert stays whole and each tensor-parallel rank routes its own piece of the sequence
  // over the EP group, which includes the tensor-parallel ranks: nothing moves over tp in
  // the MoE; the router and the shared experts run replicated on the pieces, their
  // gradients summed over tp.
  bool pieces = false;
  for (MoEImpl* m : moes) {
    if (static_cast<int64_t>(m->experts->list.size()) < m->c.experts) pieces = true;
  }
  HP_CHECK(!pieces || o.sequence_parallel, who, ": tensor parallelism of experts placed by ",
           "expert_parallel needs sequence_parallel (each rank routes its piece of the sequence); without it is not ",
           "supported yet");
  if (pieces) {
    plan.push_back({moe + ".gate", ReplicateParallel()});
    for (const char* w : {".w1", ".w3", ".w2"}) plan.push_back({moe + ".shared" + w, ReplicateParallel()});
  } else {
    const Placement partial = Partial();
    plan.push_back({moe, PrepareModuleInput({stream}, {Replicate()})});
    plan.push_back({moe, PrepareModuleOutput(partial, stream)});
    plan.push_back({moe + ".gate", ReplicateParallel()});
    for (const std::string& e : {moe + ".shared", moe + ".experts.*"}) {
      plan.push_back({e + ".w1", ColwiseParallel().prepared_input()});
      plan.push_back({e + ".w3", ColwiseParallel().prepared_input()});
      plan.push_back({e + ".w2", RowwiseParallel().output(partial)});
    }
  }
  for (MoEImpl* m : moes) {
    m->tp = group;
    m->tp_sequence_pieces = pieces;
  }
}

// Llama's attention (grouped-query, q/k/v colwise, o rowwise), with its per-head norms
// replicated (each rank's heads add a part of their gradients, summed over the group).
ParallelizePlan gqa_attention(const Placement& stream) {
  return {
      {"layers_*.attn", attention_input(stream)},
      {"layers_*.attn.wq", ColwiseParallel()},
      {"layers_*.attn.wk", ColwiseParallel()},
      {"layers_*.attn.wv", ColwiseParallel()},
      {"layers_*.attn.q_norm", ReplicateParallel()},
      {"layers_*.attn.k_norm", ReplicateParallel()},
      {"layers_*.attn.wo", RowwiseParallel().output(stream)},
  };
}

// A MoE family's plan completed (each block's experts, its dense MLPs, the embedding, norms
// and head) and applied to `model`.
template <typename Holder>
void parallelize_moe_model(Holder& model, ParallelizePlan plan, const Placement& stream, const CommPtr& group,
                           const TensorParallelOptions& o, const char* who) {
  std::vector<MoEImpl*> moes;
  for (auto& b : model->blocks) {
    if (b->moe) moes.push_back(b->moe.get());
  }
  add_moe(plan, "layers_*", stream, moes, group, o, who);
  add_common(plan, stream, o, "layers_*.mlp");
  parallelize_module(*model, group, present(plan, *model), ParallelizeOptions{o.reduce_dtype});
  if (o.loss_parallel) model->vocab_parallel_loss = group;
  if (o.sequence_parallel) model->stream_split = group->size();
}

}  // namespace

void parallelize_llama(Llama& model, const CommPtr& group, const TensorParallelOptions& o) {
  check_tensor_parallel(model->config, group->size());
  const Placement stream = o.sequence_parallel ? Shard(1) : Replicate();
  ParallelizePlan plan = gqa_attention(stream);
  add_common(plan, stream, o, "layers_*.mlp");
  parallelize_module(*model, group, present(plan, *model), ParallelizeOptions{o.reduce_dtype});
  if (o.loss_parallel) model->vocab_parallel_loss = group;
  if (o.sequence_parallel) model->stream_split = group->size();
  // Tied: the embedding is vocabulary-parallel (its rows split), which is the output head's
  // column split too; the model's forward moves the head's input and logits.
  if (model->config.tie_embeddings && model->slice.head) {
    model->tied_head_tp = group;
    model->tied_head_reduce_dtype = o.reduce_dtype;
  }
}

void check_tensor_parallel(const MoELlamaConfig& c, int64_t tp) {
  if (!check_gqa_split(c, tp)) return;
  HP_CHECK(c.moe_layers() == c.layers || c.dense_hidden % tp == 0, "tensor_parallel=", tp, ": dense_hidden=",
           c.dense_hidden, " is not divisible by it");
  HP_CHECK(c.moe_layers() == 0 || c.expert_hidden % tp == 0, "tensor_parallel=", tp, ": expert_hidden=",
           c.expert_hidden, " is not divisible by it");
}

void parallelize_moe_llama(MoELlama& model, const CommPtr& group, const TensorParallelOptions& o) {
  check_tensor_parallel(model->config, group->size());
  const Placement stream = o.sequence_parallel ? Shard(1) : Replicate();
  ParallelizePlan plan = gqa_attention(stream);
  parallelize_moe_model(model, std::move(plan), stream, group, o, "parallelize_moe_llama");
}

void parallelize_deepseek(DeepSeek& model, const CommPtr& group, const TensorParallelOptions& o) {
  const DeepSeekConfig& c = model->config;
  check_tensor_parallel(c, group->size());
  const Placement stream = o.sequence_parallel ? Shard(1) : Replicate();
  // MLA over the blocks at `blocks`, its input in `in`.
  const auto mla = [](const std::string& blocks, const Placement& in) -> ParallelizePlan {
    const std::string a = blocks + ".attn";
    return {
        {a, attention_input(in)},
        {a + ".wq_a", ReplicateParallel()},
        {a + ".q_norm", ReplicateParallel()},
        {a + ".wkv_a", ReplicateParallel()},
        {a + ".kv_norm", ReplicateParallel()},
        {a + ".wq_b", ColwiseParallel().prepared_input()},
        {a + ".wkv_b", ColwiseParallel().prepared_input()},
        {a + ".wo", RowwiseParallel().output(in)},
    };
  };
  ParallelizePlan plan = mla("layers_*", stream);
  if (!model->mtp.empty() && group->size() > 1) {
    // Multi-token prediction runs on the whole sequence (its T-1 positions do not split as
    // the stream's T): its block as the blocks without sequence parallelism; enorm, hnorm,
    // eh_proj and the norms, fed the same rows on every rank, stay whole.
    std::vector<MoEImpl*> moes;
    for (auto& m : model->mtp) {
      MoEImpl& moe = *m->block->moe;
      if (static_cast<int64_t>(moe.experts->list.size()) < c.experts) {
        HP_NOT_SUPPORTED("parallelize_deepseek: tensor parallelism (tp=", group->size(), ") over experts placed by ",
                         "expert_parallel with multi-token prediction (mtp_layers=", c.mtp_layers, ")");
      }
      moes.push_back(&moe);
    }
    for (auto& entry : mla("mtp_*.block", Replicate())) plan.push_back(entry);
    add_moe(plan, "mtp_*.block", Replicate(), moes, group, o, "parallelize_deepseek");
    model->tensor_parallel = group;
  }
  parallelize_moe_model(model, std::move(plan), stream, group, o, "parallelize_deepseek");
}

}  // namespace hp::models
