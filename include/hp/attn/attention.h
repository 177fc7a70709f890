// hp::attn: attention computed in tiles, never forming the S x S matrix of scores.
//
// The one implementation of softmax attention in the project: the models call it on their
// whole sequence, the context-parallel layer (hp/cp) on each source of keys it holds or
// receives. Queries and keys are cut into tiles of at most `tile` positions. For a query
// tile the key tiles are visited in turn with a running maximum and sum per row (the
// flash-attention recurrence), so only one tile × tile block of scores per head lives at a
// time; the forward keeps its output and one log-sum-exp per row and head. The backward
// recomputes each block's probabilities from that log-sum-exp. Under a causal mask a
// (query tile, key tile) pair whose keys all come after its queries is skipped, one whose
// keys all come at or before is computed without a mask, and only a pair straddling the
// diagonal is masked.
//
// Memory: besides q, k, v and the output, a forward keeps one value per row and head; while
// computing it holds a few tile × tile blocks per (batch, head) and, for inputs below
// float32, float32 copies of its accumulators (the output, and in backward dq, dk, dv).
// Nothing grows with S².
//
// Grouped-query attention: q has `heads` heads, k and v `kv_heads`, heads % kv_heads == 0;
// query head h uses key/value head h / (heads / kv_heads), as Hugging Face's
// repeat_kv does. Keys and values are never repeated in memory.
//
// Precision: computed in float64 for float64 inputs, in float32 otherwise, and returned in
// q's dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace torch::autograd {
struct AutogradContext;
}

namespace hp::attn {

enum class Mask { kCausal, kNone };

// The tile size the models use unless their config says otherwise (model.attention_tile).
constexpr int64_t kDefaultTile = 64;

// A run of consecutive positions of a sequence held in a tensor: positions
// [start, start + length) sit at indices [offset, offset + length) of its token dim.
struct Run {
  int64_t start = 0, length = 0, offset = 0;
};

// The runs cut into tiles of at most `tile` positions, each run's in order (a run of 10 at
// tile 4: 4, 4, 2). Raises hp::Error for tile < 1.
std::vector<Run> tile_runs(const std::vector<Run>& runs, int64_t tile);

// Work counted by the calls given a TileCounts (forward only).
struct TileCounts {
  int64_t blocks = 0;          // (query tile, key tile) pairs computed
  int64_t masked_blocks = 0;   // of them, those straddling the diagonal
  int64_t score_elements = 0;  // query × key pairs those blocks computed
};

// What the kernel computes and holds, for the estimators (models' FLOPs and activations,
// the planner), tested equal to TileCounts and to the counting allocator:
// query × key pairs of one head a causal attention over `seq` tokens in tiles of `tile`
// computes (the tiles straddling the diagonal whole): TileCounts::score_elements. Without a
// mask: seq².
double causal_score_elements(int64_t seq, int64_t tile);
// Float32 elements (float64 for float64 inputs) one (sequence, head) holds while the tiles
// compute, beyond what grows with the sequence: a block of scores and its product with the
// values' gradient, tile² each. Raises for tile < 1.
double tile_workspace_elements(int64_t seq, int64_t tile);

// Raises hp::Error, prefixed by `who`, unless q [B, heads, T, d], k [B, kv_heads, T, d] and
// v [B, kv_heads, T, dv] agree (same batch and tokens, heads % kv_heads == 0, one floating
// dtype).
void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* who);

// 1 / sqrt(d) for scale 0, else scale.
double scale_or_default(double scale, const at::Tensor& q);

// Attention of q over k and v, all three holding the whole sequence in order. Returns
// [B, heads, T, dv] in q's dtype; differentiable in q, k and v. `scale` multiplies the
// scores (0: 1 / sqrt(d)). Raises hp::Error for mismatched shapes or tile < 1.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Mask mask, double scale = 0.0,
                     int64_t tile = kDefaultTile);

// The same over a sequence in any order: the queries and keys at the positions their runs
// give (each run is tiled). The runs must cover each tensor's token dim exactly once.
// `counts`, when given, is added to.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<Run>& q_runs,
                     const std::vector<Run>& k_runs, Mask mask, double scale, int64_t tile,
                     TileCounts* counts = nullptr);

// For a step recomputation keeps (hp::keep_step, RecomputePolicy::kLight): the whole
// sequence's attention as attention() computes it, with its log-sum-exps [B, heads, T, 1]
// (not differentiable) beside the output; and the output rebuilt from those two, with
// attention()'s backward, without computing it again (q, k and v must be those they came
// from).
std::pair<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     Mask mask, double scale = 0.0, int64_t tile = kDefaultTile);
at::Tensor attention_from_kept(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               const at::Tensor& lse, Mask mask, double scale = 0.0, int64_t tile = kDefaultTile);

// The pieces the two calls above are made of, for a layer that brings the keys in several
// sources (hp/cp). Tensors are in the compute dtype (compute_dtype(q)); q [B, H, Tq, d],
// k [B, KVH, Tk, d], v [B, KVH, Tk, dv]; runs already tiled.
at::ScalarType compute_dtype(const at::Tensor& q);
// Merges the attention of q over this source's keys into (o [B, H, Tq, dv],
// lse [B, H, Tq, 1]) through the log-sum-exp: start with zeros and -inf.
void forward_source(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<Run>& q_tiles,
                    const std::vector<Run>& k_tiles, Mask mask, double scale, at::Tensor& o, at::Tensor& lse,
                    TileCounts* counts = nullptr);
// The gradient through one source: adds to dq [B, H, Tq, d] and returns the source's
// (dk, dv), KVH heads. `lse` is the forward's over every source, `delta` = rowsum(dO · O)
// [B, H, Tq, 1].
std::pair<at::Tensor, at::Tensor> backward_source(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const std::vector<Run>& q_tiles, const std::vector<Run>& k_tiles,
                                                  Mask mask, double scale, const at::Tensor& dout,
                                                  const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq);

// The start and end of an autograd function over these pieces, shared by the local one and
// the CP layer's: begin_forward gives q in the compute dtype and the (o, lse) to merge into;
// end_forward saves what backward needs (q, k, v, the output in q's dtype, lse) in `ctx` and
// returns the output; begin_backward reads them back with the output's gradient and its
// delta in the compute dtype, and a zero dq.
struct ForwardState {
  at::Tensor qc, o, lse;
};
ForwardState begin_forward(const at::Tensor& q, const at::Tensor& v);
at::Tensor end_forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const ForwardState& f);
struct BackwardState {
  at::Tensor q, k, v, lse;          // as saved
  at::Tensor qc, dout, delta, dq;   // compute dtype
};
BackwardState begin_backward(torch::autograd::AutogradContext* ctx, const at::Tensor& grad_out);

}  // namespace hp::attn
