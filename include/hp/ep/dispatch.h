// hp::ep: expert parallelism's token movement.
//
// A mixture-of-experts layer sends each token to the k experts its router chose. Under
// expert parallelism (EP) the E experts are split over the EP group: rank r holds experts
// [r*E/ep, (r+1)*E/ep), its "local experts". A TokenDispatcher moves the routed rows to the
// ranks that hold their experts and brings the experts' outputs back:
//
//   dispatch(x [tokens, dim], expert_ids [tokens, k], weights [tokens, k])
//     1. sorts the (token, slot) pairs by expert id, stably (ties keep token order): the
//        rows leave in expert-major order, and their count per expert is known;
//     2. exchanges the counts (an all-to-all of E/ep counts with each rank), then the rows
//        (an all-to-all with uneven splits); the rows arrive rank-major (rank 0's rows for
//        my experts, then rank 1's, ...), each rank's block expert-major;
//     3. reorders them expert-major: local expert i's rows form one contiguous block of
//        counts[i] rows, its rows from rank 0 first.
//   combine(y, dispatched) -> [tokens, dim]: out[t] = sum_j weights[t, j] * y(t, j), where
//     y(t, j) is the expert output for token t's j-th choice. The rows travel back by the
//     reverse of dispatch (expert-major -> rank-major, the all-to-all with the splits
//     swapped, the inverse of the sort); the weighted sum runs at the token's own rank in
//     at least fp32, over j in order (deterministic).
//
// An expert id of -1 marks a dropped slot (a capacity limit's): it is not sent, and adds
// nothing to its token's output.
//
// Both are differentiable: dispatch's backward is a combine of the gradient (without the
// weights) and combine's backward is a dispatch; the weights get their gradient at the
// token's rank. Experts that receive no rows and ranks that send or receive nothing work
// both ways. A rank must call dispatch and combine as often, and in the same order, as
// every other rank of its EP group (they are collectives), with tokens and weights that
// require a gradient on every rank or on none (the backward's collectives follow them).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/comm/simulated_network.h"

namespace hp::ep {

// The stable sort of routed slots by expert: slot s = t*k + j is token t's j-th choice.
// Dropped slots (id -1) come last, after every expert's, and are counted nowhere.
struct ExpertSort {
  at::Tensor order;   // int64 [tokens*k]: the slots in expert-major order, the dropped last
  at::Tensor counts;  // int64 [experts]: slots per expert
};
// Raises naming the offending id when one is outside [0, experts) and not -1.
ExpertSort sort_by_expert(const at::Tensor& expert_ids, int64_t experts);

// Rows received rank-major, `counts` [ep * local_experts] (rank-major: counts[r*L + i] rows
// from rank r for local expert i), reordered expert-major: the source row of each position.
// counts [2,3,1,4] with 2 local experts -> [0,1,5,2,3,4,6,7,8,9].
at::Tensor expert_major_order(const at::Tensor& counts, int64_t local_experts);

// What dispatch leaves for its combine (each implementation's permutations and splits).
struct DispatchContext {
  virtual ~DispatchContext() = default;
};

struct Dispatched {
  at::Tensor rows;              // [sum(counts), dim]: local expert 0's rows, then 1's, ...
  std::vector<int64_t> counts;  // rows per local expert
  // Bytes this rank sends to the other ranks of the group: dispatch's (rows, counts and,
  // for the de-duplicating dispatcher, the routing) and combine's (the outputs going back).
  int64_t dispatch_bytes = 0, combine_bytes = 0;
  std::shared_ptr<const DispatchContext> context;
};

struct ExchangeChunks;  // InFlight's state (src/ep/overlap.cpp)

// A dispatch whose rows are still on the wire, in chunks of local experts: chunk g is local
// experts [chunk_first(g), chunk_first(g + 1)), chunks() of them as even as the count
// allows. dispatch_overlapped issues every chunk's row all-to-all at once (they run on the
// communicator's thread, in chunk order); rows(g) waits for chunk g only, and send_back(g, y)
// issues chunk g's outputs back without waiting. So the experts of chunk g run while the
// rows of the later chunks and the outputs of the earlier ones move, and the caller's
// work between dispatch_overlapped and rows(0) (the shared experts) overlaps the first
// chunk. The backward does the same in reverse: every chunk's output gradient is issued at
// once, and each chunk's rows' gradient goes back as soon as its experts' backward is done.
//
// Every expert gets the rows dispatch would give it, in the same order, and the outputs
// land where combine would put them, so the results, the gradients and the bytes sent are
// bitwise those of dispatch and combine; only the number of all-to-alls grows (one per
// chunk each way). Use it as: for g = 0 .. chunks()-1, rows(g), run chunk g's experts,
// send_back(g, y); then returned(), and the dispatcher's combine_overlapped. A call out of
// that order raises naming it. Every rank of the group takes the same number of chunks.
class InFlight {
 public:
  InFlight() = default;
  explicit InFlight(std::shared_ptr<ExchangeChunks> chunks, at::Tensor sent);
  int chunks() const;
  // g in [0, chunks()]; chunk_first(chunks()) is the local expert count.
  int64_t chunk_first(int g) const;
  // Rows per expert of chunk g (known when dispatched).
  const std::vector<int64_t>& counts(int g) const;
  // Waits for chunk g's rows: [sum(counts(g)), dim], expert-major. Differentiable.
  at::Tensor rows(int g);
  // Issues chunk g's expert outputs (one row per row of rows(g)) back to their tokens' ranks.
  void send_back(int g, const at::Tensor& y);
  // Waits for every chunk's outputs: one row per row dispatched, in the order they were sent.
  at::Tensor returned();
  int64_t dispatch_bytes = 0, combine_bytes = 0;  // as Dispatched's
  std::shared_ptr<const DispatchContext> context;

 private:
  std::shared_ptr<ExchangeChunks> chunks_;
  std::vector<at::Tensor> arrived_, back_;  // the chunks' autograd outputs, until used
  int next_rows_ = 0, next_back_ = 0;
};

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  virtual Dispatched dispatch(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights) = 0;
  virtual at::Tensor combine(const at::Tensor& y, const Dispatched& d) = 0;
  // dispatch and combine with the all-to-alls overlapped in `chunks` chunks of local experts
  // (1 <= chunks <= local_experts(); raises naming both otherwise). Bitwise the results of
  // dispatch and combine. The de-duplicating dispatcher raises "not supported yet".
  virtual InFlight dispatch_overlapped(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                                       int chunks);
  // The tokens' outputs from `returned` (InFlight::returned()), as combine's.
  virtual at::Tensor combine_overlapped(const at::Tensor& returned, const InFlight& f);
  int64_t experts() const { return experts_; }
  int64_t ep_size() const { return ep_size_; }
  int64_t ep_rank() const { return ep_rank_; }
  int64_t local_experts() const { return experts_ / ep_size_; }
  int64_t first_local_expert() const { return ep_rank_ * local_experts(); }

 protected:
  TokenDispatcher(int64_t experts, int64_t ep_size, int64_t ep_rank);

 private:
  int64_t experts_, ep_size_, ep_rank_;
};

// Every expert on this rank (EP 1): the sort and its inverse, no communication.
std::shared_ptr<TokenDispatcher> local_dispatcher(int64_t experts);
// Experts split over `ep` (its size must divide `experts`; raises naming both): one row
// per (token, chosen expert) pair crosses the all-to-all.
std::shared_ptr<TokenDispatcher> all_to_all_dispatcher(const CommPtr& ep, int64_t experts);
// The same placement, one copy of a token per destination rank (however many of its
// experts that rank holds), with its local expert ids and weights beside it; the
// destination fans it out to its experts, weighs their outputs and sends back one partial
// sum per token, which the token's rank adds up in rank order. Fewer bytes when a token's
// experts share ranks (top-8 of 256 over 64 ranks: about 7.6 ranks per token instead of 8
// rows; over 8 ranks about 5.3), two small all-to-alls more per dispatch (ids, weights).
std::shared_ptr<TokenDispatcher> dedup_all_to_all_dispatcher(const CommPtr& ep, int64_t experts);

// Which dispatcher moves the tokens of an expert-parallel group.
enum class DispatcherKind {
  kAllToAll,  // all_to_all_dispatcher
  kDedup,     // dedup_all_to_all_dispatcher
};
// How an MoE layer moves its tokens: which dispatcher, and in how many chunks of local
// experts its all-to-alls overlap the experts' compute (1: none; see InFlight).
struct DispatchOptions {
  DispatcherKind kind = DispatcherKind::kAllToAll;
  int64_t overlap_chunks = 1;
};
// The dispatcher of `kind` over `ep`; a group of one (or none): local_dispatcher.
std::shared_ptr<TokenDispatcher> make_dispatcher(DispatcherKind kind, const CommPtr& ep, int64_t experts);

// One MoE layer's token exchange over an EP group, for one micro-batch of a rank: what the
// planner sums, stated beside the dispatchers that issue it.
struct ExchangeShape {
  int ep = 1;
  int64_t experts = 0;
  double tokens = 0;        // routed on this rank
  int64_t k = 1;            // choices per token
  double row_bytes = 0;     // a token's hidden state (the compute dtype)
  double weight_bytes = 4;  // a routing weight
  // The de-duplicating dispatcher's copies: tokens x the distinct ranks each token's experts
  // sit on (expected_copies() under uniform routing). Unread by the all-to-all one.
  double copies = 0;
  // Chunks of local experts the row all-to-alls are split into (dispatch_overlapped): the
  // same bytes in `chunks` times the ops. The per-expert counts stay one exchange.
  int chunks = 1;
};
// The all-to-alls of dispatch and combine (forward) and of their backward (combine's reverse
// and dispatch's, with the weights' gradient for dedup), with the routing taken as balanced
// (each rank sends every rank an equal share of its rows, its own included):
//   all_to_all  forward: the per-expert counts (int64), the rows, the outputs back;
//               backward: the outputs' gradient out, the rows' gradient back.
//   dedup       forward: the per-rank counts (int64), the copies, their local expert ids
//               (int64, k each), their weights (k each), the partial sums back;
//               backward: the partial sums' gradient out, the copies' and the weights'
//               gradients back.
// Under full or selective recompute backward also runs forward's again, and under light with
// the exchange overlapped (all_to_all_rows keeps the rest): the planner adds that. Nothing
// for a group of one.
struct ExchangeCost {
  std::vector<CollectiveCost> forward, backward;
};
ExchangeCost dispatch_traffic(DispatcherKind kind, const ExchangeShape& s);
// The bytes a rank keeps, per MoE layer and micro-batch, where a block recomputed under
// RecomputePolicy::kLight keeps what its exchanges delivered (all_to_all_rows), routing taken
// as balanced: plain, the rows received and the outputs returned (tokens x k rows each) and
// the per-expert counts; de-duplicating, the copies received and the partial sums returned
// (`copies` rows each), the copies' expert ids (int64) and weights (k each), the per-rank
// counts. 0 for a group of one and with chunks > 1 (the overlapped exchange is not kept).
double light_kept_bytes(DispatcherKind kind, const ExchangeShape& s);
// The exchange's exposed seconds in one MoE layer with its all-to-alls overlapped in
// `chunks` chunks (InFlight), from the times of its parts, by replaying the order it issues
// and waits in: the communicator's thread runs one all-to-all at a time in issue order, the
// caller one computation at a time.
//   forward: every chunk's rows issued at once; the shared experts, then chunk g's experts
//     once its rows are in, then its outputs issued; done when the last outputs are back;
//   backward: every chunk's output gradient issued at once (the last chunk first), then per
//     chunk its experts' backward once its gradient is in and its rows' gradient issued; the
//     shared experts' backward after the last chunk's; done when the last rows' gradient is in.
// Exposed = that span less the compute in it. chunks 1 is the plain exchange, none of it
// hidden: dispatch + combine. The counts' exchange (waited at once) is not included.
struct OverlapTimes {
  double rows = 0, outputs = 0;                      // one chunk's all-to-all each way (seconds)
  double experts_forward = 0, experts_backward = 0;  // the routed experts, all chunks
  double shared_forward = 0, shared_backward = 0;
  int chunks = 1;
};
struct Exposure {
  double forward = 0, backward = 0;
};
Exposure overlap_exposure(const OverlapTimes& t);

// tokens x ep x (1 - C(E - E/ep, k) / C(E, k)): the copies the de-duplicating dispatcher
// sends when each token's k experts are drawn uniformly without replacement.
double expected_copies(double tokens, int64_t experts, int ep, int64_t k);

// Differentiable all-to-all of rows: send_splits[r] rows of `x` (in rank order) to rank r,
// recv_splits[r] rows from it; the backward sends the gradient back the same way reversed.
// A step that RecomputePolicy::kLight keeps (hp::keep_step): inside a block recomputed under
// it, the rows that arrived in the first forward are kept and the recomputation takes them
// instead of exchanging again; the backward still sends the gradient back. The dispatchers'
// other exchanges (counts, the de-duplicating one's expert ids) are kept the same way, so
// under kLight a recomputed MoE block issues the all-to-alls of the run without recompute,
// no more (the overlapped exchange, dispatch_overlapped, is exchanged again: not kept yet).
at::Tensor all_to_all_rows(const at::Tensor& x, const CommPtr& group, const std::vector<int64_t>& send_splits,
                           const std::vector<int64_t>& recv_splits);

}  // namespace hp::ep
