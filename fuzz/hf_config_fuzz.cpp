// Fuzzes the reading of a Hugging Face config.json (hp::models::model_from_hf_config, what
// model.from_hf and init_from_hf run on the file's text), then the arithmetic a run does
// next with the sizes read (parameters, FLOPs, activations, names). A config it accepts must
// describe a model whose own config.json reads back to the same model (check_hf_config on
// both texts).
#include "fuzz_util.h"
#include "hp/models/family.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 20)) return -1;  // a config.json is about 1 KB; 1 MiB reaches deep nesting
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string path = "fuzz/config.json";
  hp::fuzz::expect_clean([&] {
    const auto args = hp::models::model_from_hf_config(text, path);
    (void)args->num_params();
    (void)args->largest_param();
    (void)args->largest_block_params();
    (void)args->params_per_tp_rank(1);
    (void)args->flops_per_token(std::min<int64_t>(args->max_seq(), 8192));
    (void)args->activations_per_token(std::min<int64_t>(args->max_seq(), 8192));
    (void)args->hf_names();
    const std::string written = args->hf_config(at::kBFloat16);
    try {
      args->check_hf_config(text, path);
      args->check_hf_config(written, "fuzz/written/config.json");
      const auto back = hp::models::model_from_hf_config(written, "fuzz/written/config.json");
      if (back->num_params() != args->num_params()) hp::fuzz::finding("the written config.json reads back to another size");
    } catch (const hp::Error& e) {
      hp::fuzz::finding("an accepted config.json does not read back: " + std::string(e.what()));
    }
  });
  return 0;
}
