#include "hp/tp/dtensor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "../comm/group_capsule.h"
#include "hp/core/error.h"

namespace hp::tp {

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::kShard:
      return detail::str_cat("Shard(", dim, ")");
    case Kind::kReplicate:
      return "Replicate()";
    case Kind::kPartial:
      return reduce == ReduceOp::AVG ? "Partial(avg)" : "Partial(sum)";
  }
  return "?";
}

namespace {

int64_t resolve_dim(int64_t d, int64_t ndim, const Placement& p) {
  const int64_t r = d < 0 ? d + ndim : d;
  HP_CHECK(r >= 0 && r < ndim, "placement ", p.to_string(), " names a dim outside a tensor of ", ndim, " dims");
  return r;
}

}  // namespace

bool Placement::same_as(const Placement& o, int64_t ndim) const {
  if (kind != o.kind) return false;
  if (kind == Kind::kShard) return resolve_dim(dim, ndim, *this) == resolve_dim(o.dim, ndim, o);
  if (kind == Kind::kPartial) return reduce == o.reduce;
  return true;
}

at::Tensor local_piece(const at::Tensor& full, const Placement& p, int64_t size, int64_t rank) {
  if (!p.is_shard() || size == 1) return full;
  const int64_t d = resolve_dim(p.dim, full.dim(), p);
  HP_CHECK(full.size(d) % size == 0, "tensor parallel: dim ", d, " of a tensor of shape ", full.sizes(), " (",
           full.size(d), ") is not divisible by the group size ", size);
  const int64_t len = full.size(d) / size;
  return full.narrow(d, rank * len, len);
}

namespace {

// A tensor whose dim d is moved first and made contiguous: the layout the flat
// collectives need (rank i's piece is the i-th block of rows).
at::Tensor rows_first(const at::Tensor& x, int64_t d, c10::optional<at::ScalarType> dt) {
  at::Tensor t = d == 0 ? x : x.movedim(d, 0);
  if (dt && *dt != t.scalar_type()) return t.to(*dt).contiguous();
  return t.contiguous();
}

at::Tensor gather_dim(const at::Tensor& x, int64_t d, const CommPtr& g) {
  at::Tensor in = rows_first(x, d, c10::nullopt);
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= g->size();
  at::Tensor out = at::empty(shape, in.options());
  g->all_gather(out, in).wait();
  return d == 0 ? out : out.movedim(0, d);
}

at::Tensor reduce_scatter_dim(const at::Tensor& x, int64_t d, const CommPtr& g, ReduceOp op,
                              c10::optional<at::ScalarType> rd) {
  HP_CHECK(x.size(d) % g->size() == 0, "tensor parallel: reduce-scatter of dim ", d, " of a tensor of shape ",
           x.sizes(), ": ", x.size(d), " is not divisible by the group size ", g->size());
  at::Tensor in = rows_first(x, d, rd);
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] /= g->size();
  at::Tensor out = at::empty(shape, in.options());
  g->reduce_scatter(out, in, ReduceOptions{op}).wait();
  if (out.scalar_type() != x.scalar_type()) out = out.to(x.scalar_type());
  return d == 0 ? out : out.movedim(0, d);
}

at::Tensor all_reduce_copy(const at::Tensor& x, const CommPtr& g, ReduceOp op, c10::optional<at::ScalarType> rd) {
  // Always a copy: the input may be saved by autograd or owned by the caller.
  at::Tensor t = x.to(rd.value_or(x.scalar_type()), /*non_blocking=*/false, /*copy=*/true).contiguous();
  g->all_reduce(t, ReduceOptions{op}).wait();
  return t.scalar_type() == x.scalar_type() ? t : t.to(x.scalar_type());
}

// The placement of the gradient of a tensor placed as `p`.
Placement grad_placement_of_input(const Placement& p) { return p.is_partial() ? Replicate() : p; }

bool supported(const Placement& from, const Placement& to, int64_t ndim) {
  if (from.same_as(to, ndim)) return true;
  if (to.is_replicate()) return true;                    // all-gather, all-reduce
  if (to.is_shard()) return !from.is_shard();            // slice, reduce-scatter
  return false;                                          // -> Partial, Shard -> other Shard
}

void check_supported(const Placement& from, const Placement& to, int64_t ndim, const char* what) {
  HP_CHECK(supported(from, to, ndim), "tensor parallel: redistributing ", what, " from ", from.to_string(), " to ",
           to.to_string(), " is not supported yet");
}

}  // namespace

at::Tensor redistribute_no_grad(const at::Tensor& x, const CommPtr& g, const Placement& from, const Placement& to,
                                c10::optional<at::ScalarType> rd) {
  HP_CHECK(g, "tensor parallel: redistribute without a group");
  const int64_t nd = x.dim();
  check_supported(from, to, nd, "a tensor");
  if (from.same_as(to, nd)) return x;
  if (g->size() == 1) return x;  // one piece is the whole (and its own sum and average)
  if (to.is_replicate()) {
    if (from.is_shard()) return gather_dim(x, resolve_dim(from.dim, nd, from), g);
    return all_reduce_copy(x, g, from.reduce, rd);  // Partial
  }
  const int64_t d = resolve_dim(to.dim, nd, to);
  if (from.is_replicate()) return local_piece(x, to, g->size(), g->rank());
  return reduce_scatter_dim(x, d, g, from.reduce, rd);  // Partial -> Shard
}

namespace {

void save_placement(torch::autograd::AutogradContext* ctx, const std::string& key, const Placement& p) {
  ctx->saved_data[key + "_kind"] = static_cast<int64_t>(p.kind);
  ctx->saved_data[key + "_dim"] = p.dim;
  ctx->saved_data[key + "_op"] = static_cast<int64_t>(p.reduce);
}

Placement load_placement(torch::autograd::AutogradContext* ctx, const std::string& key) {
  Placement p;
  p.kind = static_cast<Placement::Kind>(ctx->saved_data[key + "_kind"].toInt());
  p.dim = ctx->saved_data[key + "_dim"].toInt();
  p.reduce = static_cast<ReduceOp>(ctx->saved_data[key + "_op"].toInt());
  return p;
}

struct RedistributeFunction : torch::autograd::Function<RedistributeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const CommPtr& g,
                            const Placement& from, const Placement& to, const Placement& grad,
                            c10::optional<at::ScalarType> rd) {
    ctx->saved_data["group"] = detail::group_capsule(g);
    save_placement(ctx, "from", from);
    save_placement(ctx, "grad", grad);
    ctx->saved_data["reduce_dtype"] = rd ? static_cast<int64_t>(*rd) : int64_t{-1};
    at::Tensor out = redistribute_no_grad(x, g, from, to);
    // No movement: a view, as autograd expects of a function returning its input. A slice
    // of the input gets storage of its own, so that nothing the caller does to the input
    // later (or to the result) reaches the other.
    if (out.is_same(x)) return x.view_as(x);
    return out.is_alias_of(x) ? out.clone() : out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const CommPtr g = detail::group_of_capsule(ctx->saved_data["group"]);
    const Placement from = load_placement(ctx, "from");
    const Placement grad = load_placement(ctx, "grad");
    const int64_t rd_code = ctx->saved_data["reduce_dtype"].toInt();
    c10::optional<at::ScalarType> rd;
    if (rd_code >= 0) rd = static_cast<at::ScalarType>(rd_code);
    at::Tensor gi = redistribute_no_grad(grads[0], g, grad, grad_placement_of_input(from), rd);
    if (from.is_partial() && from.reduce == ReduceOp::AVG) gi = gi / static_cast<double>(g->size());
    if (gi.is_alias_of(grads[0])) gi = gi.clone();  // a slice of the incoming gradient
    return {gi, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor redistribute(const at::Tensor& x, const CommPtr& g, const Placement& from, const Placement& to,
                        const Placement& grad, const RedistributeOptions& o) {
  HP_CHECK(g, "tensor parallel: redistribute without a group");
  const int64_t nd = x.dim();
  check_supported(from, to, nd, "a tensor");
  check_supported(grad, grad_placement_of_input(from), nd, "the gradient");
  if (!x.requires_grad() || !at::GradMode::is_enabled()) return redistribute_no_grad(x, g, from, to);
  return RedistributeFunction::apply(x, g, from, to, grad, o.reduce_dtype);
}

DTensor DTensor::from_local(at::Tensor local, CommPtr group, Placement placement) {
  HP_CHECK(group, "DTensor::from_local without a group");
  DTensor t;
  t.global_shape_ = local.sizes().vec();
  if (placement.is_shard()) t.global_shape_[resolve_dim(placement.dim, local.dim(), placement)] *= group->size();
  t.local_ = std::move(local);
  t.group_ = std::move(group);
  t.placement_ = placement;
  return t;
}

DTensor DTensor::distribute(const at::Tensor& full, CommPtr group, Placement placement) {
  HP_CHECK(group, "DTensor::distribute without a group");
  HP_CHECK(!placement.is_partial(), "DTensor::distribute to ", placement.to_string(), " is not supported yet");
  at::Tensor piece = local_piece(full, placement, group->size(), group->rank()).clone();
  DTensor t = from_local(piece, std::move(group), placement);
  t.global_shape_ = full.sizes().vec();
  return t;
}

DTensor DTensor::redistribute(const Placement& to, const Placement& grad, const RedistributeOptions& o) const {
  DTensor t = *this;
  t.local_ = tp::redistribute(local_, group_, placement_, to, grad, o);
  t.placement_ = to;
  return t;
}

at::Tensor DTensor::full_tensor() const {
  return tp::redistribute(local_, group_, placement_, Replicate(), Replicate());
}

}  // namespace hp::tp
