// Fuzzes the readers of hp-train's data files (hp::train::make_dataset): binary token files
// (uint16, uint32), UTF-8 text, and Megatron-LM's indexed dataset (the .idx index checked
// against the .bin). The input's first bytes choose: [0] the type (binary uint16, binary
// uint32, text, megatron), [1] seq_length (1 to 64), [2..3] the vocabulary (1 to 65536,
// little-endian), for megatron [4..5] the .idx's length (the rest is the .bin); the rest is
// the file. A dataset it accepts must read every sample, each token in [0, vocab).
#include <vector>

#include "fuzz_util.h"
#include "hp/train/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4 || size > (64 << 10)) return -1;
  using hp::train::DataType;
  hp::train::DataSpec spec;
  const int kind = data[0] % 4;
  spec.type = kind == 2 ? DataType::kText : kind == 3 ? DataType::kMegatron : DataType::kBinary;
  spec.token_dtype = kind == 1 ? hp::train::TokenDtype::kUint32 : hp::train::TokenDtype::kUint16;
  const int64_t seq = data[1] % 64 + 1;
  const int64_t vocab = (data[2] | (data[3] << 8)) + 1;
  size_t at = 4;
  const std::string dir = hp::fuzz::scratch_dir();
  if (spec.type == DataType::kMegatron) {
    if (size < 6) return -1;
    const size_t idx_len = std::min<size_t>(data[4] | (data[5] << 8), size - 6);
    hp::fuzz::write_file(dir + "/data.idx", data + 6, idx_len);
    hp::fuzz::write_file(dir + "/data.bin", data + 6 + idx_len, size - 6 - idx_len);
    spec.path = dir + "/data";
  } else {
    spec.path = dir + "/data.tokens";
    hp::fuzz::write_file(spec.path, data + at, size - at);
  }
  hp::fuzz::expect_clean(
      [&] {
        const auto d = hp::train::make_dataset(spec, seq, vocab, 1);
        (void)d->describe();
        std::vector<int64_t> sample(static_cast<size_t>(seq + 1));
        for (int64_t i = 0; i < d->size(); ++i) {
          d->read(i, sample.data());
          for (int64_t t : sample) {
            if (t < 0 || t >= vocab) hp::fuzz::finding("a token outside [0, vocab) was read");
          }
        }
      },
      "data.path");
  return 0;
}
