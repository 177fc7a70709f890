#include "hp/tp/parallelize.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <mutex>

#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/core/weak_key_map.h"
#include "hp/core/pattern.h"
#include "hp/hooks/call.h"
#include "hp/hooks/recompute.h"

namespace hp::tp {

// ---- name patterns ---------------------------------------------------------------------

bool match_module_name(const std::string& pattern, const std::string& name) {
  return wildcard_match(pattern, name, /*star_crosses_dot=*/false);
}

// ---- gradient sums ---------------------------------------------------------------------

namespace {
// Parameters whose gradient is already summed by a hook: a second hook would double it.
std::mutex g_summed_mu;
WeakKeyMap<c10::TensorImpl, c10::weak_intrusive_ptr<c10::TensorImpl>, bool> g_summed;
}  // namespace

void sum_gradient_over(const at::Tensor& param, const CommPtr& group, c10::optional<at::ScalarType> rd) {
  {
    std::lock_guard<std::mutex> g(g_summed_mu);
    g_summed.prune();
    HP_CHECK(g_summed.find(param.unsafeGetTensorImpl()) == nullptr, "tensor parallel: a parameter of shape ",
             param.sizes(), " already has its gradient summed over a group (a module parallelized twice?)");
    g_summed.assign(param.unsafeGetTensorImpl(), c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()),
                    true);
  }
  if (group->size() == 1) return;
  on_gradient(param, [group, rd](const at::Tensor& grad) {
    return redistribute_no_grad(grad, group, Partial(), Replicate(), rd);
  });
}

// ---- styles ----------------------------------------------------------------------------

namespace {

struct Target {
  torch::nn::Module& module;
  std::string name;  // dotted name, "" for the root
  const CommPtr& group;
  const ParallelizeOptions& opts;
  std::string label() const { return name.empty() ? std::string("the root module") : "'" + name + "'"; }
};

// Tensors made Replicate by a PrepareModuleInput whose module is running on this thread:
// the colwise layers inside use them as they are.
struct PreparedFrame {
  const torch::nn::Module* module;
  std::vector<at::Tensor> tensors;
};
thread_local std::vector<PreparedFrame> t_prepared;

bool is_prepared(const at::Tensor& x) {
  for (const auto& f : t_prepared) {
    for (const auto& t : f.tensors) {
      if (t.is_same(x)) return true;
    }
  }
  return false;
}

void pop_prepared(const torch::nn::Module* m) {
  for (auto it = t_prepared.rbegin(); it != t_prepared.rend(); ++it) {
    if (it->module == m) {
      t_prepared.erase(std::next(it).base());
      return;
    }
  }
}

// Replaces `param` in place by this rank's piece along `dim`, and records its spec. A
// parameter built without storage (DeferredAllocation) gets a piece without storage too;
// its values come from the initializer, which reads the spec.
void shard_parameter(const Target& t, const std::string& pname, at::Tensor param, int64_t dim) {
  const int64_t n = t.group->size(), r = t.group->rank();
  HP_CHECK(param.dim() > dim, "tensor parallel: parameter '", pname, "' of ", t.label(), " has ", param.dim(),
           " dims; cannot split dim ", dim);
  HP_CHECK(param.size(dim) % n == 0, "tensor parallel: dim ", dim, " of parameter '", pname, "' of ", t.label(),
           " (shape ", param.sizes(), ") is ", param.size(dim), ", not divisible by the tensor-parallel degree ",
           n);
  HP_CHECK(!parameter_spec(param), "tensor parallel: parameter '", pname, "' of ", t.label(),
           " is already split (a module parallelized twice?)");
  std::vector<std::vector<DimSplit>> splits(param.dim());
  splits[dim].push_back(DimSplit{t.group->name(), n, r});
  ShardSpec spec = make_shard_spec(param.sizes().vec(), splits);
  at::NoGradGuard no_grad;
  at::Tensor piece;
  if (param.numel() > 0 && memory::is_deferred(param.storage().data())) {
    memory::DeferredAllocation deferred;
    piece = at::empty(spec.lengths, param.options());
  } else {
    piece = local_piece(param, Shard(dim), n, r).clone();
  }
  param.set_data(piece);
  set_parameter_spec(param, std::move(spec));
}

void mark_whole(const Target& t, const std::string& pname, const at::Tensor& param) {
  HP_CHECK(!parameter_spec(param), "tensor parallel: parameter '", pname, "' of ", t.label(),
           " is already split (a module parallelized twice?)");
}

const char* kind_of(torch::nn::Module& m) {
  if (dynamic_cast<torch::nn::LinearImpl*>(&m)) return "Linear";
  if (dynamic_cast<torch::nn::EmbeddingImpl*>(&m)) return "Embedding";
  return nullptr;
}

void check_kind(const Target& t, const char* style) {
  HP_CHECK(kind_of(t.module), style, " applies to Linear and Embedding modules; ", t.label(), " is ",
           t.module.name());
}

RedistributeOptions redist(const Target& t) { return RedistributeOptions{t.opts.reduce_dtype}; }

void apply(const Target& t, const ColwiseParallel& s) {
  check_kind(t, "ColwiseParallel");
  HP_CHECK(!s.input_layout.is_partial(), "ColwiseParallel on ", t.label(), ": input layout ",
           s.input_layout.to_string(), " is not supported yet");
  HP_CHECK(s.output_layout.is_replicate() || (s.output_layout.is_shard() && s.output_layout.dim == -1),
           "ColwiseParallel on ", t.label(), ": output layout ", s.output_layout.to_string(),
           " is not supported (Shard(-1) or Replicate)");
  const bool embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&t.module) != nullptr;
  if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(&t.module)) {
    shard_parameter(t, "weight", lin->weight, 0);
    if (lin->bias.defined()) shard_parameter(t, "bias", lin->bias, 0);
  } else {
    auto* emb = dynamic_cast<torch::nn::EmbeddingImpl*>(&t.module);
    // max_norm renormalizes each looked-up row by its norm, which needs the whole row; a
    // padding_idx row is zero and gets no gradient in every column piece alike.
    HP_CHECK(!emb->options.max_norm(), "ColwiseParallel on ", t.label(), ": an Embedding with max_norm=",
             *emb->options.max_norm(), " is not supported yet (each rank holds part of every row)");
    shard_parameter(t, "weight", emb->weight, 1);
  }
  CommPtr g = t.group;
  RedistributeOptions ro = redist(t);
  ForwardHooks h;
  h.cast_input = [g, s, ro, embedding](torch::nn::Module&, const at::Tensor& x, size_t arg) {
    if (arg != 0) return x;
    if (embedding) return redistribute_no_grad(x, g, s.input_layout, Replicate());  // token ids
    if (s.input_prepared || is_prepared(x)) return x;
    return redistribute(x, g, s.input_layout, Replicate(), /*grad=*/Partial(), ro);
  };
  if (s.output_layout.is_replicate()) {
    h.cast_output = [g, ro](torch::nn::Module&, const at::Tensor& y) {
      return redistribute(y, g, Shard(-1), Replicate(), /*grad=*/Replicate(), ro);
    };
  }
  register_forward_hooks(t.module, std::move(h));
}

void apply(const Target& t, const RowwiseParallel& s) {
  check_kind(t, "RowwiseParallel");
  HP_CHECK(!s.output_layout.is_shard() || (s.output_layout.dim != -1 && s.output_layout.dim >= 0),
           "RowwiseParallel on ", t.label(), ": output layout ", s.output_layout.to_string(),
           " is not supported (Replicate, Shard of a sequence dim, or Partial)");
  CommPtr g = t.group;
  RedistributeOptions ro = redist(t);
  const Placement out = s.output_layout;
  const Placement out_grad = out.is_partial() ? Replicate() : out;
  ForwardHooks h;
  if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(&t.module)) {
    HP_CHECK(s.input_layout.is_replicate() || (s.input_layout.is_shard() && s.input_layout.dim == -1),
             "RowwiseParallel on ", t.label(), ": input layout ", s.input_layout.to_string(),
             " is not supported (Shard(-1) or Replicate)");
    shard_parameter(t, "weight", lin->weight, 1);
    at::Tensor bias = lin->bias;
    if (bias.defined()) {
      mark_whole(t, "bias", bias);
      // Added once, after the reduction: each rank's partial output leaves it out. Added
      // to sequence pieces (or on one rank of a Partial output), its gradient is Partial.
      if (!out.is_replicate()) sum_gradient_over(bias, g, t.opts.reduce_dtype);
      h.pre = [lin](torch::nn::Module&) { lin->bias = at::Tensor(); };
      h.post = [lin, bias](torch::nn::Module&) { lin->bias = bias; };
      h.on_error = [lin, bias](torch::nn::Module&, const std::exception&) { lin->bias = bias; };
    }
    const Placement in = s.input_layout;
    h.cast_input = [g, in, ro](torch::nn::Module&, const at::Tensor& x, size_t arg) {
      if (arg != 0 || in.is_shard()) return x;
      return redistribute(x, g, Replicate(), Shard(-1), /*grad=*/Shard(-1), ro);
    };
    h.cast_output = [g, out, out_grad, ro, bias](torch::nn::Module&, const at::Tensor& y) {
      at::Tensor r = redistribute(y, g, Partial(), out, out_grad, ro);
      if (!bias.defined()) return r;
      // Left Partial: the bias counts once in the sum, yet every rank's copy gets a gradient
      // (zero but for rank 0), which the gradient sum then makes whole everywhere.
      if (out.is_partial()) return r + bias * (g->rank() == 0 ? 1.0 : 0.0);
      return r + bias;
    };
  } else {
    auto* emb = dynamic_cast<torch::nn::EmbeddingImpl*>(&t.module);
    HP_CHECK(s.input_layout.is_replicate() || s.input_layout.is_shard(), "RowwiseParallel on ", t.label(),
             ": input layout ", s.input_layout.to_string(), " is not supported for an Embedding");
    HP_CHECK(!emb->options.max_norm(), "RowwiseParallel on ", t.label(), ": an Embedding with max_norm=",
             *emb->options.max_norm(), " is not supported yet (its rows' norms are spread over the ranks' lookups)");
    const int64_t vocab = emb->weight.size(0);
    shard_parameter(t, "weight", emb->weight, 0);
    const int64_t per = vocab / g->size(), lo = per * g->rank();
    if (auto pad = emb->options.padding_idx()) {
      // The padding row is on one rank: its local index there. Elsewhere no row is padding
      // (ids outside a rank's rows give zeros there anyway).
      const int64_t p = *pad < 0 ? *pad + vocab : *pad;
      emb->options.padding_idx(p >= lo && p < lo + per ? c10::optional<int64_t>(p - lo) : c10::nullopt);
    }
    const Placement in = s.input_layout;
    // The mask of ids outside this rank's rows, from the input to the output of one call.
    auto masks = std::make_shared<std::vector<at::Tensor>>();
    h.cast_input = [g, in, lo, per, masks](torch::nn::Module&, const at::Tensor& ids, size_t arg) {
      if (arg != 0) return ids;
      at::Tensor all = redistribute_no_grad(ids, g, in, Replicate());
      at::Tensor outside = (all < lo).logical_or(all >= lo + per);
      masks->push_back(outside);
      return (all - lo).masked_fill(outside, 0);
    };
    h.cast_output = [g, out, out_grad, ro, masks](torch::nn::Module&, const at::Tensor& y) {
      HP_INTERNAL_ASSERT(!masks->empty(), "vocabulary-parallel embedding output without its input");
      at::Tensor outside = masks->back();
      masks->pop_back();
      return redistribute(y.masked_fill(outside.unsqueeze(-1), 0), g, Partial(), out, out_grad, ro);
    };
    h.on_error = [masks](torch::nn::Module&, const std::exception&) { masks->clear(); };
  }
  register_forward_hooks(t.module, std::move(h));
}

// Every parameter of the module (and its submodules) whole, its gradient summed over the group.
void sum_gradients_of(const Target& t) {
  for (const auto& item : t.module.named_parameters(/*recurse=*/true)) {
    mark_whole(t, item.key(), item.value());
    sum_gradient_over(item.value(), t.group, t.opts.reduce_dtype);
  }
}

void apply(const Target& t, const ReplicateParallel&) { sum_gradients_of(t); }

// Dropout on pieces of a tensor, with one process's values: the mask is one process's mask
// of the whole tensor, cut to this rank's piece, so every rank's generator also advances as
// one process's does (ranks that next drop out a replicated tensor stay in step). The
// module's own dropout of its piece runs first and is discarded: the generator is put back
// to where it was before it.
void sequence_parallel_dropout(const Target& t, const torch::nn::DropoutImpl& drop, int64_t dim) {
  HP_CHECK(!drop.options.inplace(), "SequenceParallel on ", t.label(), ": an in-place Dropout is not supported yet");
  struct Call {
    at::Tensor x;
    at::Tensor generator_state;
  };
  auto calls = std::make_shared<std::vector<Call>>();
  const int64_t n = t.group->size(), r = t.group->rank();
  const double p = drop.options.p();
  const std::string label = t.label();
  ForwardHooks h;
  h.cast_input = [calls, label](torch::nn::Module&, const at::Tensor& x, size_t arg) {
    if (arg != 0) return x;
    HP_CHECK(x.device().is_cpu(), "SequenceParallel on ", label, ": Dropout of a ", x.device(),
             " tensor is not supported yet (CPU only)");
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    calls->push_back(Call{x, gen.get_state()});
    return x;
  };
  h.cast_output = [calls, n, r, p, dim](torch::nn::Module& m, const at::Tensor& y) {
    HP_INTERNAL_ASSERT(!calls->empty(), "sequence-parallel Dropout output without its input");
    const Call c = calls->back();
    calls->pop_back();
    // Where one process draws nothing (eval, p 0 or 1), neither did the module's own dropout.
    if (!m.is_training() || p == 0 || p == 1 || c.x.numel() == 0) return y;
    at::Tensor noise;
    const int64_t d = dim < 0 ? dim + c.x.dim() : dim;
    std::vector<int64_t> whole = c.x.sizes().vec();
    whole[static_cast<size_t>(d)] *= n;
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(c.generator_state);
    }
    {
      at::NoGradGuard no_grad;
      noise = at::empty(whole, c.x.options().requires_grad(false)).bernoulli_(1 - p);
      noise = noise.narrow(d, r * c.x.size(d), c.x.size(d)).div_(1 - p);
    }
    return c.x * noise;
  };
  h.on_error = [calls](torch::nn::Module&, const std::exception&) { calls->clear(); };
  register_forward_hooks(t.module, std::move(h));
}

void apply(const Target& t, const SequenceParallel& s) {
  HP_CHECK(s.input_layout.is_replicate() || (s.input_layout.is_shard() && s.input_layout.dim == s.sequence_dim),
           "SequenceParallel on ", t.label(), ": input layout ", s.input_layout.to_string(),
           " is not supported (Shard(", s.sequence_dim, ") or Replicate)");
  // Other dropouts draw masks shaped by channels or features, not yet cut to pieces.
  HP_CHECK(!dynamic_cast<torch::nn::Dropout2dImpl*>(&t.module) && !dynamic_cast<torch::nn::Dropout3dImpl*>(&t.module) &&
               !dynamic_cast<torch::nn::AlphaDropoutImpl*>(&t.module) &&
               !dynamic_cast<torch::nn::FeatureAlphaDropoutImpl*>(&t.module),
           "SequenceParallel on ", t.label(), ": ", t.module.name(), " is not supported yet (Dropout is)");
  sum_gradients_of(t);
  if (s.input_layout.is_replicate()) {
    CommPtr g = t.group;
    RedistributeOptions ro = redist(t);
    const Placement seq = Shard(s.sequence_dim);
    ForwardHooks h;
    h.cast_input = [g, seq, ro](torch::nn::Module&, const at::Tensor& x, size_t arg) {
      return arg == 0 ? redistribute(x, g, Replicate(), seq, /*grad=*/seq, ro) : x;
    };
    register_forward_hooks(t.module, std::move(h));
  }
  // After the input's redistribution: its hooks run first.
  if (auto* drop = dynamic_cast<torch::nn::DropoutImpl*>(&t.module)) sequence_parallel_dropout(t, *drop, s.sequence_dim);
}

void apply(const Target& t, const PrepareModuleInput& s) {
  HP_CHECK(s.input_layouts.size() == s.desired_input_layouts.size(), "PrepareModuleInput on ", t.label(), ": ",
           s.input_layouts.size(), " input layouts but ", s.desired_input_layouts.size(), " desired layouts");
  for (size_t i = 0; i < s.input_layouts.size(); ++i) {
    HP_CHECK(s.input_layouts[i].has_value() == s.desired_input_layouts[i].has_value(), "PrepareModuleInput on ",
             t.label(), ": argument ", i, " has a layout but no desired layout, or the reverse");
  }
  CommPtr g = t.group;
  RedistributeOptions ro = redist(t);
  ForwardHooks h;
  h.pre = [](torch::nn::Module& m) { t_prepared.push_back(PreparedFrame{&m, {}}); };
  h.cast_input = [g, s, ro](torch::nn::Module&, const at::Tensor& x, size_t arg) {
    if (arg >= s.input_layouts.size() || !s.input_layouts[arg]) return x;
    const Placement& from = *s.input_layouts[arg];
    const Placement& to = *s.desired_input_layouts[arg];
    const Placement grad = to.is_replicate() ? Partial() : to.is_partial() ? Replicate() : to;
    at::Tensor y = redistribute(x, g, from, to, grad, ro);
    if (to.is_replicate()) t_prepared.back().tensors.push_back(y);
    return y;
  };
  h.post = [](torch::nn::Module& m) { pop_prepared(&m); };
  h.on_error = [](torch::nn::Module& m, const std::exception&) { pop_prepared(&m); };
  register_forward_hooks(t.module, std::move(h));
}

void apply(const Target& t, const PrepareModuleOutput& s) {
  CommPtr g = t.group;
  RedistributeOptions ro = redist(t);
  const Placement from = s.output_layout, to = s.desired_output_layout;
  const Placement grad = to.is_partial() ? Replicate() : to;
  ForwardHooks h;
  h.cast_output = [g, from, to, grad, ro](torch::nn::Module&, const at::Tensor& y) {
    return redistribute(y, g, from, to, grad, ro);
  };
  register_forward_hooks(t.module, std::move(h));
}

}  // namespace

void parallelize_module(torch::nn::Module& root, const CommPtr& group, const ParallelizePlan& plan,
                        const ParallelizeOptions& o) {
  HP_CHECK(group, "parallelize_module without a group");
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules;
  modules.emplace_back("", nullptr);  // the root (named_modules gives a shared_ptr we may not take)
  for (const auto& item : root.named_modules("", /*include_self=*/false)) modules.emplace_back(item.key(), item.value());
  std::vector<bool> used(plan.size(), false);
  for (const auto& [name, ptr] : modules) {
    torch::nn::Module& m = ptr ? *ptr : root;
    for (size_t i = 0; i < plan.size(); ++i) {
      if (!match_module_name(plan[i].first, name)) continue;
      used[i] = true;
      Target t{m, name, group, o};
      std::visit([&t](const auto& style) { apply(t, style); }, plan[i].second);
    }
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    HP_CHECK(used[i], "parallelize_module: plan pattern '", plan[i].first, "' matches no module");
  }
}

}  // namespace hp::tp
