// A Hugging Face config.json is untrusted input: what the fuzzer (fuzz/hf_config_fuzz.cpp)
// found it could do, each refused with an error naming the value. Each input is also in
// fuzz/corpus/hf_config/.
#include <gtest/gtest.h>

#include "hp/models/family.h"
#include "test_util.h"

namespace {

std::string llama_config(const std::string& layers) {
  return R"({"model_type": "llama", "hidden_act": "silu", "vocab_size": 6, "hidden_size": 64,
             "intermediate_size": 176, "num_attention_heads": 4, "num_hidden_layers": )" +
         layers + "}";
}

std::string llama_with(const std::string& extra) {
  return R"({"model_type": "llama", "hidden_act": "silu", "vocab_size": 6, "hidden_size": 64,
             "intermediate_size": 176, "num_attention_heads": 4, "num_hidden_layers": 2, )" +
         extra + "}";
}

}  // namespace

// Arrays nested 200,000 deep where a number belongs: refused by the nesting bound before the
// reader or an error message recurses (printing the value in the error overflowed the stack:
// a segfault). 64 levels are read; 65 are not.
TEST(HfConfigInput, DeepNestingIsRefusedBeforeAnyReaderRecurses) {
  const auto nested = [](int n) {
    return R"({"model_type": "llama", "hidden_act": "silu", "vocab_size": )" + std::string(n, '[') + std::string(n, ']') + "}";
  };
  hp::test::expect_error([&] { hp::models::model_from_hf_config(nested(200000), "c.json"); },
                         {"'c.json': nested deeper than 64 levels"});
  // The object and 63 arrays: 64 levels, read (and refused for what they hold); one more is not.
  hp::test::expect_error([&] { hp::models::model_from_hf_config(nested(63), "c.json"); }, {"vocab_size is not an integer"});
  hp::test::expect_error([&] { hp::models::model_from_hf_config(nested(64), "c.json"); }, {"nested deeper than 64"});
}

// A config.json's values are held to their keys' ranges, as a config file's are:
// rms_norm_eps <= 0 trained silently, rope_theta <= 0 gave NaN at step 1 (blamed on the lr).
TEST(HfConfigInput, ValuesOutsideTheirKeysRangesAreRefused) {
  EXPECT_NO_THROW(hp::models::model_from_hf_config(llama_with(R"("rms_norm_eps": 1e-5, "rope_theta": 10000)"), "c.json"));
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_with(R"("rms_norm_eps": 0)"), "c.json"); },
                         {"'c.json'", "model.norm_eps=0", "> 0"});
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_with(R"("rms_norm_eps": -1e-6)"), "c.json"); },
                         {"model.norm_eps=-1e-06"});
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_with(R"("rope_theta": 0)"), "c.json"); },
                         {"model.rope_theta=0", "> 0"});
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_with(R"("rope_theta": -5.5)"), "c.json"); },
                         {"model.rope_theta=-5.5"});
  const std::string deepseek = R"({"model_type": "deepseek_v3", "hidden_act": "silu", "vocab_size": 32,
      "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
      "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16,
      "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
      "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
      "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rms_norm_eps": EPS})";
  const auto with_eps = [&](const std::string& eps) {
    std::string t = deepseek;
    return t.replace(t.find("EPS"), 3, eps);
  };
  EXPECT_NO_THROW(hp::models::model_from_hf_config(with_eps("1e-6"), "d.json"));
  hp::test::expect_error([&] { hp::models::model_from_hf_config(with_eps("0"), "d.json"); },
                         {"'d.json'", "model.norm_eps=0"});
}

// 222222228 layers of a tiny width passed every check (1.2e12 parameters is countable),
// then listing the Hugging Face names of every block took 2 billion strings: out of memory.
TEST(HfConfigInput, AbsurdLayerCountsAreRefused) {
  EXPECT_NO_THROW(hp::models::model_from_hf_config(llama_config("10000"), "c/config.json"));
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_config("222222228"), "c/config.json"); },
                         {"layers=222222228", "10000"});
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_config("10001"), "c/config.json"); },
                         {"layers=10001"});
}
