#include "hp/ep/dispatch.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <numeric>
#include <utility>

#include "../comm/group_capsule.h"
#include "hp/core/error.h"

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
  g->all_to_all(out, in, o).wait();
  return out;
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const CommPtr& g,
                            const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    ctx->saved_data["group"] = detail::group_capsule(g);
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return exchange(x, g, send, recv);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const CommPtr g = detail::group_of_capsule(ctx->saved_data["group"]);
    // The gradient goes back the way the rows came: what was received is sent.
    at::Tensor gx = exchange(grads[0], g, ctx->saved_data["recv"].toIntVector(), ctx->saved_data["send"].toIntVector());
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// p[inverse(p)[i]] = i for a permutation p of [0, n).
at::Tensor inverse_permutation(const at::Tensor& p) {
  return at::empty_like(p).scatter_(0, p, at::arange(p.numel(), p.options()));
}

std::vector<int64_t> block_sums(const at::Tensor& counts, int64_t blocks) {
  at::Tensor s = counts.view({blocks, -1}).sum(1).contiguous();
  return std::vector<int64_t>(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + blocks);
}

// Sorting by expert, one all-to-all each way when there is an EP group (none: EP 1).
class SortingDispatcher : public TokenDispatcher {
 public:
  SortingDispatcher(CommPtr ep, int64_t experts)
      : TokenDispatcher(experts, ep ? ep->size() : 1, ep ? ep->rank() : 0), ep_(std::move(ep)) {}

  Dispatched dispatch(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights) override {
    HP_CHECK(x.dim() == 2, "ep dispatch: tokens must be [tokens, dim], got shape ", x.sizes());
    HP_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0), "ep dispatch: expert ids must be [tokens=",
             x.size(0), ", k], got shape ", expert_ids.sizes());
    HP_CHECK(weights.sizes() == expert_ids.sizes(), "ep dispatch: weights of shape ", weights.sizes(),
             " do not match the expert ids' ", expert_ids.sizes());
    auto c = std::make_shared<DispatchContext>();
    c->tokens = x.size(0);
    c->k = expert_ids.size(1);
    c->weights = weights;
    ExpertSort s = sort_by_expert(expert_ids, experts());
    c->order = s.order;
    c->unsort = inverse_permutation(s.order);
    at::Tensor rows = x.index_select(0, s.order.div(c->k, "floor"));
    Dispatched d;
    d.context = c;
    if (!ep_) {
      c->send_splits = c->recv_splits = {rows.size(0)};
      d.rows = rows;
      d.counts = block_sums(s.counts, experts());
      return d;
    }
    const int64_t n = ep_size(), L = local_experts();
    at::Tensor recv_counts = at::empty_like(s.counts);
    ep_->all_to_all(recv_counts, s.counts.contiguous()).wait();  // L counts with each rank
    c->send_splits = block_sums(s.counts, n);
    c->recv_splits = block_sums(recv_counts, n);
    rows = all_to_all_rows(rows, ep_, c->send_splits, c->recv_splits);
    c->to_expert_major = expert_major_order(recv_counts, L);
    c->to_rank_major = inverse_permutation(c->to_expert_major);
    d.rows = rows.index_select(0, c->to_expert_major);
    d.counts = block_sums(recv_counts.view({n, L}).t().contiguous(), L);
    return d;
  }

  at::Tensor combine(const at::Tensor& y, const Dispatched& d) override {
    HP_CHECK(d.context, "ep combine: no dispatch context (combine needs the Dispatched that dispatch returned)");
    const DispatchContext& c = *d.context;
    HP_CHECK(y.dim() == 2 && y.size(0) == d.rows.size(0), "ep combine: expert outputs must be [", d.rows.size(0),
             ", dim] (one row per dispatched row), got shape ", y.sizes());
    at::Tensor back = y;
    if (ep_) back = all_to_all_rows(y.index_select(0, c.to_rank_major), ep_, c.recv_splits, c.send_splits);
    at::Tensor slots = back.index_select(0, c.unsort).view({c.tokens, c.k, y.size(1)});
    const at::ScalarType ct = at::promote_types(y.scalar_type(), at::kFloat);
    return (slots.to(ct) * c.weights.to(ct).unsqueeze(-1)).sum(1).to(y.scalar_type());
  }

 private:
  CommPtr ep_;
};

}  // namespace

TokenDispatcher::TokenDispatcher(int64_t experts, int64_t ep_size, int64_t ep_rank)
    : experts_(experts), ep_size_(ep_size), ep_rank_(ep_rank) {
  HP_CHECK(experts >= 1, "ep: the expert count must be positive, got ", experts);
  HP_CHECK(ep_size >= 1 && experts % ep_size == 0, "ep: ", experts, " experts cannot be split evenly over ", ep_size,
           " expert-parallel ranks (expert_parallel must divide the expert count)");
}

ExpertSort sort_by_expert(const at::Tensor& expert_ids, int64_t experts) {
  HP_CHECK(expert_ids.scalar_type() == at::kLong, "ep: expert ids must be int64, got ", expert_ids.scalar_type());
  at::Tensor flat = expert_ids.reshape({-1});
  if (flat.numel() > 0) {
    const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
    HP_CHECK(lo >= 0 && hi < experts, "ep: expert id ", lo < 0 ? lo : hi, " is outside [0, ", experts, ")");
  }
  ExpertSort s;
  s.order = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  s.counts = at::bincount(flat, {}, experts).to(at::kLong);
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

at::Tensor all_to_all_rows(const at::Tensor& x, const CommPtr& group, const std::vector<int64_t>& send_splits,
                           const std::vector<int64_t>& recv_splits) {
  HP_CHECK(group, "ep: all_to_all_rows needs a group");
  HP_CHECK(x.dim() >= 1 && sum(send_splits) == x.size(0), "ep: send splits summing to ", sum(send_splits),
           " rows for a tensor of ", x.dim() >= 1 ? x.size(0) : 0, " rows");
  return AllToAllRows::apply(x, group, send_splits, recv_splits);
}

}  // namespace hp::ep
