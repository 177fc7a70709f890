// The config's keys: how a value as written becomes a field of TrainConfig and back.
// Private to src/train/config*.cpp.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

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

// Parsers of a value as written, each raising through Value::fail naming the key and what
// was expected, and the writers of a value as text that the parser reads back
// (config_values.cpp).
int64_t as_int(const Value& v, int64_t min = INT64_MIN, int64_t max = INT64_MAX);
// "[2, 1, 1]" or "2,1,1" (empty: none), each entry an integer in [min, max].
std::vector<int64_t> as_int_list(const Value& v, int64_t min, int64_t max);
double as_double(const Value& v);  // finite
bool as_bool(const Value& v);      // true/false, yes/no, on/off, 1/0
at::ScalarType as_dtype(const Value& v);  // float32, bfloat16 or float16 (and short names)
// "[layers_*.attn.wq.weight, output.weight]" or "a,b" (empty: none): parameter-name patterns
// of letters, digits, '_', '.' and '*'.
std::vector<std::string> as_pattern_list(const Value& v);
std::string dtype_text(at::ScalarType t);
std::string double_text(double x);  // the shortest text that reads back as exactly x
std::string bool_text(bool b);
std::string list_text(const std::vector<int64_t>& l);
std::string list_text(const std::vector<std::string>& l);

template <typename E>
std::string choices_of() {
  std::string all;
  for (const auto& [e, name] : enum_names<E>()) all += (all.empty() ? "" : ", ") + std::string(name);
  return all;
}

template <typename E>
E as_enum(const Value& v) {
  for (const auto& [e, name] : enum_names<E>()) {
    if (v.text == name) return e;
  }
  v.fail("expected one of: ", choices_of<E>());
}

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
