#include "hp/fsdp/parameter_spec.h"

#include <map>
#include <mutex>

namespace hp {

namespace {
struct SpecEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> owner;
  ShardSpec spec;
};
std::mutex g_spec_mu;
std::map<const c10::TensorImpl*, SpecEntry> g_specs;
}  // namespace

void set_parameter_spec(const at::Tensor& param, ShardSpec spec) {
  std::lock_guard<std::mutex> g(g_spec_mu);
  for (auto it = g_specs.begin(); it != g_specs.end();) {  // drop entries of dead parameters
    it = it->second.owner.expired() ? g_specs.erase(it) : std::next(it);
  }
  // A weak reference keeps the TensorImpl's memory (not its data) from being reused while
  // the entry exists, so an address never names a different parameter.
  const c10::TensorImpl* key = param.unsafeGetTensorImpl();
  g_specs.erase(key);
  g_specs.emplace(key, SpecEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(spec)});
}

c10::optional<ShardSpec> parameter_spec(const at::Tensor& param) {
  std::lock_guard<std::mutex> g(g_spec_mu);
  auto it = g_specs.find(param.unsafeGetTensorImpl());
  if (it == g_specs.end() || it->second.owner.expired()) return c10::nullopt;
  return it->second.spec;
}

}  // namespace hp
