#include "hp/mesh/parameter_spec.h"

#include <mutex>

#include "hp/core/weak_key_map.h"

namespace hp {

namespace {
std::mutex g_spec_mu;
WeakKeyMap<c10::TensorImpl, c10::weak_intrusive_ptr<c10::TensorImpl>, ShardSpec> g_specs;
}  // namespace

void set_parameter_spec(const at::Tensor& param, ShardSpec spec) {
  std::lock_guard<std::mutex> g(g_spec_mu);
  g_specs.prune();  // drop the entries of dead parameters
  g_specs.assign(param.unsafeGetTensorImpl(), c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()),
                 std::move(spec));
}

c10::optional<ShardSpec> parameter_spec(const at::Tensor& param) {
  std::lock_guard<std::mutex> g(g_spec_mu);
  auto* e = g_specs.find(param.unsafeGetTensorImpl());
  if (e == nullptr) return c10::nullopt;
  return e->value;
}

}  // namespace hp
