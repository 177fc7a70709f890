#include "hp/core/pattern.h"

namespace hp {

bool wildcard_match(const std::string& pattern, const std::string& name, bool star_crosses_dot) {
  // Backtracking over the last '*' seen.
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string::npos && (star_crosses_dot || name[mark] != '.')) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace hp
