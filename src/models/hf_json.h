// Reading and writing a Hugging Face config.json: what every family's interchange shares.
// The file is untrusted input: every value is checked for its type, and each error names
// the file, the key and the value found.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <nlohmann/json.hpp>

#include <string>
#include <variant>
#include <vector>

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

// Our names beside the published ones of a decoder whose blocks are model.layers.N.*: the
// embedding first, then what each family adds per block, the final norm and head last.
class HfNames {
 public:
  using Pairs = std::vector<std::pair<const char*, const char*>>;
  using List = std::vector<std::pair<std::string, std::string>>;
  // The SwiGLU projections: w1 gate_proj, w3 up_proj, w2 down_proj.
  static const Pairs& swiglu();

  HfNames() : out_{{"tok_emb.weight", "model.embed_tokens.weight"}} {}
  // A list without the embedding's name, taken as it is (take): a module's beside a model's.
  struct Bare {};
  explicit HfNames(Bare) {}
  List take() { return std::move(out_); }
  // What follows is block i's: "layers_<i>." beside "model.layers.<i>.".
  void block(int64_t i);
  // What follows is under these prefixes (ours, theirs).
  void under(std::string ours, std::string theirs);
  // One name: ours and theirs within the block.
  void add(const std::string& ours, const std::string& theirs);
  // Each pair, `ours` and `theirs` before its two names.
  void add(const Pairs& pairs, const std::string& ours = "", const std::string& theirs = "");
  // `n` experts' projections: <ours>experts.<e>.<a> beside <theirs>experts.<e>.<b>.
  void experts(int64_t n, const Pairs& pairs, const std::string& ours, const std::string& theirs);
  // The block's two norms (attn_norm, ffn_norm).
  void block_norms();
  // The list, the final norm and (unless tied) the head appended.
  List finish(bool head = true);

 private:
  List out_;
  std::string ours_, theirs_;
};

// A size or setting both sides have: our key, config.json's key, the field, and the value
// transformers' config class assumes where the key is absent (none: required); whether the
// model must have the file's value (not the rotary table's length: a longer one than the
// file's is no conflict). A family's table of these is the one source its config.json is
// written, read and checked from.
template <typename Config>
struct HfField {
  const char* ours;
  const char* theirs;
  std::variant<int64_t Config::*, double Config::*, bool Config::*> field;
  c10::optional<double> fallback;
  bool must_match = true;
};

// What the model always is, written as such and required of a file that states it (where
// absent, transformers assumes the same): the key, the value, what it means.
struct HfFixed {
  const char* key;
  nlohmann::json value;
  const char* why;
};

// Writes every field's and fixed value into `j`.
template <typename Config>
void write_hf_fields(nlohmann::json& j, const std::vector<HfField<Config>>& fields, const std::vector<HfFixed>& fixed,
                     const Config& c) {
  for (const HfField<Config>& f : fields) std::visit([&](auto m) { j[f.theirs] = c.*m; }, f.field);
  for (const HfFixed& f : fixed) j[f.key] = f.value;
}

// Raises where the file states a fixed key with another value.
inline void require_hf_fixed(const HfJson& j, const std::vector<HfFixed>& fixed) {
  for (const HfFixed& f : fixed) j.require(f.key, f.value, f.why);
}

// Sets `f`'s field of `c` from the file's `key` (the field's own key where null).
template <typename Config>
void read_hf_field(const HfJson& j, const HfField<Config>& f, Config& c, const char* key = nullptr) {
  if (key == nullptr) key = f.theirs;
  if (auto* m = std::get_if<int64_t Config::*>(&f.field)) {
    c.*(*m) = j.integer(key, f.fallback ? c10::optional<int64_t>(static_cast<int64_t>(*f.fallback)) : c10::nullopt);
  } else if (auto* r = std::get_if<double Config::*>(&f.field)) {
    c.*(*r) = j.real(key, f.fallback);
  } else {
    HP_CHECK(f.fallback || j.has(key), "'", j.path(), "': ", key, " is missing");
    c.*std::get<bool Config::*>(f.field) = j.boolean(key, f.fallback.value_or(0) != 0);
  }
}

// same_as_hf for every field the model must match.
template <typename Config>
void same_as_hf_fields(const std::vector<HfField<Config>>& fields, const Config& ours, const Config& theirs,
                       const std::string& path) {
  for (const HfField<Config>& f : fields) {
    if (!f.must_match) continue;
    std::visit([&](auto m) { same_as_hf(f.ours, f.theirs, ours.*m, theirs.*m, path); }, f.field);
  }
}

}  // namespace hp::models::detail
