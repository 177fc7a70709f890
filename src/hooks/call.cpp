#include "hp/hooks/call.h"

#include <mutex>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/weak_key_map.h"

namespace hp {
namespace {

struct Entry {
  HookHandle handle;
  ForwardHooks hooks;
};
using Entries = std::vector<Entry>;

// The module a slot of hooks belongs to: a module not held by a shared_ptr has no weak
// reference and never expires (no liveness check).
struct ModuleRef {
  std::weak_ptr<torch::nn::Module> module;
  bool owned = false;
  bool expired() const { return owned && module.expired(); }
};

// Hooks by module address; a dead module's hooks are never found (hp/core/weak_key_map.h),
// so a new module at a reused address never inherits stale hooks.
std::mutex g_mu;
WeakKeyMap<torch::nn::Module, ModuleRef, Entries> g_hooks;
HookHandle g_next = 1;
std::vector<ErrorTranslator> g_translators;
thread_local std::vector<const torch::nn::Module*> t_in_call;
thread_local detail::ForwardOverride* t_forward_override = nullptr;
thread_local detail::WeightOutputObserver t_weight_output_observer = nullptr;

std::vector<ForwardHooks> hooks_of(const torch::nn::Module& m) {
  std::vector<Entries> graveyard;  // destroyed after the lock is released
  std::vector<ForwardHooks> out;
  std::lock_guard<std::mutex> g(g_mu);
  if (auto* slot = g_hooks.find(&m, &graveyard)) {
    for (const auto& e : slot->value) out.push_back(e.hooks);
  }
  return out;
}

}  // namespace

HookHandle register_forward_hooks(torch::nn::Module& m, ForwardHooks hooks) {
  std::vector<Entries> graveyard;
  ModuleRef owner;
  try {
    owner.module = m.shared_from_this();
    owner.owned = true;
  } catch (const std::bad_weak_ptr&) {
  }
  std::lock_guard<std::mutex> g(g_mu);
  // Drop the hooks of every module that died since: what they hold (fully_shard's state,
  // with its parameter shards) is freed now, not when the address happens to be reused.
  g_hooks.prune(&graveyard);
  auto* slot = g_hooks.find(&m, &graveyard);
  if (slot == nullptr) slot = &g_hooks.assign(&m, std::move(owner), Entries{}, &graveyard);
  HookHandle h = g_next++;
  slot->value.push_back(Entry{h, std::move(hooks)});
  return h;
}

void remove_forward_hooks(HookHandle h) {
  std::vector<Entries> graveyard;
  std::lock_guard<std::mutex> g(g_mu);
  bool found = false;
  g_hooks.erase_if(
      [&](const torch::nn::Module*, auto& slot) {
        if (found) return false;
        auto& v = slot.value;
        for (auto e = v.begin(); e != v.end(); ++e) {
          if (e->handle == h) {
            found = true;
            graveyard.push_back(Entries{});
            graveyard.back().push_back(std::move(*e));
            v.erase(e);
            return v.empty();
          }
        }
        return false;
      },
      &graveyard);
}

void register_error_translator(ErrorTranslator t) {
  std::lock_guard<std::mutex> g(g_mu);
  g_translators.push_back(std::move(t));
}

void purge_expired_forward_hooks() {
  std::vector<Entries> graveyard;
  std::lock_guard<std::mutex> g(g_mu);
  g_hooks.prune(&graveyard);
}

bool has_forward_hooks(const torch::nn::Module& m) {
  std::vector<Entries> graveyard;
  std::lock_guard<std::mutex> g(g_mu);
  return g_hooks.find(&m, &graveyard) != nullptr;
}

bool in_call(const torch::nn::Module& m) {
  for (const auto* p : t_in_call) {
    if (p == &m) return true;
  }
  return false;
}

std::string describe_module(const torch::nn::Module& m) {
  return detail::str_cat(m.name(), " at ", static_cast<const void*>(&m));
}

namespace detail {

namespace {
void unmark(const torch::nn::Module* m) {
  for (auto it = t_in_call.rbegin(); it != t_in_call.rend(); ++it) {
    if (*it == m) {
      t_in_call.erase(std::next(it).base());
      return;
    }
  }
}
}  // namespace

CallScope::CallScope(torch::nn::Module& m) : m_(m) {
  t_in_call.push_back(&m_);  // pre hooks already run inside the call
  try {
    for (const auto& h : hooks_of(m_)) {
      if (h.pre) h.pre(m_);
      has_casts_in_ |= static_cast<bool>(h.cast_input);
      has_casts_out_ |= static_cast<bool>(h.cast_output);
    }
  } catch (...) {
    unmark(&m_);  // the destructor does not run when a constructor throws
    throw;
  }
}

// Unmarks even when forward or a hook threw.
CallScope::~CallScope() { unmark(&m_); }

// Each applies one kind of cast of every hook of m, in registration order.
at::Tensor CallScope::cast_input(const at::Tensor& t, size_t arg) const {
  if (!has_casts_in_) return t;
  at::Tensor x = t;
  for (const auto& h : hooks_of(m_)) {
    if (h.cast_input) x = h.cast_input(m_, x, arg);
  }
  return x;
}

at::Tensor CallScope::cast_output(const at::Tensor& t) const {
  if (!has_casts_out_) return t;
  at::Tensor x = t;
  for (const auto& h : hooks_of(m_)) {
    if (h.cast_output) x = h.cast_output(m_, x);
  }
  return x;
}

void CallScope::fail(const std::exception& e) {
  for (const auto& h : hooks_of(m_)) {
    if (h.on_error) h.on_error(m_, e);
  }
  std::vector<ErrorTranslator> ts;
  {
    std::lock_guard<std::mutex> g(g_mu);
    ts = g_translators;
  }
  for (const auto& t : ts) t(m_, e);
}

void CallScope::finish() {
  for (const auto& h : hooks_of(m_)) {
    if (h.post) h.post(m_);
  }
}

}  // namespace detail
namespace detail {
ForwardOverride* forward_override() { return t_forward_override; }
ForwardOverride* set_forward_override(ForwardOverride* o) {
  ForwardOverride* prev = t_forward_override;
  t_forward_override = o;
  return prev;
}
WeightOutputObserver set_weight_output_observer(WeightOutputObserver o) {
  WeightOutputObserver prev = t_weight_output_observer;
  t_weight_output_observer = o;
  return prev;
}
}  // namespace detail

void mark_weight_output(const at::Tensor& output, std::vector<at::Tensor> params) {
  if (t_weight_output_observer != nullptr) t_weight_output_observer(output, std::move(params));
}

}  // namespace hp
