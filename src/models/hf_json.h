// Reading and writing a Hugging Face config.json: what every family's interchange shares.
// The file is untrusted input: every value is checked for its type, and each error names
// the file, the key and the value found.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <nlohmann/json.hpp>
#include <string>

#include "hp/core/error.h"

namespace hp::models::detail {

class HfJson {
 public:
  // Raises unless `text` is a JSON object.
  HfJson(const std::string& text, std::string path);
  // A nested object of a file already read (`path` names it, e.g. "config.json rope_scaling").
  HfJson(nlohmann::json object, std::string path);
  const std::string& path() const { return path_; }
  const nlohmann::json& json() const { return j_; }
  // Present and not null.
  bool has(const char* key) const;
  // The value of `key`, `fallback` where it is absent or null (required where no fallback).
  int64_t integer(const char* key, c10::optional<int64_t> fallback = c10::nullopt) const;
  double real(const char* key, c10::optional<double> fallback = c10::nullopt) const;
  bool boolean(const char* key, bool fallback) const;
  // Raises "<key> <value> is not supported yet (<why>)" where `key` is present, not null and
  // not `allowed`.
  void require(const char* key, const nlohmann::json& allowed, const char* why) const;
  // As require(), for a key that must be absent or null.
  void require_absent(const char* key, const char* why) const;

 private:
  nlohmann::json j_;
  std::string path_;
};

// config.json's name of a weight dtype.
const char* hf_dtype_name(at::ScalarType dtype);

// Raises naming both keys and the file where the model's value `ours` differs from the
// file's `theirs`.
template <typename T>
void same_as_hf(const char* our_key, const char* their_key, const T& ours, const T& theirs, const std::string& path) {
  HP_CHECK(ours == theirs, "model.", our_key, "=", ours, " but ", their_key, "=", theirs, " in '", path,
           "' (the model must match it)");
}

}  // namespace hp::models::detail
