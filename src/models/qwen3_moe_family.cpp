// Qwen3-MoE (transformers' Qwen3MoeForCausalLM) behind the model-family seam: MoELlama with
// per-head query/key norms, softmax routing with or without norm_topk_prob, and a dense
// SwiGLU where decoder_sparse_step says a block is not sparse.
#include "moe_llama_args.h"

namespace hp::models {

namespace {

class Qwen3MoeFamily : public ModelFamily {
 public:
  std::string name() const override { return "qwen3_moe"; }
  std::vector<std::string> presets() const override { return {"tiny", "qwen3_30b_a3b", "qwen3_235b_a22b"}; }
  std::unique_ptr<ModelArgs> preset(const std::string& name) const override {
    MoELlamaConfig c;
    if (name == "tiny") {
      c = MoELlamaConfig::qwen3_moe_tiny();
    } else if (name == "qwen3_30b_a3b") {
      c = MoELlamaConfig::qwen3_30b_a3b();
    } else {
      HP_CHECK(name == "qwen3_235b_a22b", "model preset '", name,
               "' is not one of qwen3_moe's: tiny, qwen3_30b_a3b, qwen3_235b_a22b");
      c = MoELlamaConfig::qwen3_235b_a22b();
    }
    return std::make_unique<detail::MoELlamaArgs>(*this, c);
  }
  std::vector<std::string> hf_model_types() const override { return {"qwen3_moe"}; }
  std::unique_ptr<ModelArgs> from_hf_config(const std::string& text, const std::string& path) const override {
    return std::make_unique<detail::MoELlamaArgs>(*this, moe_llama_config_from_hf(MoEFlavor::kQwen3Moe, text, path));
  }
  const std::vector<ModelKey>& keys() const override {
    using C = MoELlamaConfig;
    static const std::vector<ModelKey> k = detail::moe_llama_keys({
        bool_key<C>("norm_topk", &C::norm_topk, "the chosen experts' weights normalized to sum 1 (norm_topk_prob)"),
        int_key<C>("sparse_step", &C::sparse_step, 1,
                   "every sparse_step-th block has the MoE, the others a dense SwiGLU (decoder_sparse_step)"),
        int_key<C>("dense_hidden", &C::dense_hidden, 1, "the dense blocks' SwiGLU hidden size (intermediate_size)"),
        bool_key<C>("attention_bias", &C::attention_bias, "biases on the query, key, value and output projections"),
    });
    return k;
  }
};

}  // namespace

std::shared_ptr<const ModelFamily> qwen3_moe_family() {
  static const auto f = std::make_shared<Qwen3MoeFamily>();
  return f;
}

}  // namespace hp::models
