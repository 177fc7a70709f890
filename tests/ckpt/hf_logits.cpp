// The Llama reference model's logits for a Hugging Face model folder, for the interchange
// test with transformers (tests/ckpt/hf_interop_test.py):
//
//   hf_logits MODEL_DIR TOKENS.safetensors OUT.safetensors
//
// builds the model config.json describes, loads its weights (hp::ckpt::load_consolidated,
// cast to fp32), runs it on the I64 tensor "tokens" [B, T] and writes the fp32 tensor
// "logits" [B, T, vocab]. Prints the error and exits 1 on any failure.
#include <ATen/ATen.h>

#include <fstream>
#include <iostream>
#include <sstream>

#include "hp/ckpt/consolidated.h"
#include "hp/ckpt/safetensors.h"
#include "hp/models/llama.h"

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
    const hp::models::LlamaConfig c = hp::models::llama_config_from_hf(text.str(), dir + "/config.json");
    hp::models::Llama model(c);
    std::map<std::string, std::string> theirs;
    for (const auto& [ours, hf] : hp::models::hf_names(c)) theirs[ours] = hf;
    std::vector<hp::ckpt::Item> items;
    for (const auto& p : model->named_parameters()) {
      items.push_back({p.key(), p.value().detach(), hp::make_shard_spec(p.value().sizes().vec(), {}), theirs.at(p.key())});
    }
    at::NoGradGuard ng;
    hp::ckpt::load_consolidated(items, dir);
    const auto h = hp::ckpt::read_header(argv[2]);
    const at::Tensor tokens = hp::ckpt::read_tensor(argv[2], h, "tokens");
    const at::Tensor logits = model->forward(tokens).contiguous();
    hp::ckpt::write_file(argv[3], {{"logits", logits}});
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "hf_logits: " << e.what() << std::endl;
    return 1;
  }
}
