// Mixtral (transformers' MixtralForCausalLM) behind the model-family seam: MoELlama with a
// MoE in every block, each token's two (experts_per_token) experts weighted by their softmax
// scores normalized to sum 1.
#include "moe_llama_args.h"

namespace hp::models {

namespace {

class MixtralFamily : public ModelFamily {
 public:
  std::string name() const override { return "mixtral"; }
  std::vector<std::string> presets() const override { return {"tiny", "mixtral_8x7b"}; }
  std::unique_ptr<ModelArgs> preset(const std::string& name) const override {
    if (name == "tiny") return std::make_unique<detail::MoELlamaArgs>(*this, MoELlamaConfig::mixtral_tiny());
    HP_CHECK(name == "mixtral_8x7b", "model preset '", name, "' is not one of mixtral's: tiny, mixtral_8x7b");
    return std::make_unique<detail::MoELlamaArgs>(*this, MoELlamaConfig::mixtral_8x7b());
  }
  std::vector<std::string> hf_model_types() const override { return {"mixtral"}; }
  std::unique_ptr<ModelArgs> from_hf_config(const std::string& text, const std::string& path) const override {
    return std::make_unique<detail::MoELlamaArgs>(*this, moe_llama_config_from_hf(MoEFlavor::kMixtral, text, path));
  }
  const std::vector<ModelKey>& keys() const override {
    static const std::vector<ModelKey> k = detail::moe_llama_keys({});
    return k;
  }
};

}  // namespace

std::shared_ptr<const ModelFamily> mixtral_family() {
  static const auto f = std::make_shared<MixtralFamily>();
  return f;
}

}  // namespace hp::models
