// Qwen3-MoE's and Mixtral's Hugging Face interchange: names and config.json.
#include <variant>

#include "hf_json.h"
#include "hp/ckpt/float8.h"
#include "hp/models/moe_llama.h"

namespace hp::models {

namespace {

bool mixtral(const MoELlamaConfig& c) { return c.flavor == MoEFlavor::kMixtral; }

}  // namespace

std::vector<std::pair<std::string, std::string>> hf_names(const MoELlamaConfig& c) {
  using Pairs = detail::HfNames::Pairs;
  static const Pairs attention = {{"attn.wq.weight", "self_attn.q_proj.weight"},
                                  {"attn.wk.weight", "self_attn.k_proj.weight"},
                                  {"attn.wv.weight", "self_attn.v_proj.weight"},
                                  {"attn.wo.weight", "self_attn.o_proj.weight"}};
  static const Pairs biases = {{"attn.wq.bias", "self_attn.q_proj.bias"},
                               {"attn.wk.bias", "self_attn.k_proj.bias"},
                               {"attn.wv.bias", "self_attn.v_proj.bias"},
                               {"attn.wo.bias", "self_attn.o_proj.bias"}};
  static const Pairs qk_norms = {{"attn.q_norm.weight", "self_attn.q_norm.weight"},
                                 {"attn.k_norm.weight", "self_attn.k_norm.weight"}};
  // Mixtral's experts keep their own names for the three (w1 gate, w2 down, w3 up).
  static const Pairs mixtral_expert = {{"w1.weight", "w1.weight"}, {"w2.weight", "w2.weight"}, {"w3.weight", "w3.weight"}};
  const std::string moe = mixtral(c) ? "block_sparse_moe." : "mlp.";
  detail::HfNames names;
  for (int64_t i = 0; i < c.layers; ++i) {
    names.block(i);
    names.add(attention);
    if (c.attention_bias) names.add(biases);
    if (c.qk_norm) names.add(qk_norms);
    if (c.is_moe(i)) {
      names.add("moe.gate.weight", moe + "gate.weight");
      names.experts(c.experts, mixtral(c) ? mixtral_expert : detail::HfNames::swiglu(), "moe.", moe);
    } else {
      names.add(detail::HfNames::swiglu(), "mlp.", "mlp.");
    }
    names.block_norms();
  }
  return names.finish();
}

namespace {

using Field = detail::HfField<MoELlamaConfig>;

// One table per flavor, from which config.json is written, read and checked.
const std::vector<Field>& fields(MoEFlavor flavor) {
  using C = MoELlamaConfig;
  static const std::vector<Field> qwen3 = {
      {"vocab", "vocab_size", &C::vocab, {}},
      {"dim", "hidden_size", &C::dim, {}},
      {"dense_hidden", "intermediate_size", &C::dense_hidden, {}},
      {"expert_hidden", "moe_intermediate_size", &C::expert_hidden, {}},
      {"layers", "num_hidden_layers", &C::layers, {}},
      {"heads", "num_attention_heads", &C::heads, {}},
      {"experts", "num_experts", &C::experts, {}},
      {"experts_per_token", "num_experts_per_tok", &C::experts_per_token, {}},
      {"sparse_step", "decoder_sparse_step", &C::sparse_step, 1},
      {"norm_topk", "norm_topk_prob", &C::norm_topk, 0},
      {"attention_bias", "attention_bias", &C::attention_bias, 0},
      {"max_seq", "max_position_embeddings", &C::max_seq, 32768, /*must_match=*/false},
      {"norm_eps", "rms_norm_eps", &C::norm_eps, 1e-6},
  };
  static const std::vector<Field> mixtral = {
      {"vocab", "vocab_size", &C::vocab, {}},
      {"dim", "hidden_size", &C::dim, {}},
      {"expert_hidden", "intermediate_size", &C::expert_hidden, {}},
      {"layers", "num_hidden_layers", &C::layers, {}},
      {"heads", "num_attention_heads", &C::heads, {}},
      {"experts", "num_local_experts", &C::experts, {}},
      {"experts_per_token", "num_experts_per_tok", &C::experts_per_token, {}},
      {"max_seq", "max_position_embeddings", &C::max_seq, 4096 * 32, /*must_match=*/false},
      {"norm_eps", "rms_norm_eps", &C::norm_eps, 1e-5},
  };
  return flavor == MoEFlavor::kMixtral ? mixtral : qwen3;
}

// Required of a file that states it; transformers assumes the same where absent.
const std::vector<detail::HfFixed>& fixed(MoEFlavor flavor) {
  static const std::vector<detail::HfFixed> common = {
      {"hidden_act", "silu", "the model uses silu"},
      {"tie_word_embeddings", false, "the output head is its own"},
      {"output_router_logits", false, "the router's auxiliary loss is not trained"},
  };
  static const std::vector<detail::HfFixed> qwen3 = [] {
    std::vector<detail::HfFixed> f = common;
    f.push_back({"use_sliding_window", false, "attention over the whole sequence"});
    f.push_back({"mlp_only_layers", nlohmann::json::array(), "the dense blocks are those decoder_sparse_step leaves"});
    return f;
  }();
  static const std::vector<detail::HfFixed> mixtral = [] {
    std::vector<detail::HfFixed> f = common;
    f.push_back({"sliding_window", nullptr, "attention over the whole sequence"});
    f.push_back({"router_jitter_noise", 0.0, "the router's scores are not jittered"});
    return f;
  }();
  return flavor == MoEFlavor::kMixtral ? mixtral : qwen3;
}

}  // namespace

std::string hf_config(const MoELlamaConfig& c, at::ScalarType dtype) {
  nlohmann::json j = {{"architectures", {mixtral(c) ? "MixtralForCausalLM" : "Qwen3MoeForCausalLM"}},
                      {"model_type", mixtral(c) ? "mixtral" : "qwen3_moe"}};
  detail::write_hf_fields(j, fields(c.flavor), fixed(c.flavor), c);
  j["num_key_value_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim();
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = detail::rope_hf_json(c.rope());
  j["torch_dtype"] = detail::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

MoELlamaConfig moe_llama_config_from_hf(MoEFlavor flavor, const std::string& text, const std::string& path) {
  const detail::HfJson j(text, path);
  const bool is_mixtral = flavor == MoEFlavor::kMixtral;
  j.require("model_type", is_mixtral ? "mixtral" : "qwen3_moe", is_mixtral ? "not mixtral" : "not qwen3_moe");
  ckpt::hf_float8_blocks(text, path);  // none, or FP8 with block scales (read by the import); others refused
  detail::require_hf_fixed(j, fixed(flavor));
  MoELlamaConfig c = is_mixtral ? MoELlamaConfig::mixtral_tiny() : MoELlamaConfig::qwen3_moe_tiny();
  for (const Field& f : fields(flavor)) {
    const char* key = f.theirs;
    // transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
    if (!is_mixtral && std::string(key) == "num_experts" && !j.has(key)) key = "num_local_experts";
    detail::read_hf_field(j, f, c, key);
  }
  HP_CHECK(c.experts > 0, "'", path, "': num_experts=", c.experts,
           " (a model without experts) is not supported yet by this family (read it as a llama)");
  c.kv_heads = j.integer("num_key_value_heads", c.heads);
  if (j.has("head_dim")) {
    const int64_t hd = j.integer("head_dim");
    if (c.heads <= 0 || c.dim % c.heads != 0 || hd != c.dim / c.heads) c.explicit_head_dim = hd;
  }
  c.rope_theta = j.real("rope_theta", is_mixtral ? 1e6 : 10000.0);
  RopeOptions rope = c.rope();
  detail::read_rope(j, rope, c.max_seq);
  set_rope(c, rope);
  c.validate();
  return c;
}

void check_hf_config(const MoELlamaConfig& c, const std::string& text, const std::string& path) {
  const MoELlamaConfig h = moe_llama_config_from_hf(c.flavor, text, path);
  detail::same_as_hf_fields(fields(c.flavor), c, h, path);
  detail::same_as_hf("kv_heads", "num_key_value_heads", c.kv_heads, h.kv_heads, path);
  detail::same_as_hf("head_dim", "head_dim", c.head_dim(), h.head_dim(), path);
  detail::same_as_hf("rope_theta", "rope_theta", c.rope_theta, h.rope_theta, path);
  detail::same_rope(c.rope(), h.rope(), path);
}

}  // namespace hp::models
