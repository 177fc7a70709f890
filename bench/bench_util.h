// Helpers shared by the bench programs.
#pragma once

#include <algorithm>
#include <vector>

namespace hp::bench {

// The middle value (upper middle for an even count) of a non-empty sample.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace hp::bench
