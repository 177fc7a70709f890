// Name patterns with `*` wildcards, shared by the tensor-parallel plans (module names) and
// Muon's routing (parameter names).
#pragma once

#include <string>

namespace hp {

// Whether `pattern` matches the whole of `name`; `*` matches any run of characters, one
// that never crosses a '.' unless `star_crosses_dot`.
bool wildcard_match(const std::string& pattern, const std::string& name, bool star_crosses_dot);

}  // namespace hp
