// hp::cp: context parallelism (CP). A sequence of S tokens is split over the cp ranks of a
// group: each rank holds S / cp of them, computes every per-token layer on those alone,
// and exchanges keys and values only inside attention. Activations per rank shrink by cp.
//
// Sequence split (SequenceSplit):
//   kHeadTail   the sequence is cut into 2·cp equal chunks and rank r takes chunks r and
//               2cp−1−r (in that order). Under a causal mask every rank then does the same
//               attention work: the early chunk sees few keys, the late one many.
//               S 8, cp 2: rank 0 holds positions [0 1 6 7], rank 1 [2 3 4 5].
//   kContiguous rank r takes positions [r·S/cp, (r+1)·S/cp): the last rank does cp times
//               the causal work of the first. For non-causal attention, where it is even.
// Inputs, targets and positions are permuted alike (shard): rotary embeddings must be taken
// at each token's true position (positions(rank)), and the loss is a mean over the same
// tokens whatever their order. restore() undoes the permutation of gathered pieces.
//
// Attention over the split sequence (ContextParallel::attention), by Method:
//   kAllGather  the keys and values of every rank are gathered (one all-gather per call,
//               K and V packed together) and each rank attends its queries to all of them;
//               backward reduce-scatters the K/V gradient back to its owners (one call).
//   kRing       K/V blocks travel around the ring of CP ranks: cp−1 exchanges forward (each
//               started before the block in hand is computed, so the transfer overlaps the
//               compute); backward passes K/V around again (cp−1) and the K/V gradient
//               accumulators with them (cp: the last brings each home), 3cp−2 in all. The
//               exchanges run on a communicator of their own, split from the group.
//   kUlysses    all-to-all from sequence-split to head-split (each rank gets heads/cp query
//               heads and kv_heads/cp key/value heads for the whole sequence), attention in
//               full, and all-to-all back: 4 all-to-alls forward (q, k, v, out), 4 backward.
//               Needs heads and kv_heads divisible by cp.
// Every method computes attention in tiles with hp/attn's kernel, the one the models use
// without CP: each rank's runs of the sequence are cut into tiles of the model's
// attention_tile (not tied to S / 2cp), a (query tile, key tile) pair whose keys all come
// after its queries is skipped under a causal mask, and the sources of keys a rank holds
// or receives are merged through their log-sum-exp in float32 (float64 for float64 inputs).
// The backward recomputes each tile's probabilities from the saved log-sum-exp, so no S×S
// matrix is kept.
//
// Collectives: attention is a collective of the group; every rank calls it as often, with
// the same shapes and dtype, in the same order (also under recompute). Errors in the
// shapes or the options raise hp::Error before anything is sent.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/attn/attention.h"
#include "hp/comm/communicator.h"
#include "hp/comm/simulated_network.h"

namespace hp::cp {

enum class Split { kHeadTail, kContiguous };
enum class Method { kAllGather, kRing, kUlysses };
using Mask = attn::Mask;

const char* split_name(Split s);    // "head_tail", "contiguous"
const char* method_name(Method m);  // "allgather", "ring", "ulysses"

// A run of consecutive positions a rank holds: positions [start, start + length) sit at
// local indices [offset, offset + length).
using Run = attn::Run;

// How `seq` tokens are split over `cp` ranks. Raises hp::Error naming the values for cp < 1,
// seq < 1, a sequence shorter than the chunks need (2·cp under kHeadTail, cp otherwise) or
// not divisible by them.
class SequenceSplit {
 public:
  SequenceSplit(int64_t seq, int cp, Split split = Split::kHeadTail);
  int64_t seq() const { return seq_; }
  int cp() const { return cp_; }
  Split split() const { return split_; }
  int64_t local() const { return seq_ / cp_; }  // tokens per rank
  // The runs rank `rank` holds, in local order (2 under kHeadTail, 1 otherwise).
  std::vector<Run> runs(int rank) const;
  // The global positions rank `rank` holds, in local order (int64 [local()]).
  at::Tensor positions(int rank) const;
  // Every rank's positions, rank 0's first (int64 [seq]): where the i-th token of the
  // gathered pieces sits in the sequence.
  at::Tensor order() const;

 private:
  int64_t seq_;
  int cp_;
  Split split_;
};

// Rank `rank`'s piece of `x` along `dim` (of size split.seq()), its tokens in local order.
at::Tensor shard(const at::Tensor& x, int64_t dim, const SequenceSplit& split, int rank);
// The pieces of every rank concatenated along `dim` in rank order, put back in sequence order.
at::Tensor restore(const at::Tensor& gathered, int64_t dim, const SequenceSplit& split);

struct ContextParallelOptions {
  Method method = Method::kRing;
  Split split = Split::kHeadTail;
};

// Work and traffic of this rank's attention calls, summed since the last reset_stats().
// (The tiles computed: attn::TileCounts, forward.)
struct AttentionStats : attn::TileCounts {
  int64_t bytes_sent = 0;  // payload this rank sent, forward and backward
};

class ContextParallel {
 public:
  // A collective of `group` (the ring method splits a communicator off it). Raises for a null
  // group.
  explicit ContextParallel(CommPtr group, ContextParallelOptions o = {});
  ContextParallel(const ContextParallel&) = delete;
  ContextParallel& operator=(const ContextParallel&) = delete;

  int size() const;
  int rank() const;
  const ContextParallelOptions& options() const { return options_; }
  const CommPtr& group() const { return group_; }
  // The split of a sequence of `seq` tokens over this group (raises as SequenceSplit does).
  SequenceSplit split_of(int64_t seq) const { return SequenceSplit(seq, size(), options_.split); }

  // Attention of this rank's queries over the whole sequence. q [B, heads, T, d],
  // k [B, kv_heads, T, d], v [B, kv_heads, T, dv]: this rank's T = seq / cp tokens in local
  // order (shard); heads % kv_heads == 0 (each group of heads / kv_heads query heads shares
  // one key/value head). Returns [B, heads, T, dv] in q's dtype; differentiable in q, k, v.
  // `scale` multiplies the scores (0: 1 / sqrt(d)); `tile` is the kernel's (hp/attn). Raises
  // for mismatched shapes, tile < 1, kHeadTail with Mask::kNone (load balance serves a
  // causal mask only: use kContiguous), and kUlysses with heads or kv_heads not divisible by
  // cp.
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Mask mask,
                       double scale = 0.0, int64_t tile = attn::kDefaultTile);

  const AttentionStats& stats() const { return *stats_; }
  void reset_stats() { *stats_ = AttentionStats{}; }

 private:
  CommPtr group_, ring_;
  ContextParallelOptions options_;
  std::shared_ptr<AttentionStats> stats_;
};

// One attention call's exchanges on a rank, as each method issues them: what the planner
// sums, stated beside the runtime.
struct AttentionShape {
  int cp = 1;
  double tokens = 0;        // this rank's: batch x seq / cp
  double kv_width = 0;      // a token's keys and values, elements (kv_heads x (d + dv))
  double q_out_width = 0;   // a token's queries and output, elements (heads x (d + dv))
  double elem_bytes = 4;    // q, k, v's dtype
  double grad_bytes = 4;    // the K/V gradients' accumulation dtype (float32; float64 inputs: float64)
};
// Forward, and backward (its own; under recompute the planner adds forward's again):
//   kRing       cp-1 sends of the packed K/V forward; backward cp-1 again and cp of the
//               K/V gradient accumulators (each a send to the next rank, received from the
//               previous one: one batch_send_recv);
//   kAllGather  one all-gather of the packed K/V forward; backward the gather again and a
//               reduce-scatter of their gradients;
//   kUlysses    4 all-to-alls each way (q, k, v, and the output or its gradient), of
//               q_out_width + kv_width in all, counted as 4 equal ones.
// Nothing for a group of one.
struct AttentionCost {
  std::vector<CollectiveCost> forward, backward;
};
AttentionCost attention_traffic(Method m, const AttentionShape& s);

}  // namespace hp::cp
