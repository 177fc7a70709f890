// metadata.json as read back from disk: untrusted input, and the checksum of its blocks and
// of the data files (block_hash). Its checksum (format 2) catches a
// damaged file; its schema check catches any value the readers could not use safely (a
// consistent file with bad values, as a tool could write, passes the checksum). Every
// refusal names the file, the key and the value.
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <set>

#include "hp/ckpt/safetensors.h"
#include "hp/core/error.h"
#include "hp/core/untrusted.h"
#include "reader.h"

namespace hp::ckpt::detail {
namespace {

using json = nlohmann::json;

// Bounds that keep every product and sum the readers form inside int64: a block (read into
// memory whole), a tensor's rank and its bytes.
constexpr int64_t kMaxBlock = int64_t(1) << 30;
constexpr size_t kMaxDims = 64;
constexpr int64_t kMaxBytes = int64_t(1) << 62;

// A value as the message shows it: JSON text, cut short.
std::string shown(const json& v) {
  std::string s;
  try {
    s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  } catch (const std::exception&) {
    s = "(unprintable)";
  }
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

// Decimal digits only (no sign, no space), as the checksums are written; false otherwise
// or past uint64.
bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  const auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

// The schema check of one document: each accessor checks one value and names it by its key
// path (tensors["a"].chunks[0].offsets[1]) when it is wrong.
class Schema {
 public:
  explicit Schema(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& key, const json& v, const std::string& why) const {
    throw Error(hp::detail::str_cat("ckpt::load: '", path_, "': ", key, " is ", shown(v), ": ", why));
  }
  [[noreturn]] void fail_missing(const std::string& key) const {
    throw Error(hp::detail::str_cat("ckpt::load: '", path_, "': ", key, " is missing"));
  }

  // `v` an object whose members are among `allowed` and hold every one of `required`.
  void object(const json& v, const std::string& key, std::initializer_list<const char*> allowed,
              std::initializer_list<const char*> required) const {
    if (!v.is_object()) fail(key, v, "expected an object");
    for (const auto& [k, _] : v.items()) {
      bool known = false;
      for (const char* a : allowed) known = known || k == a;
      if (!known) fail(key, v, "'" + k + "' is not a member this format has");
    }
    for (const char* r : required) {
      if (!v.contains(r)) fail_missing(sub(key, r));
    }
  }

  int64_t integer(const json& v, const std::string& key, int64_t min, int64_t max) const {
    if (!v.is_number_integer()) fail(key, v, "expected an integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(max)) {
      fail(key, v, hp::detail::str_cat("must be at most ", max));
    }
    const int64_t x = v.get<int64_t>();
    if (x < min) fail(key, v, hp::detail::str_cat("must be at least ", min));
    if (x > max) fail(key, v, hp::detail::str_cat("must be at most ", max));
    return x;
  }

  const std::string& string(const json& v, const std::string& key) const {
    if (!v.is_string()) fail(key, v, "expected a string");
    return v.get_ref<const std::string&>();
  }

  // A list of integers in [min, max], `n` of them (-1: any number up to kMaxDims).
  std::vector<int64_t> integers(const json& v, const std::string& key, int64_t min, int64_t max, int64_t n) const {
    if (!v.is_array()) fail(key, v, "expected a list of integers");
    if (n >= 0 && static_cast<int64_t>(v.size()) != n) {
      fail(key, v, hp::detail::str_cat("expected ", n, " entries (one per dim of the tensor)"));
    }
    if (v.size() > kMaxDims) fail(key, v, hp::detail::str_cat("more than ", kMaxDims, " dims"));
    std::vector<int64_t> out;
    for (size_t i = 0; i < v.size(); ++i) out.push_back(integer(v[i], at(key, i), min, max));
    return out;
  }

  void file_name(const json& v, const std::string& key) const {
    if (!is_plain_file_name(string(v, key))) {
      fail(key, v, "not a file name inside the checkpoint's folder (a path, '.' or '..')");
    }
  }

  static std::string sub(const std::string& key, const std::string& member) {
    return key + "[" + json(member).dump(-1, ' ', false, json::error_handler_t::replace) + "]";
  }
  static std::string at(const std::string& key, size_t i) { return key + "[" + std::to_string(i) + "]"; }

 private:
  std::string path_;
};

void check_schema(const Schema& s, const json& meta, bool legacy) {
  if (legacy) {
    s.object(meta, "the document", {"format", "values", "tensors", "files"}, {"format", "tensors"});
  } else {
    s.object(meta, "the document", {"format", "checksum", "values", "tensors", "files"},
             {"format", "checksum", "values", "tensors", "files"});
  }
  if (meta.contains("values")) {
    const json& values = meta["values"];
    if (!values.is_object()) s.fail("values", values, "expected an object of strings");
    for (const auto& [k, v] : values.items()) s.string(v, Schema::sub("values", k));
  }
  // Files: name -> {bytes, block, checksums}, one checksum per block (null: a format-1 file
  // written before checksums).
  std::set<std::string> listed;
  if (meta.contains("files")) {
    const json& files = meta["files"];
    if (!files.is_object()) s.fail("files", files, "expected an object of file names");
    for (const auto& [name, info] : files.items()) {
      const std::string key = Schema::sub("files", name);
      if (!is_plain_file_name(name)) {
        s.fail(key, json(name), "not a file name inside the checkpoint's folder (a path, '.' or '..')");
      }
      listed.insert(name);
      if (legacy && info.is_null()) continue;
      s.object(info, key, {"bytes", "block", "checksums"}, {"bytes", "block", "checksums"});
      const int64_t bytes = s.integer(info["bytes"], Schema::sub(key, "bytes"), 0, kMaxBytes);
      const int64_t block = s.integer(info["block"], Schema::sub(key, "block"), 1, kMaxBlock);
      const json& sums = info["checksums"];
      const std::string skey = Schema::sub(key, "checksums");
      if (!sums.is_array()) s.fail(skey, sums, "expected a list of decimal strings");
      const int64_t blocks = bytes / block + (bytes % block != 0);
      if (static_cast<int64_t>(sums.size()) != blocks) {
        s.fail(skey, sums, hp::detail::str_cat(sums.size(), " checksums, but ", bytes, " bytes in blocks of ", block,
                                               " are ", blocks, " blocks"));
      }
      for (size_t i = 0; i < sums.size(); ++i) {
        uint64_t unused = 0;
        if (!parse_u64(s.string(sums[i], Schema::at(skey, i)), &unused)) {
          s.fail(Schema::at(skey, i), sums[i], "expected an unsigned 64-bit integer in decimal digits");
        }
      }
    }
  }
  const json& tensors = meta["tensors"];
  if (!tensors.is_object()) s.fail("tensors", tensors, "expected an object of tensors by name");
  for (const auto& [name, t] : tensors.items()) {
    const std::string key = Schema::sub("tensors", name);
    if (name.empty()) s.fail(key, t, "a tensor without a name");
    s.object(t, key, {"dtype", "shape", "chunks"}, {"dtype", "shape", "chunks"});
    const std::string& dtype = s.string(t["dtype"], Schema::sub(key, "dtype"));
    int64_t bytes = 0;
    try {
      bytes = static_cast<int64_t>(c10::elementSize(dtype_from_string(dtype)));
    } catch (const std::exception&) {
      s.fail(Schema::sub(key, "dtype"), t["dtype"], "not a safetensors dtype this library reads");
    }
    const std::vector<int64_t> shape = s.integers(t["shape"], Schema::sub(key, "shape"), 0, kMaxBytes, -1);
    for (int64_t d : shape) {
      if (d > 0 && bytes > kMaxBytes / d) s.fail(Schema::sub(key, "shape"), t["shape"], "too many bytes");
      bytes *= d;
    }
    const json& chunks = t["chunks"];
    const std::string ckey = Schema::sub(key, "chunks");
    if (!chunks.is_array()) s.fail(ckey, chunks, "expected a list of chunks");
    const auto nd = static_cast<int64_t>(shape.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      const json& c = chunks[i];
      const std::string k = Schema::at(ckey, i);
      s.object(c, k, {"file", "key", "offsets", "lengths"}, {"file", "key", "offsets", "lengths"});
      s.file_name(c["file"], Schema::sub(k, "file"));
      if (!legacy && !listed.count(c["file"].get<std::string>())) {
        s.fail(Schema::sub(k, "file"), c["file"], "not listed under 'files' (every data file has its checksums)");
      }
      if (s.string(c["key"], Schema::sub(k, "key")).empty()) s.fail(Schema::sub(k, "key"), c["key"], "empty");
      const auto off = s.integers(c["offsets"], Schema::sub(k, "offsets"), 0, kMaxBytes, nd);
      const auto len = s.integers(c["lengths"], Schema::sub(k, "lengths"), 1, kMaxBytes, nd);
      for (int64_t d = 0; d < nd; ++d) {
        if (off[d] > shape[d] || len[d] > shape[d] - off[d]) {
          s.fail(k, c, hp::detail::str_cat("the box (offsets + lengths) runs past the tensor's shape ",
                                           c10::IntArrayRef(shape), " in dim ", d));
        }
      }
    }
  }
}

}  // namespace

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

uint64_t block_hash(const uint8_t* p, size_t n) {
  // Four independent lanes over 32-byte steps (so the multiplies overlap), then the tail.
  constexpr uint64_t kPrime = 1099511628211ULL;
  uint64_t h[4] = {1469598103934665603ULL ^ n, 0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      h[l] = (h[l] ^ w) * kPrime;
      h[l] ^= h[l] >> 29;
    }
  }
  uint64_t out = h[0];
  for (int l = 1; l < 4; ++l) out = (out ^ h[l]) * kPrime;
  for (; i < n; ++i) out = (out ^ p[i]) * kPrime;
  return out;
}

uint64_t metadata_checksum(const json& meta) {
  json rest = meta;
  if (rest.is_object()) rest.erase("checksum");
  // Compact (no indent), keys sorted (nlohmann's objects are ordered maps), UTF-8 as is.
  const std::string text = rest.dump(-1, ' ', false, json::error_handler_t::strict);
  return block_hash(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

json read_metadata(const std::string& dir) {
  const std::string mpath = dir + "/metadata.json";
  struct stat st{};
  HP_CHECK(::lstat(mpath.c_str(), &st) == 0, "ckpt::load: '", dir, "' is not a committed checkpoint (no metadata.json)");
  HP_CHECK(S_ISREG(st.st_mode), "ckpt::load: '", mpath, "' is ", S_ISLNK(st.st_mode) ? "a symbolic link" : "not a file",
           " (a checkpoint's files are regular files in its folder)");
  const std::string text = hp::files::read_regular(mpath, "ckpt::load: metadata");
  hp::text::check_json_nesting(text, "ckpt::load: '" + mpath + "'");
  json meta;
  try {
    meta = json::parse(text);
  } catch (const std::exception& e) {
    HP_CHECK(false, "ckpt::load: '", mpath, "' is not valid JSON: ", e.what());
  }
  HP_CHECK(meta.is_object() && meta.contains("format"), "ckpt::load: '", mpath,
           "' is not a hyperparallel checkpoint (no format)");
  const json& format = meta["format"];
  const bool legacy = format == kFormatV1;
  HP_CHECK(legacy || format == kFormat, "ckpt::load: '", mpath, "': format is ", shown(format),
           ": not a hyperparallel checkpoint this version reads (", kFormat, " or ", kFormatV1, ")");
  // Format 1 was written before the checksum: read without one (the schema still applies).
  if (!legacy) {
    HP_CHECK(meta.contains("checksum"), "ckpt::load: '", mpath, "': checksum is missing (format ", kFormat,
             " carries one)");
    uint64_t want = 0;
    HP_CHECK(meta["checksum"].is_string() && parse_u64(meta["checksum"].get<std::string>(), &want), "ckpt::load: '",
             mpath, "': checksum is ", shown(meta["checksum"]), ": expected an unsigned 64-bit integer in decimal digits");
    uint64_t got = 0;
    try {
      got = metadata_checksum(meta);
    } catch (const std::exception& e) {
      HP_CHECK(false, "ckpt::load: '", mpath, "' cannot be checksummed: ", e.what());
    }
    HP_CHECK(got == want, "ckpt::load: '", mpath, "' was altered or damaged: its contents hash to ", got,
             ", the checksum it was written with is ", want);
  }
  check_schema(Schema(mpath), meta, legacy);
  return meta;
}

}  // namespace hp::ckpt::detail
