// Activation recomputation: a custom autograd function whose forward runs the module
// without autograd and whose backward recomputes it with autograd on and differentiates
// the recomputation (see hp/hooks/recompute.h for the contract).
#include "hp/hooks/recompute.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>

#include <set>

#include "hp/core/error.h"

namespace hp {
namespace {

thread_local int t_recompute = 0;
// >0 while the recomputation's gradients are computed without accumulation on this thread:
// on libtorch 2.x a parameter's own hooks run there as well as where the gradient is
// accumulated, and on_gradient's hooks pass the gradient through in the first of these.
thread_local int t_capturing = 0;
// Inside RecomputeFunction::forward: the first forward of a recomputed call.
thread_local int t_first_forward = 0;

struct CaptureScope {
  CaptureScope() { ++t_capturing; }
  ~CaptureScope() { --t_capturing; }
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;
};

struct RecomputeScope {
  RecomputeScope() { ++t_recompute; }
  ~RecomputeScope() { --t_recompute; }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

// Installs a forward override on this thread for its lifetime.
class OverrideScope {
 public:
  explicit OverrideScope(detail::ForwardOverride* o) : prev_(detail::set_forward_override(o)) {}
  ~OverrideScope() { detail::set_forward_override(prev_); }
  OverrideScope(const OverrideScope&) = delete;
  OverrideScope& operator=(const OverrideScope&) = delete;

 private:
  detail::ForwardOverride* prev_;
};

// The backward of y = x W^T + b given y itself: the product is not recomputed.
struct KeptLinear : torch::autograd::Function<KeptLinear> {
  struct Kept {
    at::Tensor y;
  };
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& w, const c10::optional<at::Tensor>& b, Kept kept) {
    // An absent bias is passed as nullopt: autograd then sees no input there.
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = b.has_value();
    return {kept.y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &g = grads[0];
    const int64_t in = w.size(1), out = w.size(0);
    at::Tensor g2 = g.reshape({-1, out}), x2 = x.reshape({-1, in});
    at::Tensor dx = g2.mm(w).view(x.sizes());
    at::Tensor dw = g2.t().mm(x2);
    at::Tensor db = ctx->saved_data["bias"].toBool() ? g2.sum(0) : at::Tensor();
    return {dx, dw, db, at::Tensor()};
  }
};

// kKeepMatmuls and kLight: in the first forward, records each Linear's output in call order
// (under kLight, those outside recomputed_here regions, and the kept steps' results); in
// the recomputation, hands them back through KeptLinear (and the steps' replays) instead
// of computing them again.
class MatmulKeeper : public detail::ForwardOverride {
 public:
  explicit MatmulKeeper(bool light) : light_(light) {}
  at::Tensor step(const std::function<std::vector<at::Tensor>()>& run,
                  const std::function<at::Tensor(const std::vector<at::Tensor>&)>& replay) override {
    if (!light_) return run().at(0);
    if (!replay_) {
      steps_.push_back(run());
      return steps_.back().at(0);
    }
    HP_CHECK(next_step_ < steps_.size(), "hp::recompute: the recomputation reached more kept steps (", next_step_ + 1,
             ") than the first forward (", steps_.size(), "); the module's forward must be deterministic");
    std::vector<at::Tensor> kept = std::move(steps_[next_step_++]);  // freed with the recomputation's graph
    return replay(kept);
  }
  void enter_recomputed_region(int delta) override { recomputed_depth_ += delta; }

  at::Tensor forward(torch::nn::Module& m, const at::Tensor& x,
                     const std::function<at::Tensor(const at::Tensor&)>& real) override {
    auto* lin = dynamic_cast<torch::nn::LinearImpl*>(&m);
    if (lin == nullptr || (light_ && recomputed_depth_ > 0)) return real(x);
    if (!replay_) {
      at::Tensor y = real(x);
      kept_.push_back(y);
      return y;
    }
    HP_CHECK(next_ < kept_.size(), "hp::recompute: the recomputation called more Linear modules (",
             next_ + 1, ") than the first forward (", kept_.size(), "); the module's forward must be deterministic");
    at::Tensor y = kept_[next_];
    kept_[next_++] = at::Tensor();  // handed over: freed with the graph of the recomputation
    HP_CHECK(y.defined() && y.size(-1) == lin->weight.size(0),
             "hp::recompute: a kept Linear output does not match its module in the recomputation");
    c10::optional<at::Tensor> bias;
    if (lin->bias.defined()) bias = lin->bias;
    return KeptLinear::apply(x, lin->weight, bias, KeptLinear::Kept{y})[0];
  }
  void start_replay() {
    replay_ = true;
    next_ = 0;
    next_step_ = 0;
  }

 private:
  const bool light_;
  std::vector<at::Tensor> kept_;
  std::vector<std::vector<at::Tensor>> steps_;
  size_t next_ = 0, next_step_ = 0;
  int recomputed_depth_ = 0;
  bool replay_ = false;
};

struct Run : torch::CustomClassHolder {
  detail::RecomputeFn fn;
  RecomputePolicy policy = RecomputePolicy::kFull;
  std::vector<at::Tensor> params;  // the module's parameters that require grad
  std::unique_ptr<MatmulKeeper> keeper;
};

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<torch::CustomClassHolder> holder,
                                                at::TensorList args_in, at::TensorList params) {
    (void)params;  // inputs for their gradient edges only; the run holds them
    std::vector<at::Tensor> args = args_in.vec();
    auto* run = static_cast<Run*>(holder.get());
    at::Tensor out;
    ++t_first_forward;
    struct Leave {
      ~Leave() { --t_first_forward; }
    } leave;
    if (run->keeper) {
      OverrideScope o(run->keeper.get());
      out = run->fn(args);
    } else {
      out = run->fn(args);
    }
    ctx->save_for_backward(args);
    ctx->saved_data["run"] = c10::IValue::make_capsule(holder);
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* run = static_cast<Run*>(ctx->saved_data["run"].toCapsule().get());
    std::vector<at::Tensor> saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const auto& x : saved) {
      at::Tensor d = x.detach();
      if (x.requires_grad()) d.requires_grad_(true);
      inputs.push_back(d);
    }
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      RecomputeScope recompute;
      if (run->keeper) {
        run->keeper->start_replay();
        OverrideScope o(run->keeper.get());
        out = run->fn(inputs);
      } else {
        out = run->fn(inputs);
      }
    }
    // Gradients of the arguments and the parameters from the recomputation. The parameters'
    // gradients go back to the backward that reached us, whose accumulators (and hooks)
    // receive them.
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].requires_grad()) {
        wrt.push_back(inputs[i]);
        slot.push_back(1 + i);
      }
    }
    for (size_t j = 0; j < run->params.size(); ++j) {
      wrt.push_back(run->params[j]);
      slot.push_back(1 + inputs.size() + j);
    }
    torch::autograd::variable_list result(1 + inputs.size() + run->params.size());
    if (!wrt.empty() && out.requires_grad() && grads[0].defined()) {
      CaptureScope capturing;
      auto g = torch::autograd::grad({out}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
      for (size_t k = 0; k < g.size(); ++k) result[slot[k]] = g[k];
    }
    return result;
  }
};

}  // namespace

bool in_recompute() { return t_recompute > 0; }
bool in_differentiated_forward() { return at::GradMode::is_enabled() || t_first_forward > 0; }

unsigned on_gradient(const at::Tensor& leaf, std::function<at::Tensor(const at::Tensor&)> fn) {
  HP_CHECK(leaf.requires_grad() && leaf.grad_fn() == nullptr,
           "hp::on_gradient: the tensor must be a leaf that requires grad (a parameter)");
  at::Tensor t = leaf;
  return t.register_hook([fn = std::move(fn)](const at::Tensor& grad) -> at::Tensor {
    // Captured by the recomputation's own gradient (libtorch 2.x runs the hook there too):
    // it runs again where the recomputation hands the gradient to the accumulator.
    if (t_capturing > 0) return grad;
    return fn(grad);
  });
}

at::Tensor keep_step(const std::function<std::vector<at::Tensor>()>& run,
                     const std::function<at::Tensor(const std::vector<at::Tensor>&)>& replay) {
  if (detail::ForwardOverride* o = detail::forward_override()) return o->step(run, replay);
  return run().at(0);
}

namespace detail {

at::Tensor recompute_impl(torch::nn::Module& m, RecomputeFn fn, const std::vector<at::Tensor>& args,
                           RecomputePolicy policy) {
  if (!at::GradMode::is_enabled()) return fn(args);  // nothing will be differentiated
  auto run = c10::make_intrusive<Run>();
  run->fn = std::move(fn);
  run->policy = policy;
  if (policy != RecomputePolicy::kFull) run->keeper = std::make_unique<MatmulKeeper>(policy == RecomputePolicy::kLight);
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : m.parameters(/*recurse=*/true)) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) run->params.push_back(p);
  }
  // TensorLists, so that autograd sees every argument and parameter as an input.
  return RecomputeFunction::apply(c10::intrusive_ptr<torch::CustomClassHolder>(run), at::TensorList(args),
                                   at::TensorList(run->params))[0];
}

}  // namespace detail
}  // namespace hp
