// The call boundary: hp::call(module, args...), the C++ counterpart of Python's
// Module.__call__. libtorch's C++ modules have no forward hooks, so every capability that
// must act around a module's forward (fully_shard's unshard/reshard, input and output
// casts, tensor parallelism's layer styles, activation recomputation) registers hooks here, and
// models call their children through hp::call. Nothing else patches modules.
//
// Contract
// - Hooks are registered per module object (not per class) and run in registration order:
//   every `pre` before forward, then every `cast_input` on each at::Tensor argument (with
//   the argument's position, so a hook can treat arguments differently), then forward,
//   then every `cast_output` on an at::Tensor result, then every `post`.
// - A module without hooks is simply forwarded: built-in leaf modules work unmodified.
// - in_call(m) tells whether m's forward is running inside hp::call on this thread; a
//   capability that needs its hooks checks it to raise a clear error naming the module when
//   someone calls m->forward directly.
// - Thread-safe registration; hooks run on the calling thread.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace hp {

struct ForwardHooks {
  std::function<void(torch::nn::Module&)> pre;
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor&, size_t arg)> cast_input;
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)> cast_output;
  std::function<void(torch::nn::Module&)> post;
  // Runs when forward (or a hook) throws inside the call; may throw a clearer error in
  // place of the original (for example fully_shard naming a child that bypassed hp::call).
  std::function<void(torch::nn::Module&, const std::exception&)> on_error;
};

using HookHandle = uint64_t;

HookHandle register_forward_hooks(torch::nn::Module& m, ForwardHooks hooks);
// Removes hooks by handle; unknown handles are ignored.
void remove_forward_hooks(HookHandle h);
bool has_forward_hooks(const torch::nn::Module& m);
// A translator sees every exception thrown inside any hp::call, with the module being
// called, and may throw a clearer error instead (fully_shard names a sharded module whose
// parameters were used while not gathered). Translators run innermost call first.
using ErrorTranslator = std::function<void(torch::nn::Module&, const std::exception&)>;
void register_error_translator(ErrorTranslator t);

// Drops the hooks of modules that no longer exist (and what the hooks hold). Done lazily
// on lookup too; capabilities call it before they inspect their own registries.
void purge_expired_forward_hooks();
bool in_call(const torch::nn::Module& m);
// "Block(name)" style description used in errors.
std::string describe_module(const torch::nn::Module& m);

// A model that uses parameters outside their module's call (a tied output head multiplying
// by the embedding's weight) reports the result here: `output` is computed from `params`.
// Whatever watches module outputs on this thread (the pipeline's split backward, which runs
// the weights' gradients back from them) hears it through its observer; with none
// installed it does nothing.
void mark_weight_output(const at::Tensor& output, std::vector<at::Tensor> params);

namespace detail {

// Runs the pre hooks and marks the module as in a call until destroyed; runs the post
// hooks on success (finish), and unmarks on exceptions too.
class CallScope {
 public:
  explicit CallScope(torch::nn::Module& m);
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  at::Tensor cast_input(const at::Tensor& t, size_t arg) const;
  at::Tensor cast_output(const at::Tensor& t) const;
  void finish();
  // Gives on_error hooks the chance to replace the exception being propagated.
  void fail(const std::exception& e);

 private:
  torch::nn::Module& m_;
  bool has_casts_in_ = false;
  bool has_casts_out_ = false;
};

// A stand-in for the forward of modules called with one tensor argument, installed on the
// calling thread for a while (recomputation keeps or replays matmul outputs
// through it). `real` runs the module's own forward; hooks run around it as usual.
class ForwardOverride {
 public:
  virtual ~ForwardOverride() = default;
  virtual at::Tensor forward(torch::nn::Module& m, const at::Tensor& x,
                             const std::function<at::Tensor(const at::Tensor&)>& real) = 0;
  // hp::keep_step and hp::recomputed_here (hooks/recompute.h) under this override: by
  // default the step simply runs and the region changes nothing.
  virtual at::Tensor step(const std::function<std::vector<at::Tensor>()>& run,
                          const std::function<at::Tensor(const std::vector<at::Tensor>&)>& replay) {
    return run().at(0);
  }
  virtual void enter_recomputed_region(int delta) {}
};
// The override installed on this thread, or null; set_forward_override returns the
// previous one (restore it when done).
ForwardOverride* forward_override();
ForwardOverride* set_forward_override(ForwardOverride* o);

// mark_weight_output's observer on this thread (null: none); returns the previous one
// (restore it when done).
using WeightOutputObserver = void (*)(const at::Tensor& output, std::vector<at::Tensor> params);
WeightOutputObserver set_weight_output_observer(WeightOutputObserver o);

template <typename A>
decltype(auto) maybe_cast_input(const CallScope& s, size_t arg, A&& a) {
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
    return s.cast_input(a, arg);
  } else {
    return std::forward<A>(a);
  }
}

template <typename M, size_t... I, typename... Args>
auto call_indexed(M& m, std::index_sequence<I...>, Args&&... args) {
  torch::nn::Module& mod = *m.get();
  detail::CallScope scope(mod);
  try {
    if constexpr (sizeof...(Args) == 1 && (std::is_same_v<std::decay_t<Args>, at::Tensor> && ...) &&
                  std::is_same_v<decltype(m->forward(std::forward<Args>(args)...)), at::Tensor>) {
      if (detail::ForwardOverride* o = detail::forward_override()) {
        at::Tensor x = scope.cast_input(args..., 0);
        at::Tensor out = o->forward(mod, x, [&m](const at::Tensor& in) { return m->forward(in); });
        out = scope.cast_output(out);
        scope.finish();
        return out;
      }
    }
    auto out = m->forward(detail::maybe_cast_input(scope, I, std::forward<Args>(args))...);
    if constexpr (std::is_same_v<decltype(out), at::Tensor>) out = scope.cast_output(out);
    scope.finish();
    return out;
  } catch (const std::exception& e) {
    scope.fail(e);
    throw;
  }
}

}  // namespace detail

// Calls m->forward(args...) with m's hooks around it. M is a ModuleHolder
// (torch::nn::Linear) or a std::shared_ptr to a module.
template <typename M, typename... Args>
auto call(M& m, Args&&... args) {
  return detail::call_indexed(m, std::index_sequence_for<Args...>{}, std::forward<Args>(args)...);
}

}  // namespace hp
