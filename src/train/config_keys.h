// The config's keys: how a value as written becomes a field of TrainConfig and back.
// Private to src/train/config*.cpp.
#pragma once

#include <sstream>
#include <string>

#include "hp/core/error.h"
#include "hp/train/config.h"

namespace hp::train::internal {

// One key's value as written, with where it came from.
struct Value {
  std::string key, text, origin;

  template <typename... A>
  [[noreturn]] void fail(const A&... what) const {
    std::ostringstream os;
    os << origin << ": " << key << "=" << text << ": ";
    (os << ... << what);
    throw Error(os.str());
  }
};

// The keys that choose the model (model.type, model.preset, model.from_hf), applied before
// the others, in that order: the family's fields then override what they chose.
bool is_model_first(const std::string& key);
void apply_model_first(TrainConfig& c, const std::vector<Value>& values);
// Raises for a key that neither the key table nor any model family declares, suggesting
// the nearest.
void check_known(const Value& v);
// Applies a known key to `c` (whose model family is already chosen); raises naming the key
// for a value that does not parse or a key of another family.
void apply(TrainConfig& c, const Value& v);

}  // namespace hp::train::internal
