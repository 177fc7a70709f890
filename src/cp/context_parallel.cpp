#include "hp/cp/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <tuple>
#include <utility>

#include "../comm/group_capsule.h"
#include "hp/core/error.h"

namespace hp::cp {

const char* split_name(Split s) {
  switch (s) {
    case Split::kHeadTail:
      return "head_tail";
    case Split::kContiguous:
      return "contiguous";
  }
  return "?";
}

const char* method_name(Method m) {
  switch (m) {
    case Method::kAllGather:
      return "allgather";
    case Method::kRing:
      return "ring";
    case Method::kUlysses:
      return "ulysses";
  }
  return "?";
}

SequenceSplit::SequenceSplit(int64_t seq, int cp, Split split) : seq_(seq), cp_(cp), split_(split) {
  HP_CHECK(cp >= 1, "context parallel: cp must be at least 1, got ", cp);
  const bool head_tail = split == Split::kHeadTail;
  const int64_t chunks = head_tail ? 2 * int64_t{cp} : int64_t{cp};
  HP_CHECK(seq >= chunks, "context parallel: a sequence of ", seq, " tokens is shorter than the ", chunks,
           " chunks of the ", split_name(split), " split at cp=", cp, head_tail ? " (2·cp)" : "");
  HP_CHECK(seq % chunks == 0, "context parallel: a sequence of ", seq, " tokens is not divisible by the ", chunks,
           " chunks of the ", split_name(split), " split at cp=", cp, head_tail ? " (2·cp)" : "",
           ": choose seq_length a multiple of ", chunks);
}

std::vector<Run> SequenceSplit::runs(int rank) const {
  HP_CHECK(rank >= 0 && rank < cp_, "context parallel: rank ", rank, " outside [0, ", cp_, ")");
  if (split_ == Split::kContiguous) return {Run{rank * local(), local(), 0}};
  const int64_t c = seq_ / (2 * cp_);
  return {Run{rank * c, c, 0}, Run{(2 * cp_ - 1 - rank) * c, c, c}};
}

at::Tensor SequenceSplit::positions(int rank) const {
  std::vector<at::Tensor> parts;
  for (const Run& r : runs(rank)) parts.push_back(at::arange(r.start, r.start + r.length, at::kLong));
  return at::cat(parts);
}

at::Tensor SequenceSplit::order() const {
  std::vector<at::Tensor> parts;
  for (int r = 0; r < cp_; ++r) parts.push_back(positions(r));
  return at::cat(parts);
}

at::Tensor shard(const at::Tensor& x, int64_t dim, const SequenceSplit& split, int rank) {
  HP_CHECK(dim >= -x.dim() && dim < x.dim(), "context parallel shard: dim ", dim, " of a tensor of ", x.dim(), " dims");
  HP_CHECK(x.size(dim) == split.seq(), "context parallel shard: size ", x.size(dim), " along dim ", dim,
           " is not the split's sequence of ", split.seq());
  return x.index_select(dim, split.positions(rank).to(x.device()));
}

at::Tensor restore(const at::Tensor& gathered, int64_t dim, const SequenceSplit& split) {
  HP_CHECK(dim >= -gathered.dim() && dim < gathered.dim(), "context parallel restore: dim ", dim, " of a tensor of ",
           gathered.dim(), " dims");
  HP_CHECK(gathered.size(dim) == split.seq(), "context parallel restore: size ", gathered.size(dim), " along dim ",
           dim, " is not the split's sequence of ", split.seq());
  const at::Tensor order = split.order();
  const at::Tensor inverse = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
  return gathered.index_select(dim, inverse.to(gathered.device()));
}

namespace {

enum class Exchange { kAllGather, kRing };

// What the autograd function needs besides the tensors: the query tiles, the key tiles of
// each source (one per CP rank), and the communicator.
struct Plan : torch::CustomClassHolder {
  Exchange exchange = Exchange::kRing;
  CommPtr comm;
  int cp = 1, rank = 0;
  std::vector<Run> q_tiles;
  std::vector<std::vector<Run>> k_tiles;  // [source]
  Mask mask = Mask::kCausal;
  double scale = 1.0;
  std::shared_ptr<AttentionStats> stats;
};

// One 1-D buffer holding a and b (flattened), and the way back.
at::Tensor pack(const at::Tensor& a, const at::Tensor& b) { return at::cat({a.reshape(-1), b.reshape(-1)}); }
std::pair<at::Tensor, at::Tensor> unpack(const at::Tensor& buf, at::IntArrayRef a_shape, at::IntArrayRef b_shape) {
  const int64_t na = c10::multiply_integers(a_shape), nb = c10::multiply_integers(b_shape);
  return {buf.narrow(0, 0, na).view(a_shape), buf.narrow(0, na, nb).view(b_shape)};
}

// One step of the ring: sends `mine` to the next rank and receives the previous rank's.
Work ring_exchange(const Plan& p, const at::Tensor& mine, const at::Tensor& incoming, int tag) {
  p.stats->bytes_sent += mine.numel() * static_cast<int64_t>(mine.element_size());
  std::vector<P2POp> ops(2);
  ops[0] = P2POp{P2POp::kSend, mine, (p.rank + 1) % p.cp, tag};
  ops[1] = P2POp{P2POp::kRecv, incoming, (p.rank + p.cp - 1) % p.cp, tag};
  return p.comm->batch_send_recv(std::move(ops));
}

constexpr int kKeysTag = 1, kGradTag = 2;

struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const c10::intrusive_ptr<Plan>& plan) {
    const Plan& p = *plan;
    attn::ForwardState f = attn::begin_forward(q, v);
    const at::ScalarType ct = f.qc.scalar_type();
    const at::Tensor mine = pack(k, v);
    // The attention of q over the keys of source j, merged into (o, lse).
    auto attend = [&](const at::Tensor& keys_values, int j) {
      auto [kj, vj] = unpack(keys_values, k.sizes(), v.sizes());
      attn::forward_source(f.qc, kj.to(ct), vj.to(ct), p.q_tiles, p.k_tiles[j], p.mask, p.scale, f.o, f.lse,
                           p.stats.get());
    };
    if (p.exchange == Exchange::kAllGather) {
      at::Tensor all = at::empty({p.cp * mine.numel()}, mine.options());
      p.stats->bytes_sent += mine.numel() * static_cast<int64_t>(mine.element_size()) * (p.cp - 1);
      p.comm->all_gather(all, mine).wait();
      for (int j = 0; j < p.cp; ++j) attend(all.narrow(0, j * mine.numel(), mine.numel()), j);
    } else {
      at::Tensor cur = mine;
      for (int s = 0; s < p.cp; ++s) {
        const int j = (p.rank - s + p.cp) % p.cp;  // whose keys are in hand
        at::Tensor next;
        Work w;
        if (s + 1 < p.cp) {  // start the next block's transfer, then compute on this one
          next = at::empty_like(cur);
          w = ring_exchange(p, cur, next, kKeysTag);
        }
        attend(cur, j);
        if (s + 1 < p.cp) {
          w.wait();
          cur = next;
        }
      }
    }
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return attn::end_forward(ctx, q, k, v, f);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Plan& p = *static_cast<Plan*>(ctx->saved_data["plan"].toCapsule().get());
    attn::BackwardState b = attn::begin_backward(ctx, grads[0]);
    const at::Tensor &q = b.q, &k = b.k, &v = b.v;
    const at::ScalarType ct = b.qc.scalar_type();
    at::Tensor dk, dv;
    // Source j's (dk, dv), packed in the compute dtype.
    auto grad_of = [&](const at::Tensor& keys_values, int j) {
      auto [kj, vj] = unpack(keys_values, k.sizes(), v.sizes());
      auto [dkj, dvj] = attn::backward_source(b.qc, kj.to(ct), vj.to(ct), p.q_tiles, p.k_tiles[j], p.mask, p.scale,
                                              b.dout, b.lse, b.delta, b.dq);
      return pack(dkj, dvj);
    };
    if (p.exchange == Exchange::kAllGather) {
      // Gathered again rather than kept from the forward: keeping them would hold the
      // whole sequence's keys and values per layer, which CP exists to avoid.
      const at::Tensor mine = pack(k, v);
      at::Tensor all = at::empty({p.cp * mine.numel()}, mine.options());
      p.stats->bytes_sent += mine.numel() * static_cast<int64_t>(mine.element_size()) * (p.cp - 1);
      p.comm->all_gather(all, mine).wait();
      std::vector<at::Tensor> grads_of_sources;
      for (int j = 0; j < p.cp; ++j) grads_of_sources.push_back(grad_of(all.narrow(0, j * mine.numel(), mine.numel()), j));
      const at::Tensor all_grads = at::cat(grads_of_sources);
      at::Tensor own = at::empty({all_grads.numel() / p.cp}, all_grads.options());
      p.stats->bytes_sent += own.numel() * static_cast<int64_t>(own.element_size()) * (p.cp - 1);
      p.comm->reduce_scatter(own, all_grads).wait();
      std::tie(dk, dv) = unpack(own, k.sizes(), v.sizes());
    } else {
      // Keys and values go round again; each block's gradient accumulator travels one
      // step behind them and, after cp steps, arrives at the rank that owns the block.
      at::Tensor cur = pack(k, v);
      at::Tensor incoming;  // the accumulator of the block in hand, from the previous rank
      Work grad_work;
      for (int s = 0; s < p.cp; ++s) {
        const int j = (p.rank - s + p.cp) % p.cp;
        at::Tensor next;
        Work keys_work;
        if (s + 1 < p.cp) {
          next = at::empty_like(cur);
          keys_work = ring_exchange(p, cur, next, kKeysTag);
        }
        at::Tensor acc = grad_of(cur, j);
        if (s > 0) {
          grad_work.wait();
          acc.add_(incoming);
        }
        incoming = at::empty_like(acc);
        grad_work = ring_exchange(p, acc, incoming, kGradTag);
        if (s + 1 < p.cp) {
          keys_work.wait();
          cur = next;
        }
      }
      grad_work.wait();
      std::tie(dk, dv) = unpack(incoming, k.sizes(), v.sizes());
    }
    return {b.dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor()};
  }
};

// All-to-all of equal blocks along dim 0; its own inverse, so its backward is itself.
struct AllToAllBlocks : torch::autograd::Function<AllToAllBlocks> {
  static at::Tensor run(const at::Tensor& x, const CommPtr& g, AttentionStats& st) {
    at::Tensor in = x.contiguous();
    at::Tensor out = at::empty_like(in);
    st.bytes_sent += in.numel() / g->size() * (g->size() - 1) * static_cast<int64_t>(in.element_size());
    g->all_to_all(out, in).wait();
    return out;
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const CommPtr& g,
                            const std::shared_ptr<AttentionStats>& st) {
    ctx->saved_data["group"] = detail::group_capsule(g);
    ctx->saved_data["stats"] = c10::IValue::make_capsule(c10::make_intrusive<StatsCapsule>(st));
    return run(x, g, *st);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const CommPtr g = detail::group_of_capsule(ctx->saved_data["group"]);
    auto* st = static_cast<StatsCapsule*>(ctx->saved_data["stats"].toCapsule().get());
    return {run(grads[0], g, *st->stats), at::Tensor(), at::Tensor()};
  }
  struct StatsCapsule : torch::CustomClassHolder {
    explicit StatsCapsule(std::shared_ptr<AttentionStats> s) : stats(std::move(s)) {}
    std::shared_ptr<AttentionStats> stats;
  };
};

// [B, h, T, d] with T this rank's tokens -> [B, h / cp, cp·T, d]: a head group over the
// ranks' tokens in rank order.
at::Tensor sequence_to_heads(const at::Tensor& x, const CommPtr& g, const std::shared_ptr<AttentionStats>& st) {
  const int64_t cp = g->size(), B = x.size(0), h = x.size(1), T = x.size(2), d = x.size(3);
  at::Tensor blocks = x.view({B, cp, h / cp, T, d}).permute({1, 0, 2, 3, 4});
  at::Tensor got = AllToAllBlocks::apply(blocks, g, st);  // [source rank, B, h / cp, T, d]
  return got.permute({1, 2, 0, 3, 4}).reshape({B, h / cp, cp * T, d});
}

// The inverse: [B, h', cp·T, d] -> [B, cp·h', T, d].
at::Tensor heads_to_sequence(const at::Tensor& y, const CommPtr& g, const std::shared_ptr<AttentionStats>& st) {
  const int64_t cp = g->size(), B = y.size(0), h = y.size(1), T = y.size(2) / cp, d = y.size(3);
  at::Tensor blocks = y.view({B, h, cp, T, d}).permute({2, 0, 1, 3, 4});
  at::Tensor got = AllToAllBlocks::apply(blocks, g, st);  // [source rank (head group), B, h, T, d]
  return got.permute({1, 0, 2, 3, 4}).reshape({B, cp * h, T, d});
}

}  // namespace

ContextParallel::ContextParallel(CommPtr group, ContextParallelOptions o)
    : group_(std::move(group)), options_(o), stats_(std::make_shared<AttentionStats>()) {
  HP_CHECK(group_ != nullptr, "context parallel: the group is null");
  if (options_.method == Method::kRing && group_->size() > 1) {
    CommOptions co;
    co.name = group_->name() + ".cp_ring";
    ring_ = group_->split(0, group_->rank(), co);
  }
}

int ContextParallel::size() const { return group_->size(); }
int ContextParallel::rank() const { return group_->rank(); }

at::Tensor ContextParallel::attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Mask mask,
                                      double scale, int64_t tile) {
  attn::check_shapes(q, k, v, "context parallel attention");
  const int cp = size();
  HP_CHECK(!(options_.split == Split::kHeadTail && mask == Mask::kNone),
           "context parallel: the head_tail split balances a causal mask; with no mask use the contiguous split");
  const SequenceSplit split = split_of(q.size(2) * cp);
  const double s = attn::scale_or_default(scale, q);
  if (options_.method == Method::kUlysses) {
    HP_CHECK(q.size(1) % cp == 0 && k.size(1) % cp == 0, "context parallel: ulysses needs the ", q.size(1),
             " query heads and ", k.size(1), " key/value heads (per rank, after tensor parallelism) divisible by cp=", cp,
             ": use the ring or allgather method");
    std::vector<Run> all;
    for (int r = 0; r < cp; ++r) {
      for (Run run : split.runs(r)) {
        run.offset += r * split.local();
        all.push_back(run);
      }
    }
    const at::Tensor o = attn::attention(sequence_to_heads(q, group_, stats_), sequence_to_heads(k, group_, stats_),
                                         sequence_to_heads(v, group_, stats_), all, all, mask, s, tile, stats_.get());
    return heads_to_sequence(o, group_, stats_);
  }
  const std::vector<Run> mine = split.runs(rank());
  if (cp == 1) return attn::attention(q, k, v, mine, mine, mask, s, tile, stats_.get());
  auto plan = c10::make_intrusive<Plan>();
  plan->exchange = options_.method == Method::kRing ? Exchange::kRing : Exchange::kAllGather;
  plan->comm = options_.method == Method::kRing ? ring_ : group_;
  plan->cp = cp;
  plan->rank = rank();
  plan->q_tiles = attn::tile_runs(mine, tile);
  for (int r = 0; r < cp; ++r) plan->k_tiles.push_back(attn::tile_runs(split.runs(r), tile));
  plan->mask = mask;
  plan->scale = s;
  plan->stats = stats_;
  return AttentionFunction::apply(q, k, v, plan);
}

AttentionCost attention_traffic(Method m, const AttentionShape& s) {
  HP_CHECK(s.cp >= 1, "cp::attention_traffic: cp=", s.cp, " must be positive");
  AttentionCost c;
  if (s.cp == 1) return c;
  const double kv = s.tokens * s.kv_width * s.elem_bytes, kv_grad = s.tokens * s.kv_width * s.grad_bytes;
  switch (m) {
    case Method::kRing:
      c.forward = {{CommOp::kSend, kv, 2, s.cp - 1.0}};
      c.backward = {{CommOp::kSend, kv, 2, s.cp - 1.0}, {CommOp::kSend, kv_grad, 2, static_cast<double>(s.cp)}};
      break;
    case Method::kAllGather:
      c.forward = {{CommOp::kAllGather, kv * s.cp, s.cp, 1}};
      c.backward = {{CommOp::kAllGather, kv * s.cp, s.cp, 1}, {CommOp::kReduceScatter, kv_grad * s.cp, s.cp, 1}};
      break;
    case Method::kUlysses: {
      const double all = s.tokens * (s.kv_width + s.q_out_width) * s.elem_bytes;
      c.forward = {{CommOp::kAllToAll, all / 4, s.cp, 4}};
      c.backward = c.forward;
      break;
    }
  }
  return c;
}

}  // namespace hp::cp
