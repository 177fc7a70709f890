#include "hf_json.h"

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

const char* hf_dtype_name(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : dtype == at::kDouble ? "float64" : "float32";
}

}  // namespace hp::models::detail
