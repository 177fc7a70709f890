// A communicator kept in an autograd context's saved_data (an IValue holds it as a
// capsule), for the backward of a differentiable collective.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>

#include <utility>

#include "hp/comm/communicator.h"

namespace hp::detail {

struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(CommPtr c) : group(std::move(c)) {}
  CommPtr group;
};

inline c10::IValue group_capsule(CommPtr g) {
  return c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(std::move(g)));
}

inline CommPtr group_of_capsule(const c10::IValue& v) {
  auto capsule = v.toCapsule();
  return static_cast<GroupCapsule*>(capsule.get())->group;
}

}  // namespace hp::detail
