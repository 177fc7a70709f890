// Fuzzes the safetensors header reader (hp::ckpt::parse_header): the input is a whole
// .safetensors file. A header it accepts must also read back from disk (read_header) the
// same, and every tensor it lists must read (read_tensor) within the file.
#include <ATen/ATen.h>

#include "fuzz_util.h"
#include "hp/ckpt/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (64 << 10)) return -1;  // a header of a few tensors; larger adds nothing
  const std::string name = "fuzz.safetensors";
  hp::fuzz::expect_clean(
      [&] {
        const hp::ckpt::SafetensorsHeader h = hp::ckpt::parse_header(name, data, size, static_cast<int64_t>(size));
        const std::string path = hp::fuzz::scratch_dir() + "/" + name;
        hp::fuzz::write_file(path, data, size);
        const hp::ckpt::SafetensorsHeader again = hp::ckpt::read_header(path);
        if (again.tensors.size() != h.tensors.size() || again.data_start != h.data_start ||
            again.metadata != h.metadata) {
          hp::fuzz::finding("read_header and parse_header disagree on the same bytes");
        }
        for (const auto& t : h.tensors) {
          if (t.begin < 0 || t.end > static_cast<int64_t>(size) - h.data_start) {
            hp::fuzz::finding("tensor '" + t.name + "' accepted with offsets outside the data section");
          }
          const at::Tensor x = hp::ckpt::read_tensor(path, h, t.name);
          if (x.sizes() != c10::IntArrayRef(t.shape) || x.scalar_type() != t.dtype) {
            hp::fuzz::finding("tensor '" + t.name + "' read with another shape or dtype than its header's");
          }
        }
      },
      name);
  return 0;
}
