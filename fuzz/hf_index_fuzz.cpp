// Fuzzes the reading of a consolidated folder's model.safetensors.index.json
// (hp::ckpt::consolidated_tensors, which init_from_hf and load_consolidated start from):
// the input is the index file's contents, written into a scratch folder.
#include "fuzz_util.h"
#include "hp/ckpt/consolidated.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 20)) return -1;  // an index of a few hundred tensors; 1 MiB reaches deep nesting
  const std::string dir = hp::fuzz::scratch_dir();
  const std::string index = dir + "/model.safetensors.index.json";
  hp::fuzz::write_file(index, data, size);
  hp::fuzz::expect_clean([&] { (void)hp::ckpt::consolidated_tensors(dir); }, index);
  return 0;
}
