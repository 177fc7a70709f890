#include "hp/attn/attention.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <cmath>
#include <limits>

#include "hp/core/error.h"

namespace hp::attn {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// How a (query tile, key tile) pair is computed.
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

at::Tensor where_zero(const at::Tensor& cond, const at::Tensor& x, double value) {
  return at::where(cond, at::full({}, value, x.options()), x);
}

// The tile of `t` [B, heads, T, x] at run r, its heads grouped by key/value head:
// [B, kv_heads, heads / kv_heads, r.length, x] (a view).
at::Tensor grouped(const at::Tensor& t, const Run& r, int64_t kv_heads) {
  const at::Tensor s = t.narrow(2, r.offset, r.length);
  return s.view({s.size(0), kv_heads, s.size(1) / kv_heads, r.length, s.size(3)});
}
// A key/value tile [B, kv_heads, 1, r.length, x] (a view) that broadcasts over the group.
at::Tensor shared(const at::Tensor& t, const Run& r) { return t.narrow(2, r.offset, r.length).unsqueeze(2); }
// A key/value tile's gradient summed over the query heads sharing it.
at::Tensor over_group(const at::Tensor& g) { return g.size(2) == 1 ? g.squeeze(2) : g.sum(2); }

// One block's scores [B, kv_heads, group, tq, tk], masked where needed.
at::Tensor scores(const at::Tensor& q5, const at::Tensor& k5, const Run& qr, const Run& kr, Block b, double scale) {
  at::Tensor s = at::matmul(q5, k5.transpose(-2, -1)).mul_(scale);
  if (b == Block::kMasked) s.masked_fill_(causal_mask(qr, kr, s.device()), -kInf);
  return s;
}

void check_runs(const std::vector<Run>& runs, int64_t tokens, const char* what) {
  int64_t total = 0;
  for (const Run& r : runs) {
    HP_CHECK(r.start >= 0 && r.length >= 1 && r.offset >= 0 && r.offset + r.length <= tokens, "attention: a ", what,
             " run (start ", r.start, ", length ", r.length, ", offset ", r.offset, ") outside the ", tokens,
             " tokens it indexes");
    total += r.length;
  }
  HP_CHECK(total == tokens, "attention: the ", what, " runs cover ", total, " tokens, not the tensor's ", tokens);
}

// What the local autograd function needs besides the tensors.
struct Plan : torch::CustomClassHolder {
  std::vector<Run> q_tiles, k_tiles;
  Mask mask = Mask::kCausal;
  double scale = 1.0;
  TileCounts* counts = nullptr;
};

// The gradients of q, k and v of a local call (LocalAttention's or KeptAttention's),
// followed by `extra` undefined ones for their other inputs.
torch::autograd::variable_list local_backward(torch::autograd::AutogradContext* ctx, const at::Tensor& grad,
                                              size_t extra) {
  const Plan& p = *static_cast<Plan*>(ctx->saved_data["plan"].toCapsule().get());
  BackwardState b = begin_backward(ctx, grad);
  const at::ScalarType ct = b.qc.scalar_type();
  auto [dk, dv] =
      backward_source(b.qc, b.k.to(ct), b.v.to(ct), p.q_tiles, p.k_tiles, p.mask, p.scale, b.dout, b.lse, b.delta, b.dq);
  torch::autograd::variable_list out = {b.dq.to(b.q.scalar_type()), dk.to(b.k.scalar_type()), dv.to(b.v.scalar_type())};
  out.resize(3 + extra);
  return out;
}

// Returns the output and, not differentiable, the log-sum-exps.
struct LocalAttention : torch::autograd::Function<LocalAttention> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const c10::intrusive_ptr<Plan>& plan) {
    const Plan& p = *plan;
    ForwardState f = begin_forward(q, v);
    const at::ScalarType ct = f.qc.scalar_type();
    forward_source(f.qc, k.to(ct), v.to(ct), p.q_tiles, p.k_tiles, p.mask, p.scale, f.o, f.lse, p.counts);
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    at::Tensor out = end_forward(ctx, q, k, v, f);
    ctx->mark_non_differentiable({f.lse});
    return {out, f.lse};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return local_backward(ctx, grads[0], 1);
  }
};

// The output of an earlier LocalAttention (kept by recomputation) with its backward.
struct KeptAttention : torch::autograd::Function<KeptAttention> {
  struct Kept {
    at::Tensor out, lse;
  };
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const c10::intrusive_ptr<Plan>& plan, Kept kept) {
    ctx->save_for_backward({q, k, v, kept.out, kept.lse});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    return kept.out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return local_backward(ctx, grads[0], 2);
  }
};

c10::intrusive_ptr<Plan> whole_sequence_plan(const at::Tensor& q, Mask mask, double scale, int64_t tile) {
  const std::vector<Run> whole = {Run{0, q.size(2), 0}};
  auto plan = c10::make_intrusive<Plan>();
  plan->q_tiles = tile_runs(whole, tile);
  plan->k_tiles = plan->q_tiles;
  plan->mask = mask;
  plan->scale = scale_or_default(scale, q);
  return plan;
}

}  // namespace

std::vector<Run> tile_runs(const std::vector<Run>& runs, int64_t tile) {
  HP_CHECK(tile >= 1, "attention: tile=", tile, " must be at least 1");
  std::vector<Run> out;
  for (const Run& r : runs) {
    for (int64_t i = 0; i < r.length; i += tile) out.push_back(Run{r.start + i, std::min(tile, r.length - i), r.offset + i});
  }
  return out;
}

double causal_score_elements(int64_t seq, int64_t tile) {
  HP_CHECK(tile >= 1, "attention: tile=", tile, " must be at least 1");
  double n = 0;
  for (int64_t i = 0; i < seq; i += tile) {
    n += static_cast<double>(std::min(tile, seq - i)) * static_cast<double>(std::min(i + tile, seq));
  }
  return n;
}

double tile_workspace_elements(int64_t seq, int64_t tile) {
  HP_CHECK(tile >= 1, "attention: tile=", tile, " must be at least 1");
  const double t = static_cast<double>(std::min(tile, seq));
  return 2.0 * t * t;
}

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* who) {
  HP_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, who, ": q, k and v must be [B, heads, T, d], got ", q.sizes(),
           ", ", k.sizes(), ", ", v.sizes());
  HP_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(2) == q.size(2) && v.size(2) == q.size(2), who,
           ": batch and tokens differ between q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes());
  HP_CHECK(k.size(3) == q.size(3), who, ": q's head size ", q.size(3), " is not k's ", k.size(3));
  HP_CHECK(v.size(1) == k.size(1), who, ": k has ", k.size(1), " heads but v ", v.size(1));
  HP_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, who, ": ", q.size(1), " query heads are not a multiple of ",
           k.size(1), " key/value heads");
  HP_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), who, ": q, k and v have dtypes ",
           q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  HP_CHECK(at::isFloatingType(q.scalar_type()), who, ": dtype ", q.scalar_type(), " is not a floating type");
}

double scale_or_default(double scale, const at::Tensor& q) {
  return scale != 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

at::ScalarType compute_dtype(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

void forward_source(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<Run>& q_tiles,
                    const std::vector<Run>& k_tiles, Mask mask, double scale, at::Tensor& o, at::Tensor& lse,
                    TileCounts* counts) {
  const int64_t kvh = k.size(1);
  for (const Run& qr : q_tiles) {
    const at::Tensor q5 = grouped(q, qr, kvh);
    // The running maximum, sum and weighted values of each row over the key tiles so far.
    at::Tensor m, l, acc;
    for (const Run& kr : k_tiles) {
      const Block b = classify(qr, kr, mask);
      if (b == Block::kSkip) continue;
      at::Tensor s = scores(q5, shared(k, kr), qr, kr, b, scale);
      at::Tensor m_new = std::get<0>(s.max(-1, true));
      if (m.defined()) m_new = at::maximum(m, m_new);
      const at::Tensor m_safe = where_zero(at::isinf(m_new), m_new, 0.0);  // a row with every key hidden so far
      const at::Tensor e = s.sub_(m_safe).exp_();
      if (!m.defined()) {
        l = e.sum(-1, true);
        acc = at::matmul(e, shared(v, kr));
      } else {
        const at::Tensor corr = (m - m_safe).exp_();
        l = l.mul_(corr).add_(e.sum(-1, true));
        acc = acc.mul_(corr).add_(at::matmul(e, shared(v, kr)));
      }
      m = m_new;
      if (counts != nullptr) {
        counts->blocks += 1;
        counts->masked_blocks += b == Block::kMasked ? 1 : 0;
        counts->score_elements += qr.length * kr.length;
      }
    }
    if (!m.defined()) continue;  // no key of this source is visible to these queries
    const at::Tensor m_safe = where_zero(at::isinf(m), m, 0.0);
    const at::Tensor o_b = acc.div_(where_zero(l == 0, l, 1.0));
    const at::Tensor lse_b = m_safe + at::log(l);
    // Merge with the sources before: lse = log(exp(lse_a) + exp(lse_b)), o their weighted mean.
    at::Tensor o_a = grouped(o, qr, kvh), lse_a = grouped(lse, qr, kvh);
    const at::Tensor mx = at::maximum(lse_a, lse_b);
    const at::Tensor mx_safe = where_zero(at::isinf(mx), mx, 0.0);
    const at::Tensor wa = at::exp(lse_a - mx_safe), wb = at::exp(lse_b - mx_safe);
    const at::Tensor sum = wa + wb;
    o_a.copy_((o_a * wa + o_b * wb) / where_zero(sum == 0, sum, 1.0));
    lse_a.copy_(mx_safe + at::log(sum));
  }
}

std::pair<at::Tensor, at::Tensor> backward_source(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const std::vector<Run>& q_tiles, const std::vector<Run>& k_tiles,
                                                  Mask mask, double scale, const at::Tensor& dout,
                                                  const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq) {
  const int64_t kvh = k.size(1);
  at::Tensor dk = at::zeros_like(k), dv = at::zeros_like(v);
  for (const Run& qr : q_tiles) {
    const at::Tensor q5 = grouped(q, qr, kvh), do5 = grouped(dout, qr, kvh), delta5 = grouped(delta, qr, kvh);
    const at::Tensor l5 = grouped(lse, qr, kvh);
    const at::Tensor l_safe = where_zero(at::isinf(l5), l5, 0.0);
    at::Tensor dq5 = grouped(dq, qr, kvh);
    for (const Run& kr : k_tiles) {
      const Block b = classify(qr, kr, mask);
      if (b == Block::kSkip) continue;
      const at::Tensor k5 = shared(k, kr), v5 = shared(v, kr);
      const at::Tensor prob = scores(q5, k5, qr, kr, b, scale).sub_(l_safe).exp_();
      dv.narrow(2, kr.offset, kr.length).add_(over_group(at::matmul(prob.transpose(-2, -1), do5)));
      const at::Tensor ds = at::matmul(do5, v5.transpose(-2, -1)).sub_(delta5).mul_(prob).mul_(scale);
      dq5.add_(at::matmul(ds, k5));
      dk.narrow(2, kr.offset, kr.length).add_(over_group(at::matmul(ds.transpose(-2, -1), q5)));
    }
  }
  return {dk, dv};
}

ForwardState begin_forward(const at::Tensor& q, const at::Tensor& v) {
  ForwardState f;
  f.qc = q.to(compute_dtype(q));
  f.o = at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, f.qc.options());
  f.lse = at::full({q.size(0), q.size(1), q.size(2), 1}, -kInf, f.qc.options());
  return f;
}

at::Tensor end_forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const ForwardState& f) {
  at::Tensor out = f.o.to(q.scalar_type());
  ctx->save_for_backward({q, k, v, out, f.lse});
  return out;
}

BackwardState begin_backward(torch::autograd::AutogradContext* ctx, const at::Tensor& grad_out) {
  const auto saved = ctx->get_saved_variables();
  BackwardState b{saved[0], saved[1], saved[2], saved[4]};
  const at::ScalarType ct = compute_dtype(b.q);
  b.qc = b.q.to(ct);
  b.dout = grad_out.to(ct);
  b.delta = (b.dout * saved[3].to(ct)).sum(-1, true);
  b.dq = at::zeros_like(b.qc);
  return b;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<Run>& q_runs,
                     const std::vector<Run>& k_runs, Mask mask, double scale, int64_t tile, TileCounts* counts) {
  check_shapes(q, k, v, "attention");
  check_runs(q_runs, q.size(2), "query");
  check_runs(k_runs, k.size(2), "key");
  auto plan = c10::make_intrusive<Plan>();
  plan->q_tiles = tile_runs(q_runs, tile);
  plan->k_tiles = tile_runs(k_runs, tile);
  plan->mask = mask;
  plan->scale = scale_or_default(scale, q);
  plan->counts = counts;
  return LocalAttention::apply(q, k, v, plan)[0];
}

std::pair<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     Mask mask, double scale, int64_t tile) {
  check_shapes(q, k, v, "attention");
  auto r = LocalAttention::apply(q, k, v, whole_sequence_plan(q, mask, scale, tile));
  return {r[0], r[1]};
}

at::Tensor attention_from_kept(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               const at::Tensor& lse, Mask mask, double scale, int64_t tile) {
  check_shapes(q, k, v, "attention");
  HP_CHECK(out.dim() == 4 && out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2) &&
               out.size(3) == v.size(3) && lse.dim() == 4 && lse.size(2) == q.size(2) && lse.size(3) == 1,
           "attention: a kept output ", out.sizes(), " or log-sum-exp ", lse.sizes(), " does not match q ", q.sizes(),
           " and v ", v.sizes());
  return KeptAttention::apply(q, k, v, whole_sequence_plan(q, mask, scale, tile), KeptAttention::Kept{out, lse});
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Mask mask, double scale,
                     int64_t tile) {
  return attention_with_lse(q, k, v, mask, scale, tile).first;
}

}  // namespace hp::attn
