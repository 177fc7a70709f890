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

std::mutex g_mu;
std::map<const torch::nn::Module*, std::vector<Entry>> g_hooks;
HookHandle g_next = 1;
thread_local std::vector<const torch::nn::Module*> t_in_call;

std::vector<ForwardHooks> hooks_of(const torch::nn::Module& m) {
  std::lock_guard<std::mutex> g(g_mu);
  std::vector<ForwardHooks> out;
  auto it = g_hooks.find(&m);
  if (it != g_hooks.end()) {
    for (const auto& e : it->second) out.push_back(e.hooks);
  }
  return out;
}

}  // namespace

HookHandle register_forward_hooks(torch::nn::Module& m, ForwardHooks hooks) {
  std::lock_guard<std::mutex> g(g_mu);
  HookHandle h = g_next++;
  g_hooks[&m].push_back(Entry{h, std::move(hooks)});
  return h;
}

void remove_forward_hooks(HookHandle h) {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto it = g_hooks.begin(); it != g_hooks.end(); ++it) {
    auto& v = it->second;
    for (auto e = v.begin(); e != v.end(); ++e) {
      if (e->handle == h) {
        v.erase(e);
        if (v.empty()) g_hooks.erase(it);
        return;
      }
    }
  }
}

bool has_forward_hooks(const torch::nn::Module& m) {
  std::lock_guard<std::mutex> g(g_mu);
  return g_hooks.count(&m) != 0;
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

namespace {
using Cast = std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)>;
// Applies one kind of cast of every hook of m, in registration order.
at::Tensor apply_casts(torch::nn::Module& m, const at::Tensor& t, Cast ForwardHooks::*which) {
  at::Tensor x = t;
  for (const auto& h : hooks_of(m)) {
    if (h.*which) x = (h.*which)(m, x);
  }
  return x;
}
}  // namespace

at::Tensor CallScope::cast_input(const at::Tensor& t) const {
  return has_casts_in_ ? apply_casts(m_, t, &ForwardHooks::cast_input) : t;
}

at::Tensor CallScope::cast_output(const at::Tensor& t) const {
  return has_casts_out_ ? apply_casts(m_, t, &ForwardHooks::cast_output) : t;
}

void CallScope::finish() {
  for (const auto& h : hooks_of(m_)) {
    if (h.post) h.post(m_);
  }
}

}  // namespace detail
}  // namespace hp
