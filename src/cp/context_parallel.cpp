#include "hp/cp/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <cmath>
#include <limits>
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

constexpr double kInf = std::numeric_limits<double>::infinity();

// How a (query run, key run) pair is computed.
enum class Block { kSkip, kFull, kMasked };

Block classify(const Run& q, const Run& k, Mask mask) {
  if (mask == Mask::kNone) return Block::kFull;
  if (k.start > q.start + q.length - 1) return Block::kSkip;  // every key after every query
  if (k.start + k.length - 1 <= q.start) return Block::kFull;  // every key at or before every query
  return Block::kMasked;
}

// [tq, tk], true where the key comes after the query (hidden by the causal mask).
at::Tensor causal_mask(const Run& q, const Run& k, const c10::Device& device) {
  const auto o = at::TensorOptions(at::kLong).device(device);
  return at::arange(k.start, k.start + k.length, o).unsqueeze(0) > at::arange(q.start, q.start + q.length, o).unsqueeze(1);
}

// Key/value heads repeated for the query heads sharing them, and the gradient summed back.
at::Tensor expand_heads(const at::Tensor& t, int64_t group) { return group == 1 ? t : t.repeat_interleave(group, 1); }
at::Tensor fold_heads(const at::Tensor& g, int64_t group) {
  if (group == 1) return g;
  return g.view({g.size(0), g.size(1) / group, group, g.size(2), g.size(3)}).sum(2);
}

at::Tensor where_zero(const at::Tensor& cond, const at::Tensor& x, double value) {
  return at::where(cond, at::full({}, value, x.options()), x);
}

enum class Exchange { kNone, kAllGather, kRing };

// What the autograd function needs besides the tensors: the key runs of each source (one
// per CP rank, or one for a local computation), the query runs, and the communicator.
struct Plan : torch::CustomClassHolder {
  Exchange exchange = Exchange::kNone;
  CommPtr comm;
  int cp = 1, rank = 0;
  std::vector<Run> q_runs;
  std::vector<std::vector<Run>> k_runs;  // [source]
  Mask mask = Mask::kCausal;
  double scale = 1.0;
  std::shared_ptr<AttentionStats> stats;
};

// K and V of one source in the compute dtype, heads expanded to the query heads.
struct KeysValues {
  at::Tensor k, v;
};

// One 1-D buffer holding a and b (flattened), and the way back.
at::Tensor pack(const at::Tensor& a, const at::Tensor& b) { return at::cat({a.reshape(-1), b.reshape(-1)}); }
std::pair<at::Tensor, at::Tensor> unpack(const at::Tensor& buf, at::IntArrayRef a_shape, at::IntArrayRef b_shape) {
  const int64_t na = c10::multiply_integers(a_shape), nb = c10::multiply_integers(b_shape);
  return {buf.narrow(0, 0, na).view(a_shape), buf.narrow(0, na, nb).view(b_shape)};
}

at::Tensor slice(const at::Tensor& t, const Run& r) { return t.narrow(2, r.offset, r.length); }

// Forward over one source's keys: merges each computed block into (o, lse) through the
// log-sum-exp. o [B, H, Tq, dv], lse [B, H, Tq, 1], in the compute dtype.
void forward_source(const Plan& p, const at::Tensor& q, const KeysValues& kv, const std::vector<Run>& k_runs,
                    at::Tensor& o, at::Tensor& lse) {
  for (const Run& qr : p.q_runs) {
    for (const Run& kr : k_runs) {
      const Block b = classify(qr, kr, p.mask);
      if (b == Block::kSkip) continue;
      at::Tensor s = at::matmul(slice(q, qr), slice(kv.k, kr).transpose(-2, -1)) * p.scale;
      if (b == Block::kMasked) s.masked_fill_(causal_mask(qr, kr, s.device()), -kInf);
      const at::Tensor m = std::get<0>(s.max(-1, true));
      const at::Tensor m_safe = where_zero(at::isinf(m), m, 0.0);  // a row with every key hidden
      const at::Tensor e = at::exp(s - m_safe);
      const at::Tensor l = e.sum(-1, true);
      const at::Tensor o_b = at::matmul(e, slice(kv.v, kr)) / where_zero(l == 0, l, 1.0);
      const at::Tensor lse_b = m_safe + at::log(l);
      // Merge: lse = log(exp(lse_a) + exp(lse_b)), o = the weighted mean of o_a and o_b.
      at::Tensor o_a = slice(o, qr), lse_a = slice(lse, qr);
      const at::Tensor mx = at::maximum(lse_a, lse_b);
      const at::Tensor mx_safe = where_zero(at::isinf(mx), mx, 0.0);
      const at::Tensor wa = at::exp(lse_a - mx_safe), wb = at::exp(lse_b - mx_safe);
      const at::Tensor sum = wa + wb;
      o_a.copy_((o_a * wa + o_b * wb) / where_zero(sum == 0, sum, 1.0));
      lse_a.copy_(mx_safe + at::log(sum));
      auto& st = *p.stats;
      st.blocks += 1;
      st.masked_blocks += b == Block::kMasked ? 1 : 0;
      st.score_elements += qr.length * kr.length;
    }
  }
}

// Backward over one source's keys: adds to dq, returns the source's (dk, dv) with the heads
// expanded. `delta` = rowsum(dO · O) [B, H, Tq, 1].
std::pair<at::Tensor, at::Tensor> backward_source(const Plan& p, const at::Tensor& q, const KeysValues& kv,
                                                  const std::vector<Run>& k_runs, const at::Tensor& dout,
                                                  const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq) {
  at::Tensor dk = at::zeros_like(kv.k), dv = at::zeros_like(kv.v);
  for (const Run& qr : p.q_runs) {
    for (const Run& kr : k_runs) {
      const Block b = classify(qr, kr, p.mask);
      if (b == Block::kSkip) continue;
      const at::Tensor qs = slice(q, qr), ks = slice(kv.k, kr), vs = slice(kv.v, kr), dos = slice(dout, qr);
      at::Tensor s = at::matmul(qs, ks.transpose(-2, -1)) * p.scale;
      if (b == Block::kMasked) s.masked_fill_(causal_mask(qr, kr, s.device()), -kInf);
      const at::Tensor l = slice(lse, qr);
      const at::Tensor prob = at::exp(s - where_zero(at::isinf(l), l, 0.0));
      slice(dv, kr).add_(at::matmul(prob.transpose(-2, -1), dos));
      const at::Tensor ds = prob * (at::matmul(dos, vs.transpose(-2, -1)) - slice(delta, qr)) * p.scale;
      slice(dq, qr).add_(at::matmul(ds, ks));
      slice(dk, kr).add_(at::matmul(ds.transpose(-2, -1), qs));
    }
  }
  return {dk, dv};
}

at::ScalarType compute_dtype(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

KeysValues keys_values(const at::Tensor& k, const at::Tensor& v, int64_t group, at::ScalarType ct) {
  return {expand_heads(k.to(ct), group), expand_heads(v.to(ct), group)};
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
    const at::ScalarType ct = compute_dtype(q);
    const int64_t group = q.size(1) / k.size(1);
    const at::Tensor qc = q.to(ct);
    at::Tensor o = at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, qc.options());
    at::Tensor lse = at::full({q.size(0), q.size(1), q.size(2), 1}, -kInf, qc.options());
    const at::Tensor mine = p.exchange == Exchange::kNone ? at::Tensor() : pack(k, v);
    switch (p.exchange) {
      case Exchange::kNone:
        forward_source(p, qc, keys_values(k, v, group, ct), p.k_runs[0], o, lse);
        break;
      case Exchange::kAllGather: {
        at::Tensor all = at::empty({p.cp * mine.numel()}, mine.options());
        p.stats->bytes_sent += mine.numel() * static_cast<int64_t>(mine.element_size()) * (p.cp - 1);
        p.comm->all_gather(all, mine).wait();
        for (int j = 0; j < p.cp; ++j) {
          auto [kj, vj] = unpack(all.narrow(0, j * mine.numel(), mine.numel()), k.sizes(), v.sizes());
          forward_source(p, qc, keys_values(kj, vj, group, ct), p.k_runs[j], o, lse);
        }
        break;
      }
      case Exchange::kRing: {
        at::Tensor cur = mine;
        for (int s = 0; s < p.cp; ++s) {
          const int j = (p.rank - s + p.cp) % p.cp;  // whose keys are in hand
          at::Tensor next;
          Work w;
          if (s + 1 < p.cp) {  // start the next block's transfer, then compute on this one
            next = at::empty_like(cur);
            w = ring_exchange(p, cur, next, kKeysTag);
          }
          auto [kj, vj] = unpack(cur, k.sizes(), v.sizes());
          forward_source(p, qc, keys_values(kj, vj, group, ct), p.k_runs[j], o, lse);
          if (s + 1 < p.cp) {
            w.wait();
            cur = next;
          }
        }
        break;
      }
    }
    at::Tensor out = o.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const Plan& p = *static_cast<Plan*>(ctx->saved_data["plan"].toCapsule().get());
    const at::ScalarType ct = compute_dtype(q);
    const int64_t group = q.size(1) / k.size(1);
    const at::Tensor qc = q.to(ct);
    const at::Tensor dout = grads[0].to(ct);
    const at::Tensor delta = (dout * out.to(ct)).sum(-1, true);
    at::Tensor dq = at::zeros_like(qc);
    at::Tensor dk, dv;
    // A source's (dk, dv) with the key/value heads folded back, packed in the compute dtype.
    auto grad_of = [&](const at::Tensor& kj, const at::Tensor& vj, int j) {
      auto [dke, dve] = backward_source(p, qc, keys_values(kj, vj, group, ct), p.k_runs[j], dout, lse, delta, dq);
      return pack(fold_heads(dke, group), fold_heads(dve, group));
    };
    switch (p.exchange) {
      case Exchange::kNone: {
        std::tie(dk, dv) = unpack(grad_of(k, v, 0), k.sizes(), v.sizes());
        break;
      }
      case Exchange::kAllGather: {
        // Gathered again rather than kept from the forward: keeping them would hold the
        // whole sequence's keys and values per layer, which CP exists to avoid.
        const at::Tensor mine = pack(k, v);
        at::Tensor all = at::empty({p.cp * mine.numel()}, mine.options());
        p.stats->bytes_sent += mine.numel() * static_cast<int64_t>(mine.element_size()) * (p.cp - 1);
        p.comm->all_gather(all, mine).wait();
        std::vector<at::Tensor> grads_of_sources;
        for (int j = 0; j < p.cp; ++j) {
          auto [kj, vj] = unpack(all.narrow(0, j * mine.numel(), mine.numel()), k.sizes(), v.sizes());
          grads_of_sources.push_back(grad_of(kj, vj, j));
        }
        const at::Tensor all_grads = at::cat(grads_of_sources);
        at::Tensor own = at::empty({all_grads.numel() / p.cp}, all_grads.options());
        p.stats->bytes_sent += own.numel() * static_cast<int64_t>(own.element_size()) * (p.cp - 1);
        p.comm->reduce_scatter(own, all_grads).wait();
        std::tie(dk, dv) = unpack(own, k.sizes(), v.sizes());
        break;
      }
      case Exchange::kRing: {
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
          auto [kj, vj] = unpack(cur, k.sizes(), v.sizes());
          at::Tensor acc = grad_of(kj, vj, j);
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
        break;
      }
    }
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor()};
  }
};

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  HP_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "context parallel attention: q, k and v must be [B, heads, T, d], got ",
           q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  HP_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(2) == q.size(2) && v.size(2) == q.size(2),
           "context parallel attention: batch and tokens differ between q ", q.sizes(), ", k ", k.sizes(), " and v ",
           v.sizes());
  HP_CHECK(k.size(3) == q.size(3), "context parallel attention: q's head size ", q.size(3), " is not k's ", k.size(3));
  HP_CHECK(v.size(1) == k.size(1), "context parallel attention: k has ", k.size(1), " heads but v ", v.size(1));
  HP_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "context parallel attention: ", q.size(1),
           " query heads are not a multiple of ", k.size(1), " key/value heads");
  HP_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
           "context parallel attention: q, k and v have dtypes ", q.scalar_type(), ", ", k.scalar_type(), ", ",
           v.scalar_type());
  HP_CHECK(at::isFloatingType(q.scalar_type()), "context parallel attention: dtype ", q.scalar_type(),
           " is not a floating type");
}

double scale_or_default(double scale, const at::Tensor& q) {
  return scale != 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

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

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<Run>& q_runs,
                           const std::vector<Run>& k_runs, Mask mask, double scale) {
  check_shapes(q, k, v);
  auto plan = c10::make_intrusive<Plan>();
  plan->q_runs = q_runs;
  plan->k_runs = {k_runs};
  plan->mask = mask;
  plan->scale = scale_or_default(scale, q);
  plan->stats = std::make_shared<AttentionStats>();
  return AttentionFunction::apply(q, k, v, plan);
}

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
                                      double scale) {
  check_shapes(q, k, v);
  const int cp = size();
  HP_CHECK(!(options_.split == Split::kHeadTail && mask == Mask::kNone),
           "context parallel: the head_tail split balances a causal mask; with no mask use the contiguous split");
  const SequenceSplit split = split_of(q.size(2) * cp);
  const double s = scale_or_default(scale, q);
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
    auto plan = c10::make_intrusive<Plan>();
    plan->q_runs = all;
    plan->k_runs = {all};
    plan->mask = mask;
    plan->scale = s;
    plan->stats = stats_;
    const at::Tensor o = AttentionFunction::apply(sequence_to_heads(q, group_, stats_), sequence_to_heads(k, group_, stats_),
                                                  sequence_to_heads(v, group_, stats_), plan);
    return heads_to_sequence(o, group_, stats_);
  }
  auto plan = c10::make_intrusive<Plan>();
  plan->exchange = cp == 1 ? Exchange::kNone : (options_.method == Method::kRing ? Exchange::kRing : Exchange::kAllGather);
  plan->comm = options_.method == Method::kRing ? ring_ : group_;
  plan->cp = cp;
  plan->rank = rank();
  plan->q_runs = split.runs(rank());
  for (int r = 0; r < cp; ++r) plan->k_runs.push_back(split.runs(r));
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
