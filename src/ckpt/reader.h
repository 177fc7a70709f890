// The checkpoint layer's readers, shared by load() (hyperparallel checkpoints) and the
// consolidated-folder import (hp/ckpt/consolidated.h): the box reader, and metadata.json's
// format (its checksum and schema, src/ckpt/metadata.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hp/ckpt/checkpoint.h"
#include "hp/comm/agree.h"

namespace hp::ckpt::detail {

// metadata.json's format tags. 2 carries a checksum of the document; 1 (written before it)
// has none and is still read, schema-checked the same way.
inline constexpr const char* kFormatV1 = "hyperparallel-checkpoint-1";
inline constexpr const char* kFormat = "hyperparallel-checkpoint-2";

// The checksum of data files' blocks and of metadata.json (docs/ckpt.md gives it in full):
// 64-bit words folded by multiply and xor-shift; it catches flipped and lost bytes, not
// tampering.
uint64_t block_hash(const uint8_t* p, size_t n);

// The checksum metadata.json carries (as decimal text under "checksum"): block_hash of the
// compact dump (keys sorted, no spaces) of the document without its "checksum" member.
uint64_t metadata_checksum(const nlohmann::json& meta);

// `name` as a chunk's or a data file's name: a file directly inside the folder (not empty,
// no '/', not "." or "..", no NUL).
bool is_plain_file_name(const std::string& name);

// Whether a data file reached by name may be a symbolic link: never in a hyperparallel
// checkpoint (its files are its own), and in a Hugging Face folder (whose hub cache links
// its files to blobs elsewhere).
enum class FileLinks { kRefuse, kFollow };

// Fills every item's `local` from the saved tensor `item.source` (or `item.name`) of the
// catalog `tensors` ({name: {"dtype", "shape", "chunks": [{"file", "key", "offsets",
// "lengths"}]}}), files relative to `dir`; `files` ({file: {"bytes", "block",
// "checksums"}}) verifies the blocks it lists. The catalog is trusted to be well formed
// (read_metadata checked it, or the caller built it); chunks that overlap inside an item's
// box are refused here. `convert`: a saved dtype other than the item's is cast (else an
// error). `source` names the kind of folder in errors.
void load_boxes(const std::vector<Item>& items, const std::string& dir, const nlohmann::json& tensors,
                const nlohmann::json& files, bool convert, const std::string& source,
                FileLinks links = FileLinks::kRefuse);

// `dir`/metadata.json, checked to be a hyperparallel checkpoint's: a regular file (not a
// link), JSON, a known format, its checksum (format 2) and its whole schema (every type,
// count and range; chunk boxes inside their tensors; file names inside the folder). Raises
// hp::Error naming the file, the key and the value; what it returns is safe to read with
// nlohmann's accessors.
nlohmann::json read_metadata(const std::string& dir);

}  // namespace hp::ckpt::detail
