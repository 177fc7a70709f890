#include "hp/models/family.h"

#include <cmath>
#include <mutex>

#include "hf_json.h"

namespace hp::models {

void Model::expert_parallel(const CommPtr& ep, const ep::DispatchOptions& o) {
  throw Error("expert parallelism is not supported yet for this model family (it has no routed experts)");
}

void Model::context_parallel(std::shared_ptr<cp::ContextParallel> ctx) {
  HP_NOT_SUPPORTED("context parallelism for this model family (its attention does not take a cp::ContextParallel)");
}

namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<const ModelFamily>> families;
};

void add(Registry& r, std::shared_ptr<const ModelFamily> f) {
  HP_CHECK(f != nullptr, "register_model_family: a null family");
  const std::string name = f->name();
  HP_CHECK(!name.empty(), "register_model_family: a family without a name");
  for (const auto& g : r.families) {
    HP_CHECK(g->name() != name, "register_model_family: a family named '", name, "' is registered already");
  }
  r.families.push_back(std::move(f));
}

Registry& registry() {
  static Registry* r = [] {
    auto* out = new Registry;
    // The built-in families, one line each; the first is the default.
    add(*out, deepseek_family());
    add(*out, llama_family());
    add(*out, qwen3_moe_family());
    add(*out, mixtral_family());
    return out;
  }();
  return *r;
}

}  // namespace

const ModelFamily& model_family(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::string all;
  for (const auto& f : r.families) {
    if (f->name() == name) return *f;
    all += (all.empty() ? "" : ", ") + f->name();
  }
  throw Error(hp::detail::str_cat("no model family named '", name, "' (registered: ", all, ")"));
}

std::vector<const ModelFamily*> model_families() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<const ModelFamily*> out;
  for (const auto& f : r.families) out.push_back(f.get());
  return out;
}

void register_model_family(std::shared_ptr<const ModelFamily> family) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  add(r, std::move(family));
}

const ModelFamily& default_model_family() { return *model_families().front(); }

namespace {
[[noreturn]] void no_hf(const ModelArgs& a) {
  throw Error(hp::detail::str_cat("Hugging Face interchange is not supported yet for model family ", a.family().name()));
}
}  // namespace

std::vector<std::pair<std::string, std::string>> ModelArgs::hf_names() const { no_hf(*this); }
std::unique_ptr<ModelArgs> ModelFamily::from_hf_config(const std::string&, const std::string&) const {
  throw Error(hp::detail::str_cat("Hugging Face interchange is not supported yet for model family ", name()));
}
std::string ModelArgs::hf_config(at::ScalarType) const { no_hf(*this); }
void ModelArgs::check_hf_config(const std::string&, const std::string&) const { no_hf(*this); }
bool ModelArgs::hf_ignores(const std::string& theirs) const {
  const std::string rotary = ".rotary_emb.inv_freq";
  return theirs.size() >= rotary.size() && theirs.compare(theirs.size() - rotary.size(), rotary.size(), rotary) == 0;
}

void check_key_ranges(const ModelArgs& a, const std::string& where) {
  for (const ModelKey& k : a.family().keys()) {
    if (k.kind != ModelKey::Kind::kInt && k.kind != ModelKey::Kind::kFloat) continue;
    const ModelValue v = k.get(a);
    const double x = k.kind == ModelKey::Kind::kInt ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
    const bool ok = std::isfinite(x) && (k.above_min ? x > k.min : x >= k.min);
    HP_CHECK(ok, where, ": model.", k.name, "=", x, " must be ", k.above_min ? "> " : ">= ", k.min,
             k.kind == ModelKey::Kind::kFloat ? " (and finite)" : "", " (", k.help, ")");
  }
}

std::unique_ptr<ModelArgs> model_from_hf_config(const std::string& text, const std::string& path) {
  const detail::HfJson j(text, path);
  HP_CHECK(j.has("model_type") && j.json()["model_type"].is_string(), "'", path,
           "': no model_type string (not a Hugging Face model's config.json)");
  const std::string type = j.json()["model_type"].get<std::string>();
  std::string known;
  for (const ModelFamily* f : model_families()) {
    for (const std::string& t : f->hf_model_types()) {
      if (t == type) {
        // The family read the values; each is held to its model.<key>'s range, as a config's are.
        std::unique_ptr<ModelArgs> args = f->from_hf_config(text, path);
        check_key_ranges(*args, "'" + path + "'");
        return args;
      }
      known += (known.empty() ? "" : ", ") + t;
    }
  }
  throw Error(hp::detail::str_cat("'", path, "': model_type '", type, "' is not supported yet (read: ", known, ")"));
}

}  // namespace hp::models
