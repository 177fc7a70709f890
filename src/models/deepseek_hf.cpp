// DeepSeek-V3's Hugging Face interchange: names and config.json.
#include <ATen/ATen.h>

#include <variant>

#include "hf_json.h"
#include "hp/ckpt/float8.h"
#include "hp/models/deepseek.h"
#include "hp/models/family.h"

namespace hp::models {

std::vector<std::pair<std::string, std::string>> hf_names(const DeepSeekConfig& c) {
  static const detail::HfNames::Pairs attention = {{"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
                                                   {"attn.q_norm.weight", "self_attn.q_a_layernorm.weight"},
                                                   {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
                                                   {"attn.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
                                                   {"attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
                                                   {"attn.wkv_b.weight", "self_attn.kv_b_proj.weight"},
                                                   {"attn.wo.weight", "self_attn.o_proj.weight"}};
  const auto& swiglu = detail::HfNames::swiglu();
  // A block's names after the prefixes `names` is under: attention, its feed-forward, its norms.
  auto block = [&](detail::HfNames& names, bool dense) {
    names.add(attention);
    if (dense) {
      names.add(swiglu, "mlp.", "mlp.");
    } else {
      names.add("moe.gate.weight", "mlp.gate.weight");
      names.add("moe.bias", "mlp.gate.e_score_correction_bias");
      names.experts(c.experts, swiglu, "moe.", "mlp.");
      if (c.shared_experts > 0) names.add(swiglu, "moe.shared.", "mlp.shared_experts.");
    }
    names.block_norms();
  };
  detail::HfNames names;
  for (int64_t i = 0; i < c.layers; ++i) {
    names.block(i);
    block(names, i < c.dense_layers);
  }
  detail::HfNames::List out = names.finish();
  // The multi-token prediction modules, stored as the blocks after the last, with names of
  // their own for the embedding and head they share (written as copies; read from the
  // model's own names, listed first).
  for (int64_t k = 0; k < c.mtp_layers; ++k) {
    const std::string ours = "mtp_" + std::to_string(k) + ".";
    const std::string theirs = "model.layers." + std::to_string(c.layers + k) + ".";
    detail::HfNames m{detail::HfNames::Bare{}};
    m.under(ours, theirs);
    m.add({{"enorm.weight", "enorm.weight"}, {"hnorm.weight", "hnorm.weight"}, {"eh_proj.weight", "eh_proj.weight"},
           {"norm.weight", "shared_head.norm.weight"}});
    m.under(ours + "block.", theirs);
    block(m, /*dense=*/false);
    for (auto& p : m.take()) out.push_back(std::move(p));
    out.emplace_back("tok_emb.weight", theirs + "embed_tokens.weight");
    out.emplace_back("output.weight", theirs + "shared_head.head.weight");
  }
  return out;
}

namespace {

using Field = detail::HfField<DeepSeekConfig>;

// The one table config.json is written, read and checked from (the fallbacks are
// DeepSeek-V3's, as transformers' DeepseekV3Config assumes them).
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

// Required of a file that states it; transformers assumes the same where absent.
const std::vector<detail::HfFixed>& fixed() {
  static const std::vector<detail::HfFixed> f = {
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
  detail::write_hf_fields(j, fields(), fixed(), c);
  j["num_key_value_heads"] = c.heads;
  j["rope_scaling"] = detail::rope_hf_json(c.rope());
  j["num_nextn_predict_layers"] = c.mtp_layers;
  j["torch_dtype"] = detail::hf_dtype_name(dtype);
  return j.dump(2) + "\n";
}

namespace {
// config.json's num_nextn_predict_layers: the multi-token prediction modules the folder may
// hold. Not read into the model (mtp_layers stays 0 unless set): transformers writes 1, its
// default, into folders it saves without the module.
int64_t hf_mtp_layers(const detail::HfJson& j, const std::string& path) {
  const int64_t n = j.integer("num_nextn_predict_layers", 0);
  HP_CHECK(n >= 0 && n <= kMaxLayers, "'", path, "': num_nextn_predict_layers=", n, " must be in [0, ", kMaxLayers, "]");
  return n;
}
}  // namespace

DeepSeekConfig deepseek_config_from_hf(const std::string& text, const std::string& path) {
  const detail::HfJson j(text, path);
  j.require("model_type", "deepseek_v3", "not deepseek_v3");
  ckpt::hf_float8_blocks(text, path);  // none, or FP8 with block scales (read by the import); others refused
  detail::require_hf_fixed(j, fixed());
  HP_CHECK(j.has("q_lora_rank"), "'", path, "': q_lora_rank null (queries without a latent) is not supported yet");
  DeepSeekConfig c;
  for (const Field& f : fields()) detail::read_hf_field(j, f, c);
  HP_CHECK(j.integer("num_key_value_heads", c.heads) == c.heads, "'", path, "': num_key_value_heads=",
           j.json()["num_key_value_heads"].dump(), " is not num_attention_heads=", c.heads, " (not supported yet)");
  // rope_scaling, or transformers 5's rope_parameters (rope_theta inside): yarn as published.
  RopeOptions rope = c.rope();
  rope.scaling = RopeScaling::kNone;
  detail::read_rope(j, rope, c.max_seq);  // yarn: absent mscales are not used (transformers)
  set_rope(c, rope);
  hf_mtp_layers(j, path);
  c.validate();
  return c;
}

void check_hf_config(const DeepSeekConfig& c, const std::string& text, const std::string& path) {
  const DeepSeekConfig h = deepseek_config_from_hf(text, path);
  detail::same_as_hf_fields(fields(), c, h, path);
  detail::same_rope(c.rope(), h.rope(), path);
  const int64_t in_file = hf_mtp_layers(detail::HfJson(text, path), path);
  HP_CHECK(c.mtp_layers <= in_file, "'", path, "': num_nextn_predict_layers=", in_file,
           " holds fewer multi-token prediction modules than model.mtp_layers=", c.mtp_layers,
           " (set model.mtp_layers to at most the folder's)");
}

}  // namespace hp::models
