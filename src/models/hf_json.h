// Reading and writing a Hugging Face config.json: what every family's interchange shares.
// The file is untrusted input: every value is checked for its type, and each error names
// the file, the key and the value found.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <nlohmann/json.hpp>

#include <string>

#include "hp/core/error.h"
#include "hp/models/llama.h"

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

// The rotary scaling of a config.json: rope_scaling (transformers 4) or rope_parameters
// (transformers 5, with rope_theta inside), its type under rope_type or type: default,
// linear, llama3 or yarn (as transformers reads yarn: factor, else max_position_embeddings
// / original_max_position_embeddings; beta_fast 32 and beta_slow 1 where absent; mscale and
// mscale_all_dim; attention_factor given explicitly and truncate false are not supported
// yet); anything else refused by name. Sets `rope`'s fields it speaks of.
void read_rope(const HfJson& j, RopeOptions& rope, int64_t max_position_embeddings);
// config.json's rope_scaling of `rope` (null without scaling).
nlohmann::json rope_hf_json(const RopeOptions& rope);
// Raises naming both keys where the scalings differ (their type, and the values it uses).
void same_rope(const RopeOptions& ours, const RopeOptions& theirs, const std::string& path);

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
