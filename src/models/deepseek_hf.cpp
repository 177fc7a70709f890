// DeepSeek-V3's Hugging Face interchange: names and config.json.
#include <ATen/ATen.h>

#include <variant>

#include "hf_json.h"
#include "hp/ckpt/float8.h"
#include "hp/models/deepseek.h"

namespace hp::models {

std::vector<std::pair<std::string, std::string>> hf_names(const DeepSeekConfig& c) {
  using Pairs = std::vector<std::pair<const char*, const char*>>;
  static const Pairs attention = {{"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
                                  {"attn.q_norm.weight", "self_attn.q_a_layernorm.weight"},
                                  {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
                                  {"attn.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
                                  {"attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
                                  {"attn.wkv_b.weight", "self_attn.kv_b_proj.weight"},
                                  {"attn.wo.weight", "self_attn.o_proj.weight"}};
  static const Pairs swiglu = {{"w1.weight", "gate_proj.weight"}, {"w3.weight", "up_proj.weight"},
                               {"w2.weight", "down_proj.weight"}};
  std::vector<std::pair<std::string, std::string>> out = {{"tok_emb.weight", "model.embed_tokens.weight"}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string ours = "layers_" + std::to_string(i) + ".", theirs = "model.layers." + std::to_string(i) + ".";
    for (const auto& [a, b] : attention) out.emplace_back(ours + a, theirs + b);
    if (i < c.dense_layers) {
      for (const auto& [a, b] : swiglu) out.emplace_back(ours + "mlp." + a, theirs + "mlp." + b);
    } else {
      out.emplace_back(ours + "moe.gate.weight", theirs + "mlp.gate.weight");
      out.emplace_back(ours + "moe.bias", theirs + "mlp.gate.e_score_correction_bias");
      for (int64_t e = 0; e < c.experts; ++e) {
        const std::string x = std::to_string(e) + ".";
        for (const auto& [a, b] : swiglu) out.emplace_back(ours + "moe.experts." + x + a, theirs + "mlp.experts." + x + b);
      }
      if (c.shared_experts > 0) {
        for (const auto& [a, b] : swiglu) out.emplace_back(ours + "moe.shared." + a, theirs + "mlp.shared_experts." + b);
      }
    }
    out.emplace_back(ours + "attn_norm.weight", theirs + "input_layernorm.weight");
    out.emplace_back(ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight");
  }
  out.emplace_back("norm.weight", "model.norm.weight");
  out.emplace_back("output.weight", "lm_head.weight");
  return out;
}

namespace {

// A size or setting both sides have: our key, config.json's key, the field, and the value
// transformers' DeepseekV3Config assumes where the key is absent (DeepSeek-V3's; none: the
// key is required); whether init_from_hf requires the model to have the file's value (not
// for the rotary table's length: a longer one than the file's is no conflict). The one
// table config.json is written, read and checked from.
struct Field {
  const char* ours;
  const char* theirs;
  std::variant<int64_t DeepSeekConfig::*, double DeepSeekConfig::*> field;
  c10::optional<double> fallback;
  bool must_match = true;
};

const std::vector<Field>& fields() {
  using D = DeepSeekConfig;
  static const std::vector<Field> f = {
      {"vocab", "vocab_size", &D::vocab, {}},
      {"dim", "hidden_size", &D::dim, {}},
      {"dense_hidden", "intermediate_size", &D::dense_hidden, {}},
      {"expert_hidden", "moe_intermediate_size", &D::expert_hidden, {}},
      {"layers", "num_hidden_layers", &D::layers, {}},
      {"dense_layers", "first_k_dense_replace", &D::dense_layers, 3},
      {"heads", "num_attention_heads", &D::heads, {}},
      {"q_lora_rank", "q_lora_rank", &D::q_lora_rank, {}},
      {"kv_lora_rank", "kv_lora_rank", &D::kv_lora_rank, {}},
      {"qk_nope_dim", "qk_nope_head_dim", &D::qk_nope_dim, {}},
      {"qk_rope_dim", "qk_rope_head_dim", &D::qk_rope_dim, {}},
      {"v_head_dim", "v_head_dim", &D::v_head_dim, {}},
      {"experts", "n_routed_experts", &D::experts, {}},
      {"experts_per_token", "num_experts_per_tok", &D::experts_per_token, {}},
      {"shared_experts", "n_shared_experts", &D::shared_experts, 1},
      {"expert_groups", "n_group", &D::expert_groups, 8},
      {"groups_per_token", "topk_group", &D::groups_per_token, 4},
      {"routed_scale", "routed_scaling_factor", &D::routed_scale, 2.5},
      {"max_seq", "max_position_embeddings", &D::max_seq, 4096, /*must_match=*/false},
      {"rope_theta", "rope_theta", &D::rope_theta, 10000.0},
      {"norm_eps", "rms_norm_eps", &D::norm_eps, 1e-6},
  };
  return f;
}

// What the model always is, written as such and required of a file that states it (where
// absent, transformers assumes the same): the key, the value, what it means.
struct Fixed {
  const char* key;
  nlohmann::json value;
  const char* why;
};

const std::vector<Fixed>& fixed() {
  static const std::vector<Fixed> f = {
      {"hidden_act", "silu", "the model uses silu"},
      {"attention_bias", false, "the model has no biases"},
      {"scoring_func", "sigmoid", "the router scores by sigmoid"},
      {"topk_method", "noaux_tc", "the router picks by score plus balancing bias"},
      {"norm_topk_prob", true, "the routing weights are normalized"},
      {"rope_interleave", true, "the rotary dims are interleaved pairs"},
      {"tie_word_embeddings", false, "the output head is its own"},
      {"moe_layer_freq", 1, "every block after the dense ones is a MoE"},
  };
  return f;
}

}  // namespace

std::string hf_config(const DeepSeekConfig& c, at::ScalarType dtype) {
  nlohmann::json j = {{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"}};
  for (const Field& f : fields()) std::visit([&](auto m) { j[f.theirs] = c.*m; }, f.field);
  for (const Fixed& f : fixed()) j[f.key] = f.value;
  j["num_key_value_heads"] = c.heads;
  j["rope_scaling"] = detail::rope_hf_json(c.rope());
  j["num_nextn_predict_layers"] = 0;
  j["torch_dtype"] = detail::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

DeepSeekConfig deepseek_config_from_hf(const std::string& text, const std::string& path) {
  const detail::HfJson j(text, path);
  j.require("model_type", "deepseek_v3", "not deepseek_v3");
  ckpt::hf_float8_blocks(text, path);  // none, or FP8 with block scales (read by the import); others refused
  for (const Fixed& f : fixed()) j.require(f.key, f.value, f.why);
  HP_CHECK(j.has("q_lora_rank"), "'", path, "': q_lora_rank null (queries without a latent) is not supported yet");
  DeepSeekConfig c;
  for (const Field& f : fields()) {
    if (auto* m = std::get_if<int64_t DeepSeekConfig::*>(&f.field)) {
      c.*(*m) = j.integer(f.theirs, f.fallback ? c10::optional<int64_t>(static_cast<int64_t>(*f.fallback)) : c10::nullopt);
    } else {
      c.*std::get<double DeepSeekConfig::*>(f.field) = j.real(f.theirs, f.fallback);
    }
  }
  HP_CHECK(j.integer("num_key_value_heads", c.heads) == c.heads, "'", path, "': num_key_value_heads=",
           j.json()["num_key_value_heads"].dump(), " is not num_attention_heads=", c.heads, " (not supported yet)");
  // rope_scaling, or transformers 5's rope_parameters (rope_theta inside): yarn as published.
  RopeOptions rope = c.rope();
  rope.scaling = RopeScaling::kNone;
  detail::read_rope(j, rope, c.max_seq);  // yarn: absent mscales are not used (transformers)
  set_rope(c, rope);
  c.validate();
  return c;
}

void check_hf_config(const DeepSeekConfig& c, const std::string& text, const std::string& path) {
  const DeepSeekConfig h = deepseek_config_from_hf(text, path);
  for (const Field& f : fields()) {
    if (!f.must_match) continue;
    std::visit([&](auto m) { detail::same_as_hf(f.ours, f.theirs, c.*m, h.*m, path); }, f.field);
  }
  detail::same_rope(c.rope(), h.rope(), path);
}

}  // namespace hp::models
