// FNV-1a, the one hash of the project: parameter names to initialization seeds (the same on
// every machine and rank), tensor names to the checkpoint writer of a box, group member
// lists to communicator slots, config texts compared across ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace hp {

constexpr uint64_t kFnvOffset = 1469598103934665603ULL;
constexpr uint64_t kFnvPrime = 1099511628211ULL;

// Folds one value into `h` as FNV-1a folds a byte (a byte value gives FNV-1a itself).
constexpr uint64_t fnv1a_step(uint64_t h, uint64_t value) { return (h ^ value) * kFnvPrime; }

// FNV-1a 64 of the bytes of `s`, continuing from `h`.
constexpr uint64_t fnv1a(std::string_view s, uint64_t h = kFnvOffset) {
  for (unsigned char c : s) h = fnv1a_step(h, c);
  return h;
}

}  // namespace hp
