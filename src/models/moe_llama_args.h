// What the qwen3_moe and mixtral families share: MoELlama's arithmetic behind the seam
// (sizes, FLOPs, activations, what tensor and expert parallelism divide) and the keys both
// have. Each family's file adds its name, presets, the keys of its own and its model_type.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "family_util.h"
#include "hp/attn/attention.h"
#include "hp/models/moe_llama.h"

namespace hp::models::detail {

class MoELlamaArgs : public ReferenceArgs<MoELlamaArgs, MoELlamaConfig, MoELlama, MoEModelOf<MoELlama>> {
 public:
  using ReferenceArgs::ReferenceArgs;

  // The matmuls' width the planner times: the experts' where every block is sparse.
  int64_t ffn_hidden() const override { return has_dense() ? config.dense_hidden : config.expert_hidden; }
  int64_t largest_block_params() const override { return config.largest_block_params(); }

  int64_t stage_params(const PipelineSlice& sl) const override {
    const MoELlamaConfig& c = config;
    const int64_t end = check_slice(sl, c.layers);
    int64_t n = (sl.embedding ? c.vocab * c.dim : 0) + (sl.head ? c.dim + c.vocab * c.dim : 0);
    for (int64_t i = sl.first_layer; i < end; ++i) {
      n += c.attention_params() + (c.is_moe(i) ? c.moe_params() : c.dense_params());
    }
    return n;
  }
  std::string whole_under_tp() const override { return "norms, query/key norms and routers"; }
  // Every rank's heads add to the query/key norms' gradients, and every rank routes the
  // whole tokens through a MoE block's router; under sequence parallelism the block's two
  // norms and the output projection's bias see sequence pieces too. Of the largest block
  // (the MoE kind, listed last).
  SummedParams tp_summed_params(bool sequence_parallel) const override {
    const MoELlamaConfig& c = config;
    SummedParams s;
    if (c.qk_norm) s = {2, 2 * c.head_dim()};
    if (c.moe_layers() > 0) s = {s.tensors + 1, s.elements + c.dim * c.experts};
    if (sequence_parallel) {
      s = {s.tensors + 2 + (c.attention_bias ? 1 : 0), s.elements + 2 * c.dim + (c.attention_bias ? c.dim : 0)};
    }
    return s;
  }

  // Per block, averaged over the blocks (routed: one MoE block's): the matmuls of the active parameters (a MoE
  // block's router and the experts a token runs; a dense block's SwiGLU) and attention's
  // two products over the scores the causal tiles compute.
  FlopCount flops_per_token(int64_t seq_length) const override {
    const MoELlamaConfig& c = config;
    const double T = static_cast<double>(seq_length), L = static_cast<double>(c.layers);
    const double sparse = static_cast<double>(c.moe_layers()) / L;
    const double expert = 2.0 * 3.0 * static_cast<double>(c.dim * c.expert_hidden);
    FlopCount f;
    // One MoE block's (what its exchange can hide behind); block averages it in.
    f.routed = c.moe_layers() > 0 ? expert * static_cast<double>(c.experts_per_token) : 0.0;
    f.block = 2.0 * static_cast<double>(c.attention_params()) +
              sparse * (2.0 * static_cast<double>(c.dim * c.experts) + f.routed) +
              (1.0 - sparse) * 2.0 * static_cast<double>(c.dense_params()) +
              4.0 * attn::causal_score_elements(seq_length, c.attention_tile) / T * static_cast<double>(c.heads) *
                  static_cast<double>(c.head_dim());
    f.head = 2.0 * static_cast<double>(c.vocab * c.dim);
    return f;
  }
  // As Llama's (the norms' inputs and outputs, q, k, v, attention's log-sum-exps and
  // output), with the per-head norms' outputs, and the feed-forward's four hidden-size
  // products of the experts a token runs (a MoE block: the router's scores too), of the
  // largest kind of block.
  ActivationCount activations_per_token(int64_t seq_length) const override {
    const MoELlamaConfig& c = config;
    const bool moe = c.moe_layers() > 0;
    const double d = static_cast<double>(c.dim), q = static_cast<double>(c.heads * c.head_dim());
    const double kv = static_cast<double>(c.kv_heads * c.head_dim()), h = static_cast<double>(c.heads);
    const double hidden =
        moe ? static_cast<double>(c.expert_hidden * c.experts_per_token) : static_cast<double>(c.dense_hidden);
    const double router = moe ? static_cast<double>(c.experts) : 0.0;
    const double norms = c.qk_norm ? q + kv : 0.0;
    ActivationCount a;
    a.block = 4.0 * d + 2.0 * q + 2.0 * kv + norms + 4.0 * hidden + router + h;
    a.head = static_cast<double>(c.vocab);
    a.attention = h;
    a.attention_workspace = h * attn::tile_workspace_elements(seq_length, c.attention_tile);
    // Light recompute: the block's input; wq, wk, wv and wo's outputs; attention's output
    // and log-sum-exps; the feed-forward's Linear outputs (w1, w3, w2 of each expert a token
    // runs, or the dense SwiGLU's; a MoE's router scores).
    const double ffn = moe ? router + static_cast<double>(c.experts_per_token) *
                                          (2.0 * static_cast<double>(c.expert_hidden) + d)
                           : 2.0 * static_cast<double>(c.dense_hidden) + d;
    a.light = d + q + 2.0 * kv + d + q + h + ffn;
    return a;
  }
  AttentionWidths attention_widths() const override {
    const MoELlamaConfig& c = config;
    return {2.0 * static_cast<double>(c.kv_heads * c.head_dim()), 2.0 * static_cast<double>(c.heads * c.head_dim()),
            c.heads, c.kv_heads};
  }

  int64_t routed_experts() const override { return config.moe_layers() > 0 ? config.experts : 0; }
  // Keeps the kinds of block the model has (the planner's models of 1 and 2 layers): with
  // dense blocks between MoE ones, 1 layer is a dense block, 2 a dense and a MoE one, more
  // every sparse_step-th (at most every second) a MoE; all dense stays all dense.
  void set_layers(int64_t layers) override {
    MoELlamaConfig& c = config;
    const bool any_moe = c.moe_layers() > 0, any_dense = has_dense();
    c.layers = layers;
    if (any_moe && any_dense) {
      c.sparse_step = std::min(c.sparse_step, std::max<int64_t>(2, layers));
    } else if (any_dense) {
      c.sparse_step = layers + 1;
    }
  }
  int64_t stage_expert_params(const PipelineSlice& sl) const override {
    const int64_t end = check_slice(sl, config.layers);
    int64_t moe = 0;
    for (int64_t i = sl.first_layer; i < end; ++i) moe += config.is_moe(i) ? 1 : 0;
    return moe * block_expert_params();
  }
  int64_t block_expert_params() const override { return routed_experts() * 3 * config.dim * config.expert_hidden; }
  int64_t experts_per_token() const override { return routed_experts() > 0 ? config.experts_per_token : 0; }
  int64_t largest_block_params_outside_experts() const override {
    const MoELlamaConfig& c = config;
    return c.attention_params() + std::max(has_dense() ? c.dense_params() : 0, c.moe_layers() > 0 ? c.dim * c.experts : 0);
  }

  // Per kind of block (dense where there is one, then MoE): its parameters, and those
  // tensor parallelism keeps whole: the two norms, the query/key norms, the output
  // projection's bias, a MoE block's router.
  std::vector<BlockKind> kinds() const {
    const MoELlamaConfig& c = config;
    const int64_t whole = 2 * c.dim + (c.qk_norm ? 2 * c.head_dim() : 0) + (c.attention_bias ? c.dim : 0);
    std::vector<BlockKind> out;
    if (has_dense()) out.push_back({c.attention_params() + c.dense_params(), whole, c.layers - c.moe_layers()});
    if (c.moe_layers() > 0) out.push_back({c.attention_params() + c.moe_params(), whole + c.dim * c.experts, c.moe_layers()});
    return out;
  }

 private:
  bool has_dense() const { return config.moe_layers() < config.layers; }
};

// The keys both families have, in --list-keys' order, with `own` (the family's) after the
// attention's and the experts' and the rotary keys last.
inline std::vector<ModelKey> moe_llama_keys(std::vector<ModelKey> own) {
  using C = MoELlamaConfig;
  std::vector<ModelKey> k = {
      int_key<C>("vocab", &C::vocab, 2, "vocabulary size (at least 2)"),
      int_key<C>("dim", &C::dim, 1, "hidden size"),
      int_key<C>("layers", &C::layers, 1, "transformer blocks"),
      int_key<C>("heads", &C::heads, 1, "attention heads"),
      int_key<C>("kv_heads", &C::kv_heads, 1, "grouped-query key/value heads"),
      int_key<C>("head_dim", &C::explicit_head_dim, 0, "attention head size (0: dim / heads)"),
      int_key<C>("max_seq", &C::max_seq, 1, "longest sequence (rotary table)"),
      on_resume(int_key<C>("attention_tile", &C::attention_tile, 1,
                           "attention's tile: queries and keys in tiles of this many positions (no S x S scores)"),
                ResumeRule::kFree),
      float_key<C>("rope_theta", &C::rope_theta, 0, true, "rotary base"),
      float_key<C>("norm_eps", &C::norm_eps, 0, true, "RMSNorm epsilon"),
      int_key<C>("experts", &C::experts, 1, "routed experts per MoE block"),
      int_key<C>("experts_per_token", &C::experts_per_token, 1, "routed experts each token uses"),
      int_key<C>("expert_hidden", &C::expert_hidden, 1, "expert hidden size"),
  };
  for (ModelKey& o : own) k.push_back(std::move(o));
  for (ModelKey& c : capacity_keys<C>()) k.push_back(std::move(c));
  for (ModelKey& r : rope_keys<C>()) k.push_back(std::move(r));
  return k;
}

}  // namespace hp::models::detail
