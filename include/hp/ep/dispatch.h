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

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  virtual Dispatched dispatch(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights) = 0;
  virtual at::Tensor combine(const at::Tensor& y, const Dispatched& d) = 0;
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
// Under recompute backward also runs forward's again: the planner adds that. Nothing for a
// group of one.
struct ExchangeCost {
  std::vector<CollectiveCost> forward, backward;
};
ExchangeCost dispatch_traffic(DispatcherKind kind, const ExchangeShape& s);
// tokens x ep x (1 - C(E - E/ep, k) / C(E, k)): the copies the de-duplicating dispatcher
// sends when each token's k experts are drawn uniformly without replacement.
double expected_copies(double tokens, int64_t experts, int ep, int64_t k);

// Differentiable all-to-all of rows: send_splits[r] rows of `x` (in rank order) to rank r,
// recv_splits[r] rows from it; the backward sends the gradient back the same way reversed.
at::Tensor all_to_all_rows(const at::Tensor& x, const CommPtr& group, const std::vector<int64_t>& send_splits,
                           const std::vector<int64_t>& recv_splits);

}  // namespace hp::ep
