// A reference model's logits for a Hugging Face model folder, for the interchange tests with
// transformers (tests/ckpt/hf_interop_test.py, hf_deepseek_test.py):
//
//   hf_logits MODEL_DIR TOKENS.safetensors OUT.safetensors
//
// builds the model config.json describes (its model_type picks the family), loads its
// weights and buffers (hp::ckpt::load_consolidated, cast to fp32), runs it on the I64 tensor
// "tokens" [B, T] and writes the fp32 tensor "logits" [B, T, vocab]. Prints the error and
// exits 1 on any failure.
#include <ATen/ATen.h>

#include <fstream>
#include <iostream>
#include <sstream>

#include "hp/ckpt/consolidated.h"
#include "hp/ckpt/safetensors.h"
#include "hp/models/family.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: hf_logits MODEL_DIR TOKENS.safetensors OUT.safetensors\n";
    return 2;
  }
  try {
    const std::string dir = argv[1];
    std::ifstream f(dir + "/config.json");
    std::stringstream text;
    text << f.rdbuf();
    const auto args = hp::models::model_from_hf_config(text.str(), dir + "/config.json");
    auto model = args->build({}, c10::nullopt);
    std::map<std::string, std::string> theirs;
    for (const auto& [ours, hf] : args->hf_names()) theirs[ours] = hf;
    std::vector<hp::ckpt::Item> items;
    auto add = [&](const std::string& name, const at::Tensor& t) {
      auto it = theirs.find(name);
      if (it == theirs.end()) return;  // a buffer the folder does not hold (DeepSeek's load count)
      items.push_back({name, t.detach(), hp::make_shard_spec(t.sizes().vec(), {}), it->second});
      theirs.erase(it);
    };
    for (const auto& p : model->root().named_parameters()) add(p.key(), p.value());
    for (const auto& b : model->root().named_buffers()) add(b.key(), b.value());
    if (!theirs.empty()) throw std::runtime_error("the model has no tensor '" + theirs.begin()->first + "'");
    at::NoGradGuard ng;
    hp::ckpt::load_consolidated(items, dir);
    const auto h = hp::ckpt::read_header(argv[2]);
    const at::Tensor tokens = hp::ckpt::read_tensor(argv[2], h, "tokens");
    const at::Tensor logits = model->forward(tokens, /*hooked=*/false).contiguous();
    hp::ckpt::write_file(argv[3], {{"logits", logits}});
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "hf_logits: " << e.what() << std::endl;
    return 1;
  }
}
