// Test support: what a model keeps for backward under light recompute.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "hp/core/memory.h"
#include "hp/hooks/recompute.h"

namespace hp::test {

// Bytes the forward of a float64 Model built from `c` with `layers` blocks leaves allocated
// under RecomputePolicy::kLight (what it keeps for backward, its output among them), on
// the counting allocator (installed by the caller).
template <typename Model, typename Config>
int64_t light_bytes_held(Config c, int64_t layers, const at::Tensor& tokens) {
  c.layers = layers;
  Model m(c);
  m->init_weights(3);
  m->to(at::kDouble);
  m->recompute = hp::RecomputePolicy::kLight;
  const int64_t before = hp::memory::current_bytes();
  at::Tensor out = m->forward(tokens);
  return hp::memory::current_bytes() - before;
}

}  // namespace hp::test
