// The safetensors file format, written and read by the checkpoint layer: an 8-byte
// little-endian header length N, N bytes of JSON (an object mapping each tensor's name to
// {"dtype", "shape", "data_offsets": [begin, end]} relative to the data section, plus an
// optional "__metadata__" object of strings), then the data section: every tensor's
// little-endian bytes, contiguous, covering the section with no hole and no overlap.
//
// Reading validates everything before any tensor is trusted, and raises hp::Error naming
// the file, the tensor and the problem: a header length past the end of the file, JSON that
// does not parse or has the wrong shape, an unknown dtype string, a dtype and shape whose
// byte count differs from the offsets, offsets past the data section, overlapping or
// leaving holes, duplicate names. Never a crash, never a silently wrong tensor (the header
// parser is fuzzed in its test).
//
// Writing goes to `path`.partial, is fsynced, then renamed: a reader never sees a
// half-written file under its final name. It goes through a ckpt::Storage (the local file
// system unless given).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "hp/ckpt/storage.h"

namespace hp::ckpt {

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  // F8_E4M3 (float8_e4m3fn, hp/ckpt/float8.h): held as its bytes, `dtype` kByte; read only
  // where a caller decodes it (load_consolidated with the folder's block scales).
  bool e4m3fn = false;
  std::string dtype_name() const;  // the file's dtype string ("F32", "F8_E4M3", ...)
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte range within the data section
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  int64_t data_start = 0;  // file offset of the data section (8 + header length)
  const TensorEntry* find(const std::string& name) const;
};

// "F32", "BF16", ... for the dtypes safetensors names; raises for others.
std::string dtype_string(at::ScalarType t);
// The inverse: the dtype of "F32", "BF16", ...; raises naming the string for others.
at::ScalarType dtype_from_string(const std::string& s);

// Parses and validates a header held in `bytes` (the file's first `size` bytes, at least
// the 8-byte length and the JSON), for a file of `file_size` bytes. `what` names the file
// in errors.
SafetensorsHeader parse_header(const std::string& what, const uint8_t* bytes, size_t size, int64_t file_size);

// Reads and validates `path`'s header.
SafetensorsHeader read_header(const std::string& path);

// Writes the tensors (any layout; written contiguous, in the order given) and the
// metadata to `path` atomically. Names must be unique and non-empty. The uint8 tensors
// `e4m3fn` names are written as F8_E4M3 (float8_e4m3fn bytes, hp/ckpt/float8.h).
// A failed write removes the partial file and raises naming it and the error.
void write_file(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                const std::map<std::string, std::string>& metadata = {}, Storage& storage = *local_storage(),
                const std::set<std::string>& e4m3fn = {});

// Reads one tensor of a file whose header `h` was read from `path`: a new CPU tensor.
at::Tensor read_tensor(const std::string& path, const SafetensorsHeader& h, const std::string& name);

}  // namespace hp::ckpt
