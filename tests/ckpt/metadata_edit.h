// Editing a saved checkpoint's metadata.json as a tool (or an attacker) would, for the tests
// of hostile input: the document is changed and its checksum recomputed, so that what the
// loader then refuses is the value, not the checksum. The checksum is written here from
// docs/ckpt.md, apart from the library's code: the block hash of the compact dump (keys
// sorted, no spaces) of the document without its "checksum" member, as decimal text.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace hp::test {

// The block hash of docs/ckpt.md: four 64-bit lanes; word w (little-endian, the w-th 8 bytes
// of the whole 32-byte steps) goes to lane w % 4 as lane = (lane ^ w) * P, lane ^= lane >> 29;
// the lanes folded by out = (out ^ lane) * P; then each tail byte the same way.
inline uint64_t doc_block_hash(const std::string& bytes) {
  constexpr uint64_t P = 1099511628211ULL;
  const size_t n = bytes.size(), whole = n / 32 * 32;
  uint64_t lane[4] = {1469598103934665603ULL ^ static_cast<uint64_t>(n), 0x9E3779B97F4A7C15ULL,
                      0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL};
  for (size_t w = 0; w < whole / 8; ++w) {
    uint64_t word = 0;
    for (int b = 7; b >= 0; --b) word = (word << 8) | static_cast<unsigned char>(bytes[w * 8 + static_cast<size_t>(b)]);
    uint64_t& h = lane[w % 4];
    h = (h ^ word) * P;
    h ^= h >> 29;
  }
  uint64_t out = lane[0];
  for (int l = 1; l < 4; ++l) out = (out ^ lane[l]) * P;
  for (size_t i = whole; i < n; ++i) out = (out ^ static_cast<unsigned char>(bytes[i])) * P;
  return out;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// The checksum the document should carry.
inline std::string doc_checksum(nlohmann::json meta) {
  meta.erase("checksum");
  return std::to_string(doc_block_hash(meta.dump()));
}

// `meta` written as `dir`/metadata.json, its checksum recomputed when it carries one.
inline void write_metadata(const std::string& dir, nlohmann::json meta) {
  if (meta.is_object() && meta.contains("checksum")) meta["checksum"] = doc_checksum(meta);
  write_text(dir + "/metadata.json", meta.dump(1));
}

}  // namespace hp::test
