#include "hp/ep/dispatch.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <utility>

#include "../comm/group_capsule.h"
#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/core/turns.h"
#include "hp/hooks/recompute.h"
#include "overlap.h"

namespace hp::ep {
namespace {

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

at::Tensor exchange(const at::Tensor& x, const CommPtr& g, const std::vector<int64_t>& send,
                    const std::vector<int64_t>& recv) {
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = sum(recv);
  at::Tensor out = at::empty(shape, in.options());
  AllToAllOptions o;
  o.output_split_sizes = recv;
  o.input_split_sizes = send;
  Work w = g->all_to_all(out, in, o);
  // Inside a pipeline's paired forward and backward (hp/pp/pipeline.h) the other one computes
  // while the rows travel.
  hp::yield_turn();
  if (trace::enabled()) {
    // What of the exchange this rank waits for (exposed), as a span "ep wait exchange".
    trace::Span span("ep wait exchange", "ep");
    w.wait();
  } else {
    w.wait();
  }
  return out;
}

void save_route(torch::autograd::AutogradContext* ctx, const CommPtr& g, const std::vector<int64_t>& send,
                const std::vector<int64_t>& recv) {
  ctx->saved_data["group"] = detail::group_capsule(g);
  ctx->saved_data["send"] = send;
  ctx->saved_data["recv"] = recv;
}

// The gradient goes back the way the rows came: what was received is sent.
at::Tensor route_back(torch::autograd::AutogradContext* ctx, const at::Tensor& grad) {
  const CommPtr g = detail::group_of_capsule(ctx->saved_data["group"]);
  return exchange(grad, g, ctx->saved_data["recv"].toIntVector(), ctx->saved_data["send"].toIntVector());
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const CommPtr& g,
                            const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    save_route(ctx, g, send, recv);
    return exchange(x, g, send, recv);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {route_back(ctx, grads[0]), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The rows an all-to-all delivered in a forward that RecomputePolicy::kLight kept, given back
// by its recomputation without exchanging them again; the backward is AllToAllRows's.
struct KeptRows : torch::autograd::Function<KeptRows> {
  struct Kept {
    at::Tensor rows;
  };
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const Kept& kept,
                            const CommPtr& g, const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    HP_CHECK(x.dim() >= 1 && kept.rows.dim() == x.dim() && kept.rows.size(0) == sum(recv),
             "ep: the kept rows ", kept.rows.sizes(), " are not what ", sum(recv), " received rows of ", x.sizes(),
             "'s width would be (a recomputed forward that routed otherwise)");
    save_route(ctx, g, send, recv);
    return kept.rows;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {route_back(ctx, grads[0]), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// An exchange whose result needs no gradient (counts, expert ids), kept under
// RecomputePolicy::kLight as all_to_all_rows's rows are.
at::Tensor kept_exchange(const std::function<at::Tensor()>& run) {
  return hp::keep_step([&] { return std::vector<at::Tensor>{run()}; },
                       [](const std::vector<at::Tensor>& kept) { return kept.at(0); });
}

std::vector<int64_t> block_sums(const at::Tensor& counts, int64_t blocks) {
  at::Tensor s = counts.view({blocks, -1}).sum(1).to(c10::kCPU).contiguous();  // sizes the host reads
  return std::vector<int64_t>(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + blocks);
}

void check_dispatch_inputs(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights) {
  HP_CHECK(x.dim() == 2, "ep dispatch: tokens must be [tokens, dim], got shape ", x.sizes());
  HP_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0), "ep dispatch: expert ids must be [tokens=",
           x.size(0), ", k], got shape ", expert_ids.sizes());
  HP_CHECK(weights.sizes() == expert_ids.sizes(), "ep dispatch: weights of shape ", weights.sizes(),
           " do not match the expert ids' ", expert_ids.sizes());
}

// int64 ids in [0, experts), or -1 (a dropped slot); raises naming the offending one.
void check_expert_ids(const at::Tensor& expert_ids, int64_t experts) {
  HP_CHECK(expert_ids.scalar_type() == at::kLong, "ep: expert ids must be int64, got ", expert_ids.scalar_type());
  if (expert_ids.numel() == 0) return;
  const int64_t lo = expert_ids.min().item<int64_t>(), hi = expert_ids.max().item<int64_t>();
  HP_CHECK(lo >= -1 && hi < experts, "ep: expert id ", lo < -1 ? lo : hi, " is outside [0, ", experts,
           ") (and not -1, a dropped slot)");
}

// Bytes of `rows_per_rank` rows of `row_bytes` each to the ranks other than `self`.
int64_t bytes_to_others(const std::vector<int64_t>& rows_per_rank, int64_t row_bytes, int64_t self) {
  int64_t rows = 0;
  for (size_t r = 0; r < rows_per_rank.size(); ++r) rows += static_cast<int64_t>(r) == self ? 0 : rows_per_rank[r];
  return rows * row_bytes;
}

// Bytes of one dim-0 slice of `t` (however many rows it has).
int64_t row_bytes(const at::Tensor& t) {
  int64_t n = static_cast<int64_t>(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// The exchanged per-rank counts: `mine` [n * per] (per entries for each rank) sent, the
// others' for this rank received.
at::Tensor exchange_counts(const at::Tensor& mine, const CommPtr& g) {
  return kept_exchange([&] {
    at::Tensor theirs = at::empty_like(mine);
    g->all_to_all(theirs, mine.contiguous()).wait();
    return theirs;
  });
}

// The context of `d` as this dispatcher's, after checking the expert outputs `y` match it.
template <typename Context>
const Context& combine_context(const at::Tensor& y, const Dispatched& d) {
  const auto* c = dynamic_cast<const Context*>(d.context.get());
  HP_CHECK(c, "ep combine: not the Dispatched of this dispatcher's dispatch");
  HP_CHECK(y.dim() == 2 && y.size(0) == d.rows.size(0), "ep combine: expert outputs must be [", d.rows.size(0),
           ", dim] (one row per dispatched row), got shape ", y.sizes());
  return *c;
}

struct SortingContext : DispatchContext {
  int64_t tokens = 0, k = 0;
  at::Tensor unsort;                          // sorted position of each slot
  at::Tensor to_expert_major, to_rank_major;  // received rows: expert-major order and inverse
  std::vector<int64_t> send_splits, recv_splits;  // rows to / from each EP rank
  at::Tensor weights;                         // [tokens, k], as given to dispatch
  int64_t routed = 0;                         // slots sent (not dropped)
};

// Sorting by expert, one all-to-all each way when there is an EP group (none: EP 1).
class SortingDispatcher : public TokenDispatcher {
 public:
  SortingDispatcher(CommPtr ep, int64_t experts)
      : TokenDispatcher(experts, ep ? ep->size() : 1, ep ? ep->rank() : 0), ep_(std::move(ep)) {}

  Dispatched dispatch(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights) override {
    Sorted s = sort(x, expert_ids, weights);
    SortingContext& c = *s.context;
    Dispatched d;
    d.context = s.context;
    if (!ep_) {
      c.send_splits = c.recv_splits = {s.rows.size(0)};
      d.rows = s.rows;
      d.counts = block_sums(s.counts, experts());
      return d;
    }
    const int64_t n = ep_size(), L = local_experts();
    d.dispatch_bytes = s.dispatch_bytes;
    d.combine_bytes = s.combine_bytes;
    at::Tensor rows = all_to_all_rows(s.rows, ep_, c.send_splits, c.recv_splits);
    c.to_expert_major = expert_major_order(s.recv_counts, L);
    c.to_rank_major = inverse_permutation(c.to_expert_major);
    d.rows = rows.index_select(0, c.to_expert_major);
    d.counts = block_sums(s.recv_counts.view({n, L}).t().contiguous(), L);
    return d;
  }

  at::Tensor combine(const at::Tensor& y, const Dispatched& d) override {
    const SortingContext& c = combine_context<SortingContext>(y, d);
    at::Tensor back = y;
    if (ep_) back = all_to_all_rows(y.index_select(0, c.to_rank_major), ep_, c.recv_splits, c.send_splits);
    return weigh(back, c);
  }

  InFlight dispatch_overlapped(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                               int chunks) override {
    // Checked before the counts are exchanged (the same on every rank).
    HP_CHECK(chunks >= 1 && chunks <= local_experts(), "ep: ", chunks, " overlap chunks for ", local_experts(),
             " local experts (a chunk is a whole number of experts: 1 to ", local_experts(), ")");
    Sorted s = sort(x, expert_ids, weights);
    InFlight f = launch_chunks(s.rows, ep_, s.counts, s.recv_counts, local_experts(), chunks);
    f.dispatch_bytes = s.dispatch_bytes;
    f.combine_bytes = s.combine_bytes;
    f.context = s.context;
    return f;
  }

  at::Tensor combine_overlapped(const at::Tensor& returned, const InFlight& f) override {
    const auto* c = dynamic_cast<const SortingContext*>(f.context.get());
    HP_CHECK(c, "ep combine_overlapped: not the InFlight of this dispatcher's dispatch_overlapped");
    HP_CHECK(returned.dim() == 2 && returned.size(0) == c->routed, "ep combine_overlapped: the returned outputs must be [",
             c->routed, ", dim] (one row per row sent), got shape ", returned.sizes());
    return weigh(returned, *c);
  }

 private:
  // The sort, and the counts exchanged: what dispatch and dispatch_overlapped share.
  struct Sorted {
    std::shared_ptr<SortingContext> context;
    at::Tensor rows;         // the routed rows in expert-major order (the order they leave in)
    at::Tensor counts;       // int64 [experts]: rows of this rank per expert
    at::Tensor recv_counts;  // int64 [ep * local experts]: rows from each rank per local expert
    int64_t dispatch_bytes = 0, combine_bytes = 0;
  };
  Sorted sort(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights) const {
    check_dispatch_inputs(x, expert_ids, weights);
    Sorted out;
    out.context = std::make_shared<SortingContext>();
    SortingContext& c = *out.context;
    c.tokens = x.size(0);
    c.k = expert_ids.size(1);
    c.weights = weights;
    ExpertSort s = sort_by_expert(expert_ids, experts());
    c.unsort = inverse_permutation(s.order);
    // The dropped slots (last in the order) are not sent.
    c.routed = s.counts.sum().item<int64_t>();
    out.rows = x.index_select(0, s.order.narrow(0, 0, c.routed).div(c.k, "floor"));
    out.counts = s.counts;
    out.recv_counts = s.counts;
    if (!ep_) return out;
    const int64_t n = ep_size(), L = local_experts();
    out.recv_counts = exchange_counts(s.counts, ep_);  // L counts with each rank
    c.send_splits = block_sums(s.counts, n);
    c.recv_splits = block_sums(out.recv_counts, n);
    out.dispatch_bytes = bytes_to_others(c.send_splits, row_bytes(out.rows), ep_rank()) + (n - 1) * L * 8;
    out.combine_bytes = bytes_to_others(c.recv_splits, row_bytes(out.rows), ep_rank());
    return out;
  }

  // The tokens' outputs from the rows back at this rank (in the order they left).
  static at::Tensor weigh(at::Tensor back, const SortingContext& c) {
    // The dropped slots' rows: zeros, after the routed ones (where the sort put them).
    const int64_t dropped = c.tokens * c.k - c.routed;
    if (dropped > 0) back = at::cat({back, at::zeros({dropped, back.size(1)}, back.options())});
    at::Tensor slots = back.index_select(0, c.unsort).view({c.tokens, c.k, back.size(1)});
    const at::ScalarType ct = at::promote_types(back.scalar_type(), at::kFloat);
    return (slots.to(ct) * c.weights.to(ct).unsqueeze(-1)).sum(1).to(back.scalar_type());
  }

 private:
  CommPtr ep_;
};

struct DedupContext : DispatchContext {
  int64_t tokens = 0, k = 0, received = 0;
  at::Tensor send_token, send_slot;  // per sent row: its token, and its place among the token's copies
  std::vector<int64_t> send_splits, recv_splits;  // tokens to / from each EP rank
  at::Tensor fanned;                 // received (token, slot) pairs of local experts, expert-major
  at::Tensor slot_weights;           // [received, k]: the weights that came with them (0: not here)
  int64_t copies = 0;                // the most copies of a token: min(k, ranks)
};

// One copy of a token per destination rank; the destination fans it out to its experts and
// sends back one weighted partial sum per token.
class DedupDispatcher : public TokenDispatcher {
 public:
  DedupDispatcher(CommPtr ep, int64_t experts)
      : TokenDispatcher(experts, ep->size(), ep->rank()), ep_(std::move(ep)) {}

  Dispatched dispatch(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights) override {
    check_dispatch_inputs(x, expert_ids, weights);
    check_expert_ids(expert_ids, experts());
    const int64_t n = ep_size(), L = local_experts(), N = x.size(0), k = expert_ids.size(1);
    auto c = std::make_shared<DedupContext>();
    c->tokens = N;
    c->k = k;
    c->copies = std::min(k, n);
    at::Tensor dest = expert_ids.div(L, "floor");                                          // [N, k]; -1: dropped
    // A dropped slot marks an extra column, cut off: it sends to no rank.
    at::Tensor to_rank =
        at::zeros({N, n + 1}, dest.options().dtype(at::kBool)).scatter_(1, dest.masked_fill(dest < 0, n), true).narrow(1, 0, n);
    // Rank-major: rank 0's tokens in token order, then rank 1's, ...
    at::Tensor sends = to_rank.t().nonzero();                                              // [S, 2]: (rank, token)
    at::Tensor send_rank = sends.select(1, 0), send_token = sends.select(1, 1);
    c->send_token = send_token;
    // The place of each copy among its token's copies (rank order), for the sum at the end.
    c->send_slot = (to_rank.cumsum(1) - 1).index({send_token, send_rank});
    at::Tensor per_rank = to_rank.sum(0).to(at::kLong);
    c->send_splits = block_sums(per_rank, n);
    c->recv_splits = block_sums(exchange_counts(per_rank, ep_), n);
    // Beside each copy: its slots' expert ids local to the destination (-1: another rank's)
    // and their weights (0 there).
    at::Tensor here = dest.index_select(0, send_token) == send_rank.unsqueeze(1);       // [S, k]
    at::Tensor local_ids = (expert_ids.index_select(0, send_token) - send_rank.unsqueeze(1) * L).masked_fill(~here, -1);
    at::Tensor w = weights.index_select(0, send_token) * here.to(weights.scalar_type());
    at::Tensor rows = x.index_select(0, send_token);
    Dispatched d;
    d.dispatch_bytes = bytes_to_others(c->send_splits, row_bytes(rows) + row_bytes(local_ids) + row_bytes(w), ep_rank()) +
                       (n - 1) * 8;
    at::Tensor got_rows = all_to_all_rows(rows, ep_, c->send_splits, c->recv_splits);
    at::Tensor got_ids = kept_exchange([&] { return exchange(local_ids, ep_, c->send_splits, c->recv_splits); });
    c->slot_weights = all_to_all_rows(w, ep_, c->send_splits, c->recv_splits);
    c->received = got_rows.size(0);
    d.combine_bytes = bytes_to_others(c->recv_splits, row_bytes(got_rows), ep_rank());
    // Fan out: the received (token, slot) pairs of local experts, sorted by expert (those of
    // other ranks, -1, keyed past the last expert and dropped).
    at::Tensor slots = got_ids.reshape({-1});
    at::Tensor key = slots.masked_fill(slots < 0, L);
    at::Tensor order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
    at::Tensor counts = at::bincount(key, {}, L + 1).to(at::kLong);
    const int64_t valid = slots.numel() - counts[L].item<int64_t>();
    c->fanned = order.narrow(0, 0, valid);
    d.rows = got_rows.index_select(0, c->fanned.div(k, "floor"));
    d.counts = block_sums(counts.narrow(0, 0, L).contiguous(), L);
    d.context = c;
    return d;
  }

  at::Tensor combine(const at::Tensor& y, const Dispatched& d) override {
    const DedupContext& c = combine_context<DedupContext>(y, d);
    const int64_t dim = y.size(1);
    const at::ScalarType ct = at::promote_types(y.scalar_type(), at::kFloat);
    // Weighed here, summed per received token over its slots in order (deterministic).
    at::Tensor w = c.slot_weights.reshape({-1}).index_select(0, c.fanned).to(ct);
    at::Tensor dense = at::zeros({c.received * c.k, dim}, y.options().dtype(ct))
                           .index_copy(0, c.fanned, y.to(ct) * w.unsqueeze(-1));
    at::Tensor partial = dense.view({c.received, c.k, dim}).sum(1).to(y.scalar_type());
    at::Tensor back = all_to_all_rows(partial, ep_, c.recv_splits, c.send_splits).to(ct);
    // Each token's partial sums (one per rank holding some of its experts), in rank order.
    c10::List<c10::optional<at::Tensor>> at_copy;
    at_copy.push_back(c.send_token);
    at_copy.push_back(c.send_slot);
    at::Tensor per_token = at::zeros({c.tokens, c.copies, dim}, back.options()).index_put(at_copy, back);
    return per_token.sum(1).to(y.scalar_type());
  }

 private:
  CommPtr ep_;
};

}  // namespace

InFlight TokenDispatcher::dispatch_overlapped(const at::Tensor&, const at::Tensor&, const at::Tensor&, int chunks) {
  throw Error(detail::str_cat("ep: overlapping this dispatcher's all-to-alls (", chunks,
                              " chunks) is not supported yet; the plain all-to-all dispatcher overlaps them"));
}

at::Tensor TokenDispatcher::combine_overlapped(const at::Tensor&, const InFlight&) {
  throw Error("ep: combine_overlapped is not supported yet by this dispatcher");
}

at::Tensor inverse_permutation(const at::Tensor& p) {
  return at::empty_like(p).scatter_(0, p, at::arange(p.numel(), p.options()));
}

TokenDispatcher::TokenDispatcher(int64_t experts, int64_t ep_size, int64_t ep_rank)
    : experts_(experts), ep_size_(ep_size), ep_rank_(ep_rank) {
  HP_CHECK(experts >= 1, "ep: the expert count must be positive, got ", experts);
  HP_CHECK(ep_size >= 1 && experts % ep_size == 0, "ep: ", experts, " experts cannot be split evenly over ", ep_size,
           " expert-parallel ranks (expert_parallel must divide the expert count)");
}

ExpertSort sort_by_expert(const at::Tensor& expert_ids, int64_t experts) {
  check_expert_ids(expert_ids, experts);
  at::Tensor flat = expert_ids.reshape({-1});
  // A dropped slot sorts as expert `experts`: after all of them.
  at::Tensor key = flat.masked_fill(flat < 0, experts);
  ExpertSort s;
  s.order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  s.counts = at::bincount(key, {}, experts + 1).narrow(0, 0, experts).to(at::kLong).contiguous();
  return s;
}

at::Tensor expert_major_order(const at::Tensor& counts, int64_t local_experts) {
  HP_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong, "ep: counts must be a 1-d int64 tensor");
  HP_CHECK(local_experts >= 1 && counts.numel() % local_experts == 0, "ep: ", counts.numel(),
           " counts are not a whole number of blocks of ", local_experts, " local experts");
  const int64_t ranks = counts.numel() / local_experts;
  at::Tensor starts = counts.cumsum(0) - counts;  // where each (rank, expert) block arrived
  // The blocks in expert-major order, and where each lands there.
  at::Tensor em_counts = counts.view({ranks, local_experts}).t().reshape({-1});
  at::Tensor em_starts = starts.view({ranks, local_experts}).t().reshape({-1});
  at::Tensor em_dest = em_counts.cumsum(0) - em_counts;
  const int64_t total = counts.sum().item<int64_t>();
  return at::repeat_interleave(em_starts - em_dest, em_counts, 0, total) + at::arange(total, counts.options());
}

std::shared_ptr<TokenDispatcher> local_dispatcher(int64_t experts) {
  return std::make_shared<SortingDispatcher>(nullptr, experts);
}

std::shared_ptr<TokenDispatcher> all_to_all_dispatcher(const CommPtr& ep, int64_t experts) {
  HP_CHECK(ep, "ep: all_to_all_dispatcher needs an expert-parallel group");
  return std::make_shared<SortingDispatcher>(ep, experts);
}

std::shared_ptr<TokenDispatcher> dedup_all_to_all_dispatcher(const CommPtr& ep, int64_t experts) {
  HP_CHECK(ep, "ep: dedup_all_to_all_dispatcher needs an expert-parallel group");
  return std::make_shared<DedupDispatcher>(ep, experts);
}

std::shared_ptr<TokenDispatcher> make_dispatcher(DispatcherKind kind, const CommPtr& ep, int64_t experts) {
  if (!ep || ep->size() == 1) return local_dispatcher(experts);
  switch (kind) {
    case DispatcherKind::kAllToAll:
      return all_to_all_dispatcher(ep, experts);
    case DispatcherKind::kDedup:
      return dedup_all_to_all_dispatcher(ep, experts);
  }
  throw Error("ep: unknown dispatcher kind");
}

ExchangeCost dispatch_traffic(DispatcherKind kind, const ExchangeShape& s) {
  HP_CHECK(s.ep >= 1 && s.k >= 1 && s.experts >= 1, "ep::dispatch_traffic: ep=", s.ep, ", k=", s.k, ", experts=",
           s.experts, " must be positive");
  HP_CHECK(s.chunks >= 1 && (s.chunks == 1 || kind == DispatcherKind::kAllToAll), "ep::dispatch_traffic: ", s.chunks,
           " overlap chunks (the de-duplicating dispatcher does not overlap yet)");
  ExchangeCost c;
  if (s.ep == 1) return c;
  const double E = static_cast<double>(s.experts), k = static_cast<double>(s.k);
  auto a2a = [&](double bytes, double count = 1) { return CollectiveCost{CommOp::kAllToAll, bytes, s.ep, count}; };
  switch (kind) {
    case DispatcherKind::kAllToAll: {
      // Each row exchange in s.chunks all-to-alls of 1/chunks of the rows each.
      const double chunks = s.chunks, rows = s.tokens * k * s.row_bytes / chunks;
      c.forward = {a2a(8.0 * E), a2a(rows, 2 * chunks)};
      c.backward = {a2a(rows, 2 * chunks)};
      break;
    }
    case DispatcherKind::kDedup: {
      const double rows = s.copies * s.row_bytes;
      c.forward = {a2a(8.0 * s.ep), a2a(rows), a2a(s.copies * k * 8.0), a2a(s.copies * k * s.weight_bytes), a2a(rows)};
      c.backward = {a2a(rows, 2), a2a(s.copies * k * s.weight_bytes)};
      break;
    }
  }
  return c;
}

double light_kept_bytes(DispatcherKind kind, const ExchangeShape& s) {
  if (s.ep == 1 || s.chunks > 1) return 0;
  const double k = static_cast<double>(s.k);
  switch (kind) {
    case DispatcherKind::kAllToAll:
      return 2.0 * s.tokens * k * s.row_bytes + 8.0 * static_cast<double>(s.experts);
    case DispatcherKind::kDedup:
      return 2.0 * s.copies * s.row_bytes + s.copies * k * (8.0 + s.weight_bytes) + 8.0 * s.ep;
  }
  throw Error("ep::light_kept_bytes: unknown dispatcher kind");
}

Exposure overlap_exposure(const OverlapTimes& t) {
  HP_CHECK(t.chunks >= 1, "ep::overlap_exposure: ", t.chunks, " chunks");
  const int C = t.chunks;
  Exposure e;
  if (C == 1) {
    e.forward = t.rows + t.outputs;
    e.backward = t.outputs + t.rows;
    return e;
  }
  const double ef = t.experts_forward / C, eb = t.experts_backward / C;
  // Forward: chunk g's rows in at (g + 1) x rows.
  double comm = C * t.rows, compute = t.shared_forward;
  for (int g = 0; g < C; ++g) {
    compute = std::max(compute, (g + 1) * t.rows) + ef;
    comm = std::max(comm, compute) + t.outputs;
  }
  e.forward = std::max(comm, compute) - (t.shared_forward + t.experts_forward);
  // Backward: the i-th chunk run (the last chunk first) has its output gradient at (i + 1) x outputs.
  comm = C * t.outputs;
  compute = 0;
  for (int i = 0; i < C; ++i) {
    compute = std::max(compute, (i + 1) * t.outputs) + eb;
    comm = std::max(comm, compute) + t.rows;
  }
  compute += t.shared_backward;
  e.backward = std::max(comm, compute) - (t.shared_backward + t.experts_backward);
  return e;
}

double expected_copies(double tokens, int64_t experts, int ep, int64_t k) {
  const double E = static_cast<double>(experts);
  double miss = 1;  // a rank holds none of the token's k experts
  for (int i = 0; i < static_cast<int>(k); ++i) miss *= std::max(0.0, E - E / ep - i) / (E - i);
  return tokens * ep * (1.0 - miss);
}

at::Tensor all_to_all_rows(const at::Tensor& x, const CommPtr& group, const std::vector<int64_t>& send_splits,
                           const std::vector<int64_t>& recv_splits) {
  HP_CHECK(group, "ep: all_to_all_rows needs a group");
  HP_CHECK(x.dim() >= 1 && sum(send_splits) == x.size(0), "ep: send splits summing to ", sum(send_splits),
           " rows for a tensor of ", x.dim() >= 1 ? x.size(0) : 0, " rows");
  return hp::keep_step(
      [&] { return std::vector<at::Tensor>{AllToAllRows::apply(x, group, send_splits, recv_splits)}; },
      [&](const std::vector<at::Tensor>& kept) {
        return KeptRows::apply(x, KeptRows::Kept{kept.at(0)}, group, send_splits, recv_splits);
      });
}

}  // namespace hp::ep
