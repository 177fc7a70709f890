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

}  // namespace

// 222222228 layers of a tiny width passed every check (1.2e12 parameters is countable),
// then listing the Hugging Face names of every block took 2 billion strings: out of memory.
TEST(HfConfigInput, AbsurdLayerCountsAreRefused) {
  EXPECT_NO_THROW(hp::models::model_from_hf_config(llama_config("10000"), "c/config.json"));
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_config("222222228"), "c/config.json"); },
                         {"layers=222222228", "10000"});
  hp::test::expect_error([&] { hp::models::model_from_hf_config(llama_config("10001"), "c/config.json"); },
                         {"layers=10001"});
}
