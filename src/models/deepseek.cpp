#include "hp/models/deepseek.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/activation.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/models/family.h"
#include "hp/hooks/call.h"
#include "hp/hooks/recompute.h"
#include "hp/cp/context_parallel.h"
#include "hp/tp/dtensor.h"

namespace hp::models {
namespace {
torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// out unchanged in forward; in backward, besides out's gradient, `scale` as the gradient of
// the scalar `loss`: a loss computed inside the model joins the training loss's backward
// without changing the value the trainer reports.
struct AddLossGradient : torch::autograd::Function<AddLossGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out, const at::Tensor& loss,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dtype"] = loss.scalar_type();
    return out.view_as(out);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor g = at::full({}, scale, grads[0].options().dtype(ctx->saved_data["dtype"].toScalarType()));
    return {grads[0], g, at::Tensor()};
  }
};
}  // namespace

int64_t DeepSeekConfig::largest_block_params() const {
  // A one-layer model of each kind, less the embedding, output head and final norm.
  auto block = [&](bool dense) {
    DeepSeekConfig one = *this;
    one.layers = 1;
    one.dense_layers = dense ? 1 : 0;
    one.mtp_layers = 0;
    return one.num_params() - 2 * vocab * dim - dim;
  };
  int64_t biggest = 0;
  if (dense_layers > 0) biggest = block(true);
  if (layers > dense_layers) biggest = std::max(biggest, block(false));
  return biggest;
}

namespace {
// The parameter count in T: int64_t for the value, double to detect overflow.
template <typename T>
T count_params(const DeepSeekConfig& c) {
  const T dim = c.dim, heads = c.heads, ql = c.q_lora_rank, kvl = c.kv_lora_rank, nope = c.qk_nope_dim,
          rope = c.qk_rope_dim, vd = c.v_head_dim, experts = c.experts;
  const T mla = dim * ql + ql + ql * heads * (nope + rope) + dim * (kvl + rope) + kvl + kvl * heads * (nope + vd) +
                heads * vd * dim;
  const T dense_ffn = T(3) * dim * T(c.dense_hidden);
  const T moe = dim * experts + (experts + T(c.shared_experts)) * T(3) * dim * T(c.expert_hidden);
  // A multi-token prediction module: enorm, hnorm, eh_proj, a MoE block and its norm.
  const T mtp = T(3) * dim + T(2) * dim * dim + mla + T(2) * dim + moe;
  return T(2) * T(c.vocab) * dim + dim + T(c.layers) * (mla + T(2) * dim) + T(c.dense_layers) * dense_ffn +
         T(c.layers - c.dense_layers) * moe + T(c.mtp_layers) * mtp;
}
}  // namespace

int64_t DeepSeekConfig::num_params() const { return count_params<int64_t>(*this); }
int64_t DeepSeekConfig::mtp_module_params() const {
  DeepSeekConfig one = *this;
  one.mtp_layers = 1;
  DeepSeekConfig none = *this;
  none.mtp_layers = 0;
  return one.num_params() - none.num_params();
}
int64_t DeepSeekConfig::largest_param() const {
  return std::max({vocab * dim, dense_layers > 0 ? dim * dense_hidden : 0, q_lora_rank * heads * (qk_nope_dim + qk_rope_dim),
                   dim * q_lora_rank, dim * (kv_lora_rank + qk_rope_dim), kv_lora_rank * heads * (qk_nope_dim + v_head_dim),
                   heads * v_head_dim * dim, dim * experts, dim * shared_experts * expert_hidden});
}

double DeepSeekConfig::attention_scale_factor() const {
  if (rope_scaling != RopeScaling::kYarn || rope_mscale_all_dim == 0) return 1.0;
  const double m = yarn_mscale(rope_factor, rope_mscale_all_dim);
  return m * m;
}

void DeepSeekConfig::validate() const {
  check_rope(rope(), "deepseek config");
  HP_CHECK(aux_loss_coeff >= 0 && std::isfinite(aux_loss_coeff), "deepseek config: aux_loss_coeff=", aux_loss_coeff,
           " must be a finite number >= 0");
  HP_CHECK(capacity_factor >= 0 && std::isfinite(capacity_factor), "deepseek config: capacity_factor=",
           capacity_factor, " must be a finite number >= 0 (0: no limit)");
  HP_CHECK(attention_tile >= 1, "deepseek config: attention_tile=", attention_tile, " must be at least 1");
  HP_CHECK(layers <= kMaxLayers, "deepseek config: layers=", layers, " is more than the ", kMaxLayers,
           " blocks a model may have (a damaged config?)");
  HP_CHECK(dense_layers >= 0 && dense_layers <= layers, "deepseek config: dense_layers=", dense_layers,
           " must be in [0, layers=", layers, "]");
  HP_CHECK(experts_per_token >= 1 && experts_per_token <= experts, "deepseek config: experts_per_token=",
           experts_per_token, " must be in [1, experts=", experts, "]");
  // experts / experts_per_token already lets an expert take every token: a larger factor
  // limits nothing (and one near 1e17 overflowed the capacity before this bound).
  HP_CHECK(capacity_factor <= static_cast<double>(experts), "deepseek config: capacity_factor=", capacity_factor,
           " is above experts=", experts, ": from experts / experts_per_token on no token is dropped (0: no limit)");
  HP_CHECK(expert_groups >= 1 && experts % expert_groups == 0, "deepseek config: expert_groups=", expert_groups,
           " must divide experts=", experts);
  HP_CHECK(expert_groups == 1 || experts / expert_groups >= 2, "deepseek config: expert_groups=", expert_groups,
           " leaves ", experts / std::max<int64_t>(expert_groups, 1),
           " expert per group (a group is ranked by its two best scores: at least 2 each)");
  HP_CHECK(groups_per_token >= 1 && groups_per_token <= expert_groups, "deepseek config: groups_per_token=",
           groups_per_token, " must be in [1, expert_groups=", expert_groups, "]");
  HP_CHECK(experts_per_token <= groups_per_token * (experts / expert_groups), "deepseek config: experts_per_token=",
           experts_per_token, " is more than the ", groups_per_token * (experts / expert_groups),
           " experts of groups_per_token=", groups_per_token, " groups");
  HP_CHECK(routed_scale > 0 && std::isfinite(routed_scale), "deepseek config: routed_scale=", routed_scale,
           " must be a finite number > 0");
  HP_CHECK(qk_rope_dim % 2 == 0, "deepseek config: qk_rope_dim=", qk_rope_dim, " must be even");
  HP_CHECK(count_params<double>(*this) < 4e18, "deepseek config: ", count_params<double>(*this),
           " parameters is too many to count");
  HP_CHECK(heads > 0 && dim > 0 && vocab > 0, "deepseek config: heads, dim and vocab must be positive");
  HP_CHECK(mtp_layers >= 0, "deepseek config: mtp_layers=", mtp_layers, " must be 0 or 1");
  if (mtp_layers > 1) {
    HP_NOT_SUPPORTED("deepseek config: mtp_layers=", mtp_layers,
                     " (multi-token prediction of more than 1 token ahead; DeepSeek-V3 has 1)");
  }
  HP_CHECK(mtp_loss_scale >= 0 && std::isfinite(mtp_loss_scale), "deepseek config: mtp_loss_scale=", mtp_loss_scale,
           " must be a finite number >= 0");
}

DeepSeekConfig DeepSeekConfig::tiny() { return DeepSeekConfig{}; }

DeepSeekConfig DeepSeekConfig::deepseek_v3() {
  DeepSeekConfig c;
  c.vocab = 129280;
  c.dim = 7168;
  c.layers = 61;
  c.dense_layers = 3;
  c.heads = 128;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_dim = 128;
  c.qk_rope_dim = 64;
  c.v_head_dim = 128;
  c.dense_hidden = 18432;
  c.experts = 256;
  c.experts_per_token = 8;
  c.shared_experts = 1;
  c.expert_hidden = 2048;
  c.expert_groups = 8;
  c.groups_per_token = 4;
  c.routed_scale = 2.5;
  c.max_seq = 4096;
  return c;
}

MLAImpl::MLAImpl(const DeepSeekConfig& cfg) : c(cfg) {
  const int64_t qk = c.qk_nope_dim + c.qk_rope_dim;
  // The latents' norms keep DeepSeek-V3's epsilon whatever norm_eps is, as its code and
  // Hugging Face's do.
  constexpr double kLatentNormEps = 1e-6;
  wq_a = register_module("wq_a", linear(c.dim, c.q_lora_rank));
  q_norm = register_module("q_norm", RMSNorm(c.q_lora_rank, kLatentNormEps));
  wq_b = register_module("wq_b", linear(c.q_lora_rank, c.heads * qk));
  wkv_a = register_module("wkv_a", linear(c.dim, c.kv_lora_rank + c.qk_rope_dim));
  kv_norm = register_module("kv_norm", RMSNorm(c.kv_lora_rank, kLatentNormEps));
  wkv_b = register_module("wkv_b", linear(c.kv_lora_rank, c.heads * (c.qk_nope_dim + c.v_head_dim)));
  wo = register_module("wo", linear(c.heads * c.v_head_dim, c.dim));
}

at::Tensor MLAImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1), qk = c.qk_nope_dim + c.qk_rope_dim;
  // The head count comes from the up-projection: under tensor parallelism each rank holds
  // heads / tp of them.
  // The up-projections are what RecomputePolicy::kLight recomputes (their outputs are much
  // wider than their inputs), as DeepSeek-V3 trains.
  const at::Tensor q_latent = hp::call(q_norm, hp::call(wq_a, x));
  at::Tensor q = hp::recomputed_here([&] { return hp::call(wq_b, q_latent); }).view({B, T, -1, qk}).transpose(1, 2);
  const int64_t H = q.size(1);
  at::Tensor q_nope = q.narrow(-1, 0, c.qk_nope_dim);
  at::Tensor q_rope = apply_rotary(q.narrow(-1, c.qk_nope_dim, c.qk_rope_dim).contiguous(), cos, sin);
  at::Tensor kv_a = hp::call(wkv_a, x);
  at::Tensor latent = hp::call(kv_norm, kv_a.narrow(-1, 0, c.kv_lora_rank));
  // The decoupled rotary key: one per token, shared by all heads.
  at::Tensor k_rope = apply_rotary(kv_a.narrow(-1, c.kv_lora_rank, c.qk_rope_dim).unsqueeze(1).contiguous(), cos, sin);
  at::Tensor kv = hp::recomputed_here([&] { return hp::call(wkv_b, latent); }).view({B, T, H, c.qk_nope_dim + c.v_head_dim}).transpose(1, 2);
  at::Tensor k_nope = kv.narrow(-1, 0, c.qk_nope_dim);
  at::Tensor v = kv.narrow(-1, c.qk_nope_dim, c.v_head_dim);
  // Queries and keys whole per head (the rotary key repeated for every head), values of
  // their own size: one call of the tiled kernel, with or without context parallelism.
  at::Tensor qf = at::cat({q_nope, q_rope}, -1);
  at::Tensor kf = at::cat({k_nope, k_rope.expand({B, H, T, c.qk_rope_dim})}, -1);
  const double scale = c.attention_scale_factor() / std::sqrt(static_cast<double>(qk));
  const at::Tensor o = context_parallel
                           ? context_parallel->attention(qf, kf, v, cp::Mask::kCausal, scale, c.attention_tile)
                           : causal_attention(qf, kf, v, scale, c.attention_tile);
  return hp::call(wo, o.transpose(1, 2).reshape({B, T, H * c.v_head_dim}));
}

ExpertsImpl::ExpertsImpl(int64_t first_expert, std::vector<SwiGLU> experts) : first(first_expert) {
  for (size_t i = 0; i < experts.size(); ++i) {
    list.push_back(register_module(std::to_string(first + static_cast<int64_t>(i)), experts[i]));
  }
}

at::Tensor ExpertsImpl::forward(const at::Tensor& rows, const std::vector<int64_t>& counts) {
  HP_CHECK(counts.size() == list.size(), "Experts: ", counts.size(), " row counts for ", list.size(), " experts");
  return run(0, rows, counts);
}

at::Tensor ExpertsImpl::forward(ep::InFlight& f) {
  HP_CHECK(f.chunk_first(f.chunks()) == static_cast<int64_t>(list.size()), "Experts: a dispatch of ",
           f.chunk_first(f.chunks()), " local experts for ", list.size(), " experts");
  for (int g = 0; g < f.chunks(); ++g) f.send_back(g, run(f.chunk_first(g), f.rows(g), f.counts(g)));
  return f.returned();
}

at::Tensor ExpertsImpl::run(int64_t from, const at::Tensor& rows, const std::vector<int64_t>& counts) {
  // Every expert runs, on no rows too (a zero gradient): which experts get tokens differs
  // between ranks and steps, but every rank's backward then produces the same gradients in
  // the same order, so the reductions that follow line up across ranks (and one process
  // decays an idle expert's weights as a grouped matmul over all experts would).
  std::vector<at::Tensor> ys;
  int64_t offset = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    ys.push_back(hp::call(list[from + static_cast<int64_t>(i)], rows.narrow(0, offset, counts[i])));
    offset += counts[i];
  }
  return at::cat(ys);
}

MoEImpl::MoEImpl(const DeepSeekConfig& cfg) : c(cfg) {
  gate = register_module("gate", linear(c.dim, c.experts));
  std::vector<SwiGLU> all;
  for (int64_t e = 0; e < c.experts; ++e) all.push_back(SwiGLU(c.dim, c.expert_hidden));
  experts = register_module("experts", Experts(0, std::move(all)));
  dispatcher = ep::local_dispatcher(c.experts);
  if (c.shared_experts > 0) shared = register_module("shared", SwiGLU(c.dim, c.shared_experts * c.expert_hidden));
  bias = register_buffer("bias", at::zeros({c.experts}));
  load = register_buffer("load", at::zeros({c.experts}));
}

std::pair<at::Tensor, at::Tensor> MoEImpl::route(const at::Tensor& x) const {
  return route_scores(scores_of(hp::call(const_cast<torch::nn::Linear&>(gate), x)));
}

at::Tensor MoEImpl::scores_of(const at::Tensor& logits) const {
  return c.router_score == RouterScore::kSoftmax ? upcast(logits).softmax(-1) : upcast(logits).sigmoid();
}

std::pair<at::Tensor, at::Tensor> MoEImpl::route_scores(const at::Tensor& scores) const {
  // The bias steers which experts are chosen, not how much they weigh.
  at::Tensor choice = scores.detach() + bias;
  if (c.groups_per_token < c.expert_groups) {
    // Each group ranked by its two best choice scores; the others' experts are out.
    const int64_t G = c.expert_groups;
    at::Tensor grouped = choice.view({-1, G, c.experts / G});
    at::Tensor group_score = std::get<0>(grouped.topk(2, -1)).sum(-1);
    at::Tensor best = std::get<1>(group_score.topk(c.groups_per_token, -1));
    at::Tensor allowed = at::zeros_like(group_score, group_score.options().dtype(at::kBool)).scatter_(1, best, true);
    choice = grouped.masked_fill(~allowed.unsqueeze(-1), -std::numeric_limits<double>::infinity()).view({-1, c.experts});
  }
  at::Tensor chosen = std::get<1>(choice.topk(c.experts_per_token, -1));
  at::Tensor w = scores.gather(-1, chosen);
  if (c.norm_topk) w = w / w.sum(-1, /*keepdim=*/true);
  return {chosen, c.routed_scale == 1.0 ? w : w * c.routed_scale};
}

at::Tensor MoEImpl::balance_loss(const at::Tensor& scores, const at::Tensor& chosen, int64_t B, int64_t T) const {
  const int64_t E = c.experts, k = chosen.size(1);
  at::Tensor picked = at::zeros({B * T, E}, scores.options()).scatter_(1, chosen, 1.0).view({B, T, E}).sum(1);
  // With the sequence in pieces over tp, f counts the whole sequences' choices (summed over
  // the group); P is linear in the tokens' scores, so each rank adds its own tokens' part
  // and the gradients, each on its own tokens and summed over tp at the router, add up.
  int64_t whole_T = T;
  if (tp && tp_sequence_pieces) {
    tp->all_reduce(picked).wait();
    whole_T = T * tp->size();
  }
  at::Tensor share = (scores / scores.sum(-1, /*keepdim=*/true)).view({B, T, E}).sum(1) / static_cast<double>(whole_T);
  at::Tensor f = picked * (static_cast<double>(E) / static_cast<double>(k * whole_T));
  return c.aux_loss_coeff * (f * share).sum(-1).mean();
}

at::Tensor MoEImpl::capacity_keep(const at::Tensor& chosen_scores, const at::Tensor& chosen) const {
  const int64_t N = chosen.size(0), k = chosen.size(1), E = c.experts;
  // No expert holds more than the N x k slots: the capacity is counted in doubles and capped
  // there, so no factor overflows the integer.
  const double want = std::ceil(c.capacity_factor * static_cast<double>(N * k) / static_cast<double>(E));
  const int64_t cap = want >= static_cast<double>(N * k) ? N * k : static_cast<int64_t>(want);
  at::Tensor flat = chosen.reshape({-1});
  at::Tensor positions = at::arange(N * k, chosen.options());
  // The slots in priority order, then grouped by expert (a stable sort keeps the priority
  // within each expert); a slot's rank within its expert's group decides.
  at::Tensor by_priority =
      c.drop_policy == DropPolicy::kProbs
          ? std::get<1>(at::sort(chosen_scores.detach().reshape({-1}), /*stable=*/true, /*dim=*/0, /*descending=*/true))
          : positions;
  at::Tensor grouped =
      by_priority.index_select(0, std::get<1>(at::sort(flat.index_select(0, by_priority), /*stable=*/true, 0, false)));
  at::Tensor counts = at::bincount(flat, {}, E).to(at::kLong);
  at::Tensor starts = counts.cumsum(0) - counts;
  at::Tensor rank = positions - starts.index_select(0, flat.index_select(0, grouped));
  c10::List<c10::optional<at::Tensor>> at_slots;
  at_slots.push_back(grouped);
  return at::zeros({N * k}, chosen.options().dtype(at::kBool)).index_put(at_slots, rank < cap).view({N, k});
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const auto shape = x.sizes().vec();
  at::Tensor flat = x.reshape({-1, c.dim});
  at::Tensor scores = scores_of(hp::call(gate, flat));
  auto [chosen, weights] = route_scores(scores);
  // The balancing load counts training tokens: once per token (not again when recomputed in
  // backward), and not in a forward that is not differentiated (a validation pass, the
  // pipeline's shape check), which must leave the next bias update as it would have been.
  const bool training = hp::in_differentiated_forward() && !hp::in_recompute();
  // Rows left out (routed_rows) are routed as if they were not there.
  at::Tensor rows;  // the routed rows' indices; undefined: every row
  if (routed_rows.defined()) {
    HP_CHECK(routed_rows.dim() == 1 && routed_rows.size(0) == flat.size(0), "MoE: routed_rows of shape ",
             routed_rows.sizes(), " for ", flat.size(0), " tokens");
    rows = routed_rows.to(flat.device()).nonzero().squeeze(1);
  }
  const auto routed = [&](const at::Tensor& t) { return rows.defined() ? t.index_select(0, rows) : t; };
  if (training) {
    at::NoGradGuard g;
    load += at::bincount(routed(chosen).reshape({-1}), {}, c.experts).to(at::kFloat);
  }
  // A capacity limit drops slots before they are sent (id -1, weight 0).
  at::Tensor ids = chosen, w = weights;
  if (rows.defined()) {
    at::Tensor out_rows = ~routed_rows.to(flat.device()).unsqueeze(1);
    ids = ids.masked_fill(out_rows, -1);
    w = w.masked_fill(out_rows, 0);
  }
  if (c.capacity_factor > 0) {
    at::Tensor keep = capacity_keep(routed(scores.gather(-1, chosen)), routed(chosen));
    if (rows.defined()) {
      keep = at::zeros(chosen.sizes(), keep.options()).index_copy(0, rows, keep);
      keep |= ~routed_rows.to(flat.device()).unsqueeze(1);  // rows left out are no drops
    }
    ids = ids.masked_fill(~keep, -1);
    w = w.masked_fill(~keep, 0);
    if (training) {
      // Made here, not in the constructor: a model built without storage materializes its
      // buffers alone (and a per-step count has no place in a checkpoint).
      if (!dropped.defined()) dropped = at::zeros({}, at::TensorOptions(at::kDouble).device(keep.device()));
      dropped += (~keep).sum().to(at::kDouble);
    }
  }
  // The shared experts run after the dispatch is issued (while an overlapped one's rows
  // travel), in both ways alike: autograd then runs their backward and the dispatch's in the
  // same order, and the input's gradient sums its parts in the same order, bitwise.
  at::Tensor out;
  if (overlap_chunks > 1) {
    ep::InFlight f = dispatcher->dispatch_overlapped(flat, ids, w, static_cast<int>(overlap_chunks));
    if (shared) out = hp::call(shared, flat);
    at::Tensor routed = dispatcher->combine_overlapped(hp::call(experts, f), f);
    out = shared ? out + routed : routed;
  } else {
    ep::Dispatched d = dispatcher->dispatch(flat, ids, w);
    if (shared) out = hp::call(shared, flat);
    at::Tensor routed = dispatcher->combine(hp::call(experts, d.rows, d.counts), d);
    out = shared ? out + routed : routed;
  }
  if (c.aux_loss_coeff > 0 && at::GradMode::is_enabled()) {
    HP_CHECK(shape.size() == 3, "MoE: the balance loss needs sequences [batch, time, dim], got shape ", x.sizes());
    // With the tokens alike on every tensor-parallel rank, each adds the whole loss's
    // gradient, which the router's and the input's reductions over tp then sum: 1/tp each.
    const double replicas = tp && !tp_sequence_pieces ? static_cast<double>(tp->size()) : 1.0;
    out = AddLossGradient::apply(out, balance_loss(scores, chosen, shape[0], shape[1]), loss_scale / replicas);
  }
  return out.view(shape);
}

void expert_parallel(MoEImpl& moe, const CommPtr& ep, const ep::DispatchOptions& o) {
  HP_CHECK(ep, "expert_parallel: no expert-parallel group");
  const auto& all = moe.experts->list;
  HP_CHECK(static_cast<int64_t>(all.size()) == moe.c.experts, "expert_parallel: the MoE holds ", all.size(),
           " of its ", moe.c.experts, " experts (expert parallelism applies once, to a whole MoE)");
  const int64_t local = moe.c.experts / std::max(1, ep->size());
  HP_CHECK(o.overlap_chunks >= 1 && o.overlap_chunks <= std::max<int64_t>(local, 1), "expert_parallel: ",
           o.overlap_chunks, " overlap chunks for ", local,
           " local experts (a chunk is a whole number of experts: 1 to ", local, ")");
  HP_CHECK(o.overlap_chunks == 1 || o.kind == ep::DispatcherKind::kAllToAll, "expert_parallel: ", o.overlap_chunks,
           " overlap chunks with the de-duplicating dispatcher is not supported yet (the all-to-all one overlaps)");
  if (ep->size() == 1) return;
  auto d = ep::make_dispatcher(o.kind, ep, moe.c.experts);
  const int64_t first = d->first_local_expert();
  std::vector<SwiGLU> kept(all.begin() + first, all.begin() + first + d->local_experts());
  moe.experts = moe.replace_module("experts", Experts(first, std::move(kept)));
  moe.dispatcher = std::move(d);
  moe.overlap_chunks = o.overlap_chunks;
}

void expert_parallel(DeepSeekImpl& model, const CommPtr& ep, const ep::DispatchOptions& o) {
  for (auto& [layer, moe] : model.moes()) expert_parallel(*moe, ep, o);
}

void MoEImpl::update_balancing_bias(double rate, const CommPtr& dp) {
  at::NoGradGuard g;
  if (!dropped.defined()) dropped = at::zeros({}, load.options().dtype(at::kDouble));
  if (dp) {
    // The load and the dropped slots in one all-reduce.
    at::Tensor both = at::cat({load.to(at::kDouble), dropped.reshape({1})});
    dp->all_reduce(both).wait();
    load.copy_(both.narrow(0, 0, c.experts));
    dropped.copy_(both[c.experts]);
  }
  at::Tensor mean = load.mean();
  bias += rate * at::sign(mean - load);
  last_load = load.clone();
  last_dropped = dropped.item<double>();
  load.zero_();
  dropped.zero_();
}

DeepSeekBlockImpl::DeepSeekBlockImpl(const DeepSeekConfig& c, bool is_dense) {
  attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps));
  attn = register_module("attn", MLA(c));
  ffn_norm = register_module("ffn_norm", RMSNorm(c.dim, c.norm_eps));
  if (is_dense) {
    dense = register_module("mlp", SwiGLU(c.dim, c.dense_hidden));
  } else {
    moe = register_module("moe", MoE(c));
  }
}

at::Tensor DeepSeekBlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor h = x + hp::call(attn, hp::call(attn_norm, x), cos, sin);
  at::Tensor n = hp::call(ffn_norm, h);
  return h + (dense ? hp::call(dense, n) : hp::call(moe, n));
}

MTPImpl::MTPImpl(const DeepSeekConfig& c) {
  enorm = register_module("enorm", RMSNorm(c.dim, c.norm_eps));
  hnorm = register_module("hnorm", RMSNorm(c.dim, c.norm_eps));
  eh_proj = register_module("eh_proj", linear(2 * c.dim, c.dim));
  block = register_module("block", DeepSeekBlock(c, /*dense=*/false));  // its index is past dense_layers
  norm = register_module("norm", RMSNorm(c.dim, c.norm_eps));
}

at::Tensor MTPImpl::forward(const at::Tensor& e, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                            const RecomputePolicy* recompute) {
  at::Tensor z = hp::call(eh_proj, at::cat({hp::call(enorm, e), hp::call(hnorm, h)}, -1));
  z = recompute ? hp::recompute_with(*recompute, block, z, cos, sin) : hp::call(block, z, cos, sin);
  return hp::call(norm, z);
}

DeepSeekImpl::DeepSeekImpl(const DeepSeekConfig& c, const PipelineSlice& sl) : config(c), slice(sl) {
  c.validate();
  const int64_t end = check_slice(sl, c.layers);
  // Multi-token prediction embeds the next tokens on the stage with the head: a pipeline's
  // last stage holds its own copy of the embedding (same name, same initial values).
  if (sl.embedding || (sl.head && c.mtp_layers > 0)) {
    tok_emb = register_module("tok_emb", torch::nn::Embedding(c.vocab, c.dim));
  }
  for (int64_t i = sl.first_layer; i < end; ++i) {
    blocks.push_back(register_module("layers_" + std::to_string(i), DeepSeekBlock(c, i < c.dense_layers)));
  }
  if (sl.head) {
    norm = register_module("norm", RMSNorm(c.dim, c.norm_eps));
    output = register_module("output", linear(c.dim, c.vocab));
    for (int64_t k = 0; k < c.mtp_layers; ++k) mtp.push_back(register_module("mtp_" + std::to_string(k), MTP(c)));
  }
  if (!hp::memory::deferring()) init_weights(0);  // built without storage: fully_shard initializes
}

at::Tensor DeepSeekImpl::forward(const at::Tensor& x) {
  // Targets are for this forward only: a later one without set_targets must not reuse them.
  at::Tensor targets = std::move(mtp_targets);
  mtp_targets = at::Tensor();
  const int64_t cp = context_parallel ? context_parallel->size() : 1;
  const int64_t T = (slice.embedding ? x.size(1) : x.size(1) * stream_split) * cp;
  HP_CHECK(T <= config.max_seq, "sequence of ", T, " tokens is longer than max_seq=", config.max_seq);
  auto [cos, sin] = rotary_rows(rotary_tables(T, config.qk_rope_dim, config.rope()), context_parallel.get());
  cos = cos.to(x.device());
  sin = sin.to(x.device());
  at::Tensor h = slice.embedding ? hp::call(tok_emb, x) : x;
  for (auto& b : blocks) h = recompute ? hp::recompute_with(*recompute, b, h, cos, sin) : hp::call(b, h, cos, sin);
  if (!output) return h;
  // Trained, not evaluated: a forward without gradients (validation) is the next-token one.
  if (mtp.empty() || !at::GradMode::is_enabled()) return hp::call(output, hp::call(norm, h));
  HP_CHECK(targets.defined(), "DeepSeek: multi-token prediction (mtp_layers=", config.mtp_layers,
           ") needs the targets of each differentiated forward (set_targets)");
  return with_mtp_loss(h, targets, cos, sin);
}

at::Tensor DeepSeekImpl::with_mtp_loss(const at::Tensor& h, const at::Tensor& y, const at::Tensor& cos,
                                       const at::Tensor& sin) {
  // This context-parallel rank's L positions (all T without CP), of which h holds its
  // tensor-parallel piece under sequence parallelism; y [B, L] their targets.
  const int64_t cp = context_parallel ? context_parallel->size() : 1;
  const int64_t B = h.size(0), L = h.size(1) * stream_split, T = L * cp;
  HP_CHECK(y.dim() == 2 && y.size(0) == B && y.size(1) == L, "DeepSeek: targets of shape ", y.sizes(),
           " for a forward of ", B, " sequences of ", L, " tokens");
  HP_CHECK(T >= 2, "DeepSeek: multi-token prediction needs sequences of at least 2 tokens, got ", T);
  // Position i sees h_i and the next token's embedding (targets[i]) and predicts the token
  // after it (targets[i+1]): the sequence's last position has none. The module's rows do not
  // split over the tensor-parallel ranks like the stream's: under sequence parallelism it
  // runs on the whole of the rank's positions (the stream and the embedding gathered; their
  // gradients, the same on every rank, cut back to the piece), as the blocks do without it.
  at::Tensor hw = h, e;
  if (stream_split > 1) {
    HP_CHECK(tensor_parallel != nullptr, "DeepSeek: sequence pieces (stream_split=", stream_split,
             ") without the tensor-parallel group");
    hw = tp::redistribute(h, tensor_parallel, tp::Shard(1), tp::Replicate(), /*grad=*/tp::Replicate());
    e = tp::redistribute(hp::call(tok_emb, y), tensor_parallel, tp::Shard(1), tp::Replicate(), tp::Replicate());
  } else {
    e = hp::call(tok_emb, y);
  }
  at::Tensor next, kept;  // each row's target [B, n]; under CP the rows that have one [L]
  at::Tensor rc = cos, rs = sin;
  if (!context_parallel) {
    // The first T-1 positions.
    e = e.narrow(1, 0, T - 1);
    hw = hw.narrow(1, 0, T - 1);
    rc = cos.narrow(0, 0, T - 1);
    rs = sin.narrow(0, 0, T - 1);
    next = y.narrow(1, 1, T - 1);
  } else {
    // Every position of the rank, its ring attention's chunks whole: the token after the next
    // may sit on another rank (the targets gathered: B x T ids), and the sequence's last
    // position, on one rank, is routed nowhere and left out of the loss.
    const cp::SequenceSplit split = context_parallel->split_of(T);
    at::Tensor all = at::empty({cp * B * L}, y.options());
    context_parallel->group()->all_gather(all, y.contiguous().view(-1)).wait();
    at::Tensor whole = cp::restore(all.view({cp, B, L}).permute({1, 0, 2}).reshape({B, cp * L}), 1, split);
    next = cp::shard(at::roll(whole, {-1}, {1}), 1, split, context_parallel->rank());
    kept = split.positions(context_parallel->rank()).to(y.device()) != T - 1;
    for (auto& m : mtp) m->block->moe->routed_rows = kept.unsqueeze(0).expand({B, L}).reshape({-1});
  }
  at::Tensor z = hp::call(mtp.front(), e, hw, rc, rs,
                          recompute ? &*recompute : static_cast<const RecomputePolicy*>(nullptr));
  // The shared head runs once, on both (a split backward records each module's one call),
  // stacked along the batch: z (padded to T positions without CP) splits over tp as the
  // stream does (the padding's logits get no gradient).
  if (!context_parallel) z = at::constant_pad_nd(z, {0, 0, 0, 1});
  if (stream_split > 1) z = tp::redistribute(z, tensor_parallel, tp::Replicate(), tp::Shard(1), /*grad=*/tp::Shard(1));
  at::Tensor both = hp::call(output, at::cat({hp::call(norm, h), z}, 0));
  at::Tensor logits = both.narrow(0, 0, B), mtp_logits = both.narrow(0, B, B);
  at::Tensor loss;
  if (!context_parallel) {
    loss = loss_of_logits(mtp_logits.narrow(1, 0, T - 1), next);
  } else {
    // The mean over this rank's rows, weighted so that the mean over the CP ranks (the
    // gradients' and the reported losses' average) is the sequence's mean over T-1 rows.
    // (A rank whose one position is the sequence's last, as a contiguous split of T = cp
    // tokens gives, has no row: its part is 0.)
    at::Tensor rows = kept.nonzero().squeeze(1);
    loss = rows.numel() == 0
               ? mtp_logits.sum() * 0.0
               : loss_of_logits(mtp_logits.index_select(1, rows), next.index_select(1, rows)) *
                     (static_cast<double>(rows.numel() * cp) / static_cast<double>(T - 1));
  }
  {
    at::NoGradGuard g;
    at::Tensor v = loss.detach().to(at::kDouble);
    mtp_loss_sum_ = mtp_loss_sum_.defined() ? mtp_loss_sum_ + v : v;
    ++mtp_losses_;
  }
  return AddLossGradient::apply(logits, loss, config.mtp_loss_scale * loss_scale);
}

std::pair<double, int64_t> DeepSeekImpl::take_mtp_loss() {
  const std::pair<double, int64_t> out{mtp_loss_sum_.defined() ? mtp_loss_sum_.item<double>() : 0.0, mtp_losses_};
  mtp_loss_sum_ = at::Tensor();
  mtp_losses_ = 0;
  return out;
}

std::vector<std::pair<int64_t, MoE>> DeepSeekImpl::moes() const {
  std::vector<std::pair<int64_t, MoE>> out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i]->moe) out.emplace_back(slice.first_layer + static_cast<int64_t>(i), blocks[i]->moe);
  }
  for (size_t k = 0; k < mtp.size(); ++k) out.emplace_back(config.layers + static_cast<int64_t>(k), mtp[k]->block->moe);
  return out;
}

void context_parallel(DeepSeekImpl& model, std::shared_ptr<cp::ContextParallel> ctx) {
  HP_CHECK(ctx != nullptr, "context_parallel: the context is null");
  HP_CHECK(!model.context_parallel, "context_parallel: the model is already context-parallel");
  if (model.config.aux_loss_coeff > 0) {
    HP_NOT_SUPPORTED("context parallelism with the sequence-wise balance loss (model.aux_loss_coeff=",
                     model.config.aux_loss_coeff, "): a CP rank holds part of each sequence");
  }
  model.context_parallel = ctx;
  for (auto& b : model.blocks) b->attn->context_parallel = ctx;
  for (auto& m : model.mtp) m->block->attn->context_parallel = ctx;
}

at::Tensor DeepSeekImpl::loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) const {
  return cross_entropy_of_logits(logits, targets, vocab_parallel_loss);
}

void DeepSeekImpl::update_balancing_bias(const CommPtr& dp) {
  for (auto& [layer, moe] : moes()) moe->update_balancing_bias(config.bias_update_rate, dp);
}

}  // namespace hp::models
