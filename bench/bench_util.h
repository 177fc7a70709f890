// Helpers shared by the bench programs.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <vector>

namespace hp::bench {

// The middle value (upper middle for an even count) of a non-empty sample.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// An integer environment knob of a bench program (`fallback` when unset or empty).
inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

}  // namespace hp::bench
