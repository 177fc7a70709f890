#include "hf_json.h"

#include <cmath>

#include "hp/core/untrusted.h"


namespace hp::models::detail {

HfJson::HfJson(const std::string& text, std::string path) : path_(std::move(path)) {
  hp::text::check_json_nesting(text, "'" + path_ + "'");
  try {
    j_ = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    HP_CHECK(false, "'", path_, "' is not valid JSON: ", e.what());
  }
  HP_CHECK(j_.is_object(), "'", path_, "' is not a JSON object");
}

HfJson::HfJson(nlohmann::json object, std::string path) : j_(std::move(object)), path_(std::move(path)) {
  HP_CHECK(j_.is_object(), "'", path_, "' is not a JSON object");
}

bool HfJson::has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

int64_t HfJson::integer(const char* key, c10::optional<int64_t> fallback) const {
  if (!has(key) && fallback) return *fallback;
  HP_CHECK(has(key) && j_[key].is_number_integer(), "'", path_, "': ", key,
           has(key) ? " is not an integer (" + j_[key].dump() + ")" : std::string(" is missing"));
  return j_[key].get<int64_t>();
}

double HfJson::real(const char* key, c10::optional<double> fallback) const {
  if (!has(key) && fallback) return *fallback;
  HP_CHECK(has(key) && j_[key].is_number(), "'", path_, "': ", key,
           has(key) ? " is not a number (" + j_[key].dump() + ")" : std::string(" is missing"));
  return j_[key].get<double>();
}

bool HfJson::boolean(const char* key, bool fallback) const {
  if (!has(key)) return fallback;
  HP_CHECK(j_[key].is_boolean(), "'", path_, "': ", key, " is not true or false (", j_[key].dump(), ")");
  return j_[key].get<bool>();
}

void HfJson::require(const char* key, const nlohmann::json& allowed, const char* why) const {
  HP_CHECK(!has(key) || j_[key] == allowed, "'", path_, "': ", key, " ", j_.value(key, nlohmann::json()).dump(),
           " is not supported yet (", why, ")");
}

void HfJson::require_absent(const char* key, const char* why) const {
  HP_CHECK(!has(key), "'", path_, "': ", key, " ", j_.value(key, nlohmann::json()).dump(),
           " is not supported yet (", why, ")");
}

void read_rope(const HfJson& j, RopeOptions& rope, int64_t max_position_embeddings) {
  const char* key = j.has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (!j.has(key)) return;
  const HfJson r(j.json()[key], j.path() + " " + key);
  if (r.has("rope_theta")) rope.theta = r.real("rope_theta");
  const char* type_key = r.has("rope_type") ? "rope_type" : "type";
  const std::string type =
      r.has(type_key) && r.json()[type_key].is_string() ? r.json()[type_key].get<std::string>() : "default";
  if (type == "default") return;
  HP_CHECK(type == "linear" || type == "llama3" || type == "yarn", "'", j.path(), "': ", key, " ",
           j.json()[key].dump(), " is not supported yet (rope types: default, linear, llama3, yarn)");
  if (type == "linear") {
    rope.scaling = RopeScaling::kLinear;
    rope.factor = r.real("factor");
  } else if (type == "llama3") {
    rope.scaling = RopeScaling::kLlama3;
    rope.factor = r.real("factor");
    rope.low_freq_factor = r.real("low_freq_factor");
    rope.high_freq_factor = r.real("high_freq_factor");
    rope.original_max_seq = r.integer("original_max_position_embeddings");
  } else {
    HP_CHECK(!r.has("attention_factor"), "'", j.path(), "': ", key, " attention_factor ",
             r.json()["attention_factor"].dump(), " is not supported yet (yarn's factor from mscale and mscale_all_dim)");
    HP_CHECK(r.boolean("truncate", true), "'", j.path(), "': ", key,
             " truncate false is not supported yet (yarn's correction range rounded outwards)");
    rope.scaling = RopeScaling::kYarn;
    rope.original_max_seq = r.integer("original_max_position_embeddings", max_position_embeddings);
    HP_CHECK(rope.original_max_seq > 0, "'", j.path(), "': ", key, " original_max_position_embeddings ",
             rope.original_max_seq, " must be > 0");
    rope.factor = r.real("factor", static_cast<double>(max_position_embeddings) / static_cast<double>(rope.original_max_seq));
    // transformers takes a beta of 0 (or null) as its default, as here.
    rope.beta_fast = r.real("beta_fast", 32.0);
    rope.beta_slow = r.real("beta_slow", 1.0);
    if (rope.beta_fast == 0) rope.beta_fast = 32.0;
    if (rope.beta_slow == 0) rope.beta_slow = 1.0;
    rope.mscale = r.real("mscale", 0.0);
    rope.mscale_all_dim = r.real("mscale_all_dim", 0.0);
  }
  HP_CHECK(rope.factor > 0 && std::isfinite(rope.factor), "'", j.path(), "': ", key, " factor ", rope.factor,
           " must be a finite number > 0");
}

nlohmann::json rope_hf_json(const RopeOptions& rope) {
  switch (rope.scaling) {
    case RopeScaling::kNone:
      return nullptr;
    case RopeScaling::kLinear:
      return {{"rope_type", "linear"}, {"factor", rope.factor}};
    case RopeScaling::kLlama3:
      return {{"rope_type", "llama3"},
              {"factor", rope.factor},
              {"low_freq_factor", rope.low_freq_factor},
              {"high_freq_factor", rope.high_freq_factor},
              {"original_max_position_embeddings", rope.original_max_seq}};
    case RopeScaling::kYarn: {
      nlohmann::json j = {{"rope_type", "yarn"},
                          {"factor", rope.factor},
                          {"original_max_position_embeddings", rope.original_max_seq},
                          {"beta_fast", rope.beta_fast},
                          {"beta_slow", rope.beta_slow}};
      if (rope.mscale != 0) j["mscale"] = rope.mscale;
      if (rope.mscale_all_dim != 0) j["mscale_all_dim"] = rope.mscale_all_dim;
      return j;
    }
  }
  return nullptr;
}

void same_rope(const RopeOptions& ours, const RopeOptions& theirs, const std::string& path) {
  const auto type = [](const RopeOptions& r) {
    const nlohmann::json j = rope_hf_json(r);
    return j.is_null() ? std::string("none") : j["rope_type"].get<std::string>();
  };
  same_as_hf("rope_scaling", "rope_scaling's type", type(ours), type(theirs), path);
  if (theirs.scaling == RopeScaling::kNone) return;
  same_as_hf("rope_factor", "factor", ours.factor, theirs.factor, path);
  if (theirs.scaling == RopeScaling::kLlama3) {
    same_as_hf("rope_low_freq_factor", "low_freq_factor", ours.low_freq_factor, theirs.low_freq_factor, path);
    same_as_hf("rope_high_freq_factor", "high_freq_factor", ours.high_freq_factor, theirs.high_freq_factor, path);
  }
  if (theirs.scaling == RopeScaling::kLlama3 || theirs.scaling == RopeScaling::kYarn) {
    same_as_hf("rope_original_max_seq", "original_max_position_embeddings", ours.original_max_seq,
               theirs.original_max_seq, path);
  }
  if (theirs.scaling == RopeScaling::kYarn) {
    same_as_hf("rope_beta_fast", "beta_fast", ours.beta_fast, theirs.beta_fast, path);
    same_as_hf("rope_beta_slow", "beta_slow", ours.beta_slow, theirs.beta_slow, path);
    same_as_hf("rope_mscale", "mscale", ours.mscale, theirs.mscale, path);
    same_as_hf("rope_mscale_all_dim", "mscale_all_dim", ours.mscale_all_dim, theirs.mscale_all_dim, path);
  }
}

const char* hf_dtype_name(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : dtype == at::kDouble ? "float64" : "float32";
}

const HfNames::Pairs& HfNames::swiglu() {
  static const Pairs p = {{"w1.weight", "gate_proj.weight"}, {"w3.weight", "up_proj.weight"}, {"w2.weight", "down_proj.weight"}};
  return p;
}

void HfNames::block(int64_t i) {
  ours_ = "layers_" + std::to_string(i) + ".";
  theirs_ = "model.layers." + std::to_string(i) + ".";
}

void HfNames::under(std::string ours, std::string theirs) {
  ours_ = std::move(ours);
  theirs_ = std::move(theirs);
}

void HfNames::add(const std::string& ours, const std::string& theirs) { out_.emplace_back(ours_ + ours, theirs_ + theirs); }

void HfNames::add(const Pairs& pairs, const std::string& ours, const std::string& theirs) {
  for (const auto& [a, b] : pairs) add(ours + a, theirs + b);
}

void HfNames::experts(int64_t n, const Pairs& pairs, const std::string& ours, const std::string& theirs) {
  for (int64_t e = 0; e < n; ++e) {
    const std::string x = "experts." + std::to_string(e) + ".";
    add(pairs, ours + x, theirs + x);
  }
}

void HfNames::block_norms() {
  add("attn_norm.weight", "input_layernorm.weight");
  add("ffn_norm.weight", "post_attention_layernorm.weight");
}

HfNames::List HfNames::finish(bool head) {
  List out = std::move(out_);
  out.emplace_back("norm.weight", "model.norm.weight");
  if (head) out.emplace_back("output.weight", "lm_head.weight");
  return out;
}

}  // namespace hp::models::detail
