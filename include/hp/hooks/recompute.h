// Activation recomputation at the call boundary (what other libraries call activation
// checkpointing; here "checkpoint" means only a distributed checkpoint, hp/ckpt/):
// hp::recompute(module, tensors...) runs hp::call(module, tensors...) without keeping the
// activations inside the module, and recomputes them during backward.
//
// Contract
// - The forward runs once without autograd; only the tensor arguments are kept. When the
//   backward reaches the output, the module's forward runs again (through hp::call, so its
//   hooks run: fully_shard gathers the parameters) with autograd on, and the gradients of
//   the arguments and of the module's parameters are computed from that recomputation.
//   Gradients are bitwise those of the run without recomputation (same ops, same order).
// - The module's parameters receive their gradients through their ordinary accumulators
//   in the backward that reached the output (their hooks, fully_shard's among them, fire
//   there), not in a backward of their own.
// - A hook on a parameter's gradient that must run once per backward is registered with
//   hp::on_gradient, not Tensor::register_hook: libtorch 2.x also runs a leaf's own hooks
//   when a gradient is computed for it without accumulating (autograd::grad naming it as an
//   input), which is how the recomputation computes the parameters' gradients. A summing
//   hook (tensor parallelism's) would then sum twice.
// - During the recomputation in_recompute() is true on the calling thread: a capability
//   keeps its per-forward bookkeeping (fully_shard's forward order, prefetch and reduction
//   scheduling) as the first forward left it, and a module with a side effect in forward
//   (the MoE's expert-load count) skips it.
// - Policy kFull recomputes everything. kKeepMatmuls keeps the outputs of the module's
//   torch::nn::Linear children (called through hp::call) from the first forward and does
//   not recompute those matmuls: their backward needs only the input and the weight, so
//   the recomputation gives them back the kept output in place of a new product.
// - Policy kLight (DeepSeek-V3's): as kKeepMatmuls, but the Linear calls a model marks with
//   hp::recomputed_here (MLA's up-projections) are recomputed, and the steps it writes with
//   hp::keep_step (attention) keep their results from the first forward: the recomputation
//   rebuilds their backward from those results instead of running them again. What is left
//   to recompute is cheap: the norms, the marked projections, elementwise activations.
// - Arguments must be tensors; the module's forward must return one tensor. The module's
//   forward must be deterministic (no dropout yet: "not supported yet" for modules in
//   training mode with dropout is left to the caller).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "hp/hooks/call.h"

namespace hp {

enum class RecomputePolicy {
  kFull,          // recompute every op of the module in backward
  kKeepMatmuls,   // keep the outputs of its Linear children, recompute the rest
  kLight,         // keep those but the marked ones, and the kept steps' results; recompute the rest
};

// True while a recomputed module's forward is being recomputed on this thread.
bool in_recompute();

// True where the forward running on this thread will be differentiated: under grad mode,
// or in a recomputed module's first forward (which runs without grad mode; its backward
// recomputes it). False in a forward without gradients (a validation pass), whose side
// effects a module may then skip.
bool in_differentiated_forward();

// Registers `fn` on the gradient of `leaf` (a tensor that requires grad and has no grad_fn,
// a parameter), to run once per backward, when the gradient reaches the leaf's accumulator
// (fully_shard's and recompute's backwards included), as Tensor::register_hook does on
// libtorch 1.x. Returns the hook's handle, as register_hook does.
unsigned on_gradient(const at::Tensor& leaf, std::function<at::Tensor(const at::Tensor&)> fn);

// A costly step of a module's forward whose results its backward can use as they are
// (attention's output and log-sum-exp). run() computes it as usual, with autograd, and
// returns its output first, then whatever replay needs. replay(kept) returns the same
// output from run()'s results, with a backward and without computing it again. Under
// RecomputePolicy::kLight the first forward keeps run()'s results and the recomputation
// calls replay(kept) in its place; everywhere else, run()'s output. The step must be
// reached as often, in the same order, in both forwards.
at::Tensor keep_step(const std::function<std::vector<at::Tensor>()>& run,
                     const std::function<at::Tensor(const std::vector<at::Tensor>&)>& replay);

// fn() with the Linear calls inside it recomputed under RecomputePolicy::kLight (not kept:
// MLA's up-projections, whose outputs are much wider than their inputs); fn() as it is
// everywhere else.
template <typename F>
decltype(auto) recomputed_here(F&& fn) {
  detail::ForwardOverride* o = detail::forward_override();
  if (o == nullptr) return fn();
  struct Region {
    detail::ForwardOverride* o;
    ~Region() { o->enter_recomputed_region(-1); }
  } region{o};
  o->enter_recomputed_region(1);
  return fn();
}

namespace detail {

using RecomputeFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
at::Tensor recompute_impl(torch::nn::Module& m, RecomputeFn fn, const std::vector<at::Tensor>& args,
                           RecomputePolicy policy);

template <typename M, size_t... I>
at::Tensor call_with(M& m, const std::vector<at::Tensor>& a, std::index_sequence<I...>) {
  return hp::call(m, a[I]...);
}

}  // namespace detail

// hp::call(m, xs...) with the activations inside m recomputed in backward as `policy`
// says. M is a ModuleHolder or a shared_ptr to a module, as for hp::call.
template <typename M, typename... T>
at::Tensor recompute_with(RecomputePolicy policy, M& m, const T&... xs) {
  static_assert((std::is_same_v<std::decay_t<T>, at::Tensor> && ...), "hp::recompute takes tensor arguments");
  M holder = m;  // the recomputation may run after the caller's handle is gone
  detail::RecomputeFn fn = [holder](const std::vector<at::Tensor>& a) mutable {
    return detail::call_with(holder, a, std::index_sequence_for<T...>{});
  };
  return detail::recompute_impl(*m.get(), std::move(fn), {xs...}, policy);
}

// hp::call(m, xs...) with every activation inside m recomputed in backward.
template <typename M, typename... T>
at::Tensor recompute(M& m, const T&... xs) {
  return recompute_with(RecomputePolicy::kFull, m, xs...);
}

}  // namespace hp
