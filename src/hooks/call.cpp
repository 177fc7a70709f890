#include "hp/hooks/call.h"

#include <map>
#include <mutex>
#include <vector>

#include "hp/core/error.h"

namespace hp {
namespace {

struct Entry {
  HookHandle handle;
  ForwardHooks hooks;
};

// Hooks are keyed by the module's address; the weak owner tells a live module from a
// dead one whose address was reused, so a new module never inherits stale hooks.
struct Slot {
  std::weak_ptr<torch::nn::Module> owner;
  bool owned = false;  // false: the module is not held by a shared_ptr (no liveness check)
  std::vector<Entry> entries;
  bool expired() const { return owned && owner.expired(); }
};

std::mutex g_mu;
std::map<const torch::nn::Module*, Slot> g_hooks;
HookHandle g_next = 1;
std::vector<ErrorTranslator> g_translators;
thread_local std::vector<const torch::nn::Module*> t_in_call;
thread_local detail::ForwardOverride* t_forward_override = nullptr;

// Call with g_mu held. Returns the live slot of m, dropping a stale one.
Slot* find_slot(const torch::nn::Module& m, std::vector<Entry>* graveyard) {
  auto it = g_hooks.find(&m);
  if (it == g_hooks.end()) return nullptr;
  if (it->second.expired()) {
    for (auto& e : it->second.entries) graveyard->push_back(std::move(e));
    g_hooks.erase(it);
    return nullptr;
  }
  return &it->second;
}

// Call with g_mu held: moves the hooks of every dead module to `graveyard`.
void drop_expired(std::vector<Entry>* graveyard) {
  for (auto it = g_hooks.begin(); it != g_hooks.end();) {
    if (it->second.expired()) {
      for (auto& e : it->second.entries) graveyard->push_back(std::move(e));
      it = g_hooks.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<ForwardHooks> hooks_of(const torch::nn::Module& m) {
  std::vector<Entry> graveyard;  // destroyed after the lock is released
  std::vector<ForwardHooks> out;
  std::lock_guard<std::mutex> g(g_mu);
  if (Slot* s = find_slot(m, &graveyard)) {
    for (const auto& e : s->entries) out.push_back(e.hooks);
  }
  return out;
}

}  // namespace

HookHandle register_forward_hooks(torch::nn::Module& m, ForwardHooks hooks) {
  std::vector<Entry> graveyard;
  std::weak_ptr<torch::nn::Module> owner;
  bool owned = false;
  try {
    owner = m.shared_from_this();
    owned = true;
  } catch (const std::bad_weak_ptr&) {
  }
  std::lock_guard<std::mutex> g(g_mu);
  // Drop the hooks of every module that died since: what they hold (fully_shard's state,
  // with its parameter shards) is freed now, not when the address happens to be reused.
  drop_expired(&graveyard);
  Slot* s = find_slot(m, &graveyard);
  if (s == nullptr) {
    s = &g_hooks[&m];
    s->owner = owner;
    s->owned = owned;
  }
  HookHandle h = g_next++;
  s->entries.push_back(Entry{h, std::move(hooks)});
  return h;
}

void remove_forward_hooks(HookHandle h) {
  std::vector<Entry> graveyard;
  std::lock_guard<std::mutex> g(g_mu);
  for (auto it = g_hooks.begin(); it != g_hooks.end(); ++it) {
    auto& v = it->second.entries;
    for (auto e = v.begin(); e != v.end(); ++e) {
      if (e->handle == h) {
        graveyard.push_back(std::move(*e));
        v.erase(e);
        if (v.empty()) g_hooks.erase(it);
        return;
      }
    }
  }
}

void register_error_translator(ErrorTranslator t) {
  std::lock_guard<std::mutex> g(g_mu);
  g_translators.push_back(std::move(t));
}

void purge_expired_forward_hooks() {
  std::vector<Entry> graveyard;
  std::lock_guard<std::mutex> g(g_mu);
  drop_expired(&graveyard);
}

bool has_forward_hooks(const torch::nn::Module& m) {
  std::vector<Entry> graveyard;
  std::lock_guard<std::mutex> g(g_mu);
  return find_slot(m, &graveyard) != nullptr;
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
}  // namespace detail

}  // namespace hp
