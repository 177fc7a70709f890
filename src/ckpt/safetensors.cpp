#include "hp/ckpt/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "hp/core/error.h"
#include "hp/core/untrusted.h"

namespace hp::ckpt {
namespace {

constexpr int64_t kMaxHeaderBytes = int64_t(100) << 20;  // safetensors' own limit
constexpr int64_t kMaxInt = int64_t(1) << 53;            // integers JSON carries exactly
constexpr const char* kE4m3fn = "F8_E4M3";

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16}, {"I64", at::kLong},
      {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},   {"U8", at::kByte},        {"BOOL", at::kBool}};
  return names;
}

// A strict parser of exactly the JSON a safetensors header holds. Every failure raises,
// naming the file and the byte offset within the header.
class HeaderParser {
 public:
  HeaderParser(const std::string& what, const char* s, size_t n) : what_(what), s_(s), n_(n) {}

  SafetensorsHeader parse() {
    SafetensorsHeader h;
    std::set<std::string> names;
    ws();
    object([&](const std::string& key) {
      if (key == "__metadata__") {
        HP_CHECK(!seen_metadata_, what_, ": the header holds __metadata__ twice");
        seen_metadata_ = true;
        object([&](const std::string& k) {
          if (!h.metadata.emplace(k, string()).second) fail("metadata key '" + k + "' given twice");
        });
      } else {
        HP_CHECK(!key.empty(), what_, ": a tensor with an empty name");
        HP_CHECK(names.insert(key).second, what_, ": tensor '", key, "' is named twice in the header");
        h.tensors.push_back(entry(key));
      }
    });
    ws();
    HP_CHECK(i_ == n_, what_, ": the header has bytes after its JSON object (at header byte ", i_, ")");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw Error(detail::str_cat(what_, ": the header is not valid safetensors JSON at byte ", i_, ": ", why));
  }
  char peek() const {
    if (i_ >= n_) fail("it ends early");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  void ws() {
    while (i_ < n_ && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  static void put_utf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      *out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      *out += static_cast<char>(0xc0 | (cp >> 6));
      *out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      *out += static_cast<char>(0xe0 | (cp >> 12));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      *out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      *out += static_cast<char>(0xf0 | (cp >> 18));
      *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      *out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }
  uint32_t hex4() {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = peek();
      ++i_;
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else fail("a bad \\u escape");
    }
    return v;
  }
  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      char c = peek();
      ++i_;
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      char e = peek();
      ++i_;
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xd800 && cp < 0xdc00) {  // a surrogate pair
            if (peek() != '\\') fail("a lone surrogate");
            ++i_;
            expect('u');
            uint32_t lo = hex4();
            if (lo < 0xdc00 || lo >= 0xe000) fail("a lone surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp < 0xe000) {
            fail("a lone surrogate");
          }
          put_utf8(&out, cp);
          break;
        }
        default: fail("an unknown escape");
      }
    }
  }
  int64_t integer() {
    if (peek() == '-') fail("a negative number");
    if (peek() < '0' || peek() > '9') fail("expected a non-negative integer");
    int64_t v = 0;
    size_t start = i_;
    while (i_ < n_ && s_[i_] >= '0' && s_[i_] <= '9') {
      v = v * 10 + (s_[i_] - '0');
      if (v > kMaxInt) fail("an integer too large");
      ++i_;
    }
    if (s_[start] == '0' && i_ - start > 1) fail("a number with a leading zero");
    if (i_ < n_ && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E')) fail("expected an integer");
    return v;
  }
  std::vector<int64_t> int_array() {
    expect('[');
    std::vector<int64_t> out;
    ws();
    if (peek() == ']') {
      ++i_;
      return out;
    }
    for (;;) {
      ws();
      out.push_back(integer());
      if (out.size() > 64) fail("an array too long");
      ws();
      if (peek() == ',') {
        ++i_;
        continue;
      }
      expect(']');
      return out;
    }
  }
  // A JSON object: for each member, `value(key)` parses the value (whitespace around it is
  // skipped here).
  template <typename F>
  void object(F value) {
    expect('{');
    ws();
    if (peek() == '}') {
      ++i_;
      return;
    }
    for (;;) {
      ws();
      std::string key = string();
      ws();
      expect(':');
      ws();
      value(key);
      ws();
      if (peek() == ',') {
        ++i_;
        continue;
      }
      expect('}');
      return;
    }
  }
  TensorEntry entry(const std::string& name) {
    TensorEntry t;
    t.name = name;
    bool has_dtype = false, has_shape = false, has_offsets = false;
    object([&](const std::string& k) {
      if (k == "dtype" && !has_dtype) {
        std::string d = string();
        auto it = std::find_if(dtype_names().begin(), dtype_names().end(), [&](const auto& p) { return p.first == d; });
        t.e4m3fn = d == kE4m3fn;  // its bytes, held as uint8 (hp/ckpt/float8.h decodes them)
        HP_CHECK(it != dtype_names().end() || t.e4m3fn, what_, ": tensor '", name, "' has dtype '", d,
                 "', not one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3");
        t.dtype = t.e4m3fn ? at::kByte : it->second;
        has_dtype = true;
      } else if (k == "shape" && !has_shape) {
        t.shape = int_array();
        has_shape = true;
      } else if (k == "data_offsets" && !has_offsets) {
        std::vector<int64_t> o = int_array();
        HP_CHECK(o.size() == 2, what_, ": tensor '", name, "' has ", o.size(), " data_offsets; expected [begin, end]");
        t.begin = o[0];
        t.end = o[1];
        has_offsets = true;
      } else {
        fail("tensor '" + name + "' has an unexpected or repeated key '" + k + "'");
      }
    });
    HP_CHECK(has_dtype && has_shape && has_offsets, what_, ": tensor '", name,
             "' lacks dtype, shape or data_offsets");
    return t;
  }

  std::string what_;
  const char* s_;
  size_t n_;
  size_t i_ = 0;
  bool seen_metadata_ = false;
};

std::string os_error() { return errno ? std::strerror(errno) : "unknown error"; }

void read_exact(int fd, int64_t offset, int64_t n, void* out, const std::string& path) {
  int64_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, static_cast<char*>(out) + done, static_cast<size_t>(n - done),
                        static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    HP_CHECK(r >= 0, path, ": read at byte ", offset + done, " failed: ", os_error());
    HP_CHECK(r > 0, path, ": the file ends at byte ", offset + done, " (truncated?)");
    done += r;
  }
}

struct Fd {
  int fd;
  // A regular file only (a FIFO is refused, not waited on in open()).
  explicit Fd(const std::string& path) : fd(files::open_regular(path, "safetensors file")) {}
  ~Fd() { ::close(fd); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

}  // namespace

const TensorEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::string TensorEntry::dtype_name() const { return e4m3fn ? kE4m3fn : dtype_string(dtype); }

std::string dtype_string(at::ScalarType t) {
  for (const auto& [s, d] : dtype_names()) {
    if (d == t) return s;
  }
  HP_CHECK(false, "safetensors has no name for dtype ", t);
  return "";
}

at::ScalarType dtype_from_string(const std::string& s) {
  for (const auto& [name, d] : dtype_names()) {
    if (name == s) return d;
  }
  HP_CHECK(false, "'", s, "' is not a safetensors dtype (one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
  return at::kFloat;
}

SafetensorsHeader parse_header(const std::string& what, const uint8_t* bytes, size_t size, int64_t file_size) {
  HP_CHECK(size >= 8 && file_size >= 8, what, ": ", file_size, " bytes is too short for a safetensors file");
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | bytes[k];  // little-endian
  HP_CHECK(n <= static_cast<uint64_t>(kMaxHeaderBytes), what, ": header length ", n, " exceeds the 100 MiB limit");
  HP_CHECK(static_cast<int64_t>(n) <= file_size - 8, what, ": header length ", n, " runs past the end of the ",
           file_size, "-byte file");
  HP_CHECK(8 + n <= size, what, ": header length ", n, " but only ", size - 8, " header bytes given");
  SafetensorsHeader h = HeaderParser(what, reinterpret_cast<const char*>(bytes) + 8, n).parse();
  h.data_start = 8 + static_cast<int64_t>(n);
  const int64_t data_bytes = file_size - h.data_start;
  for (const auto& t : h.tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      HP_CHECK(!__builtin_mul_overflow(numel, d, &numel), what, ": tensor '", t.name, "' has too many elements");
    }
    int64_t bytes_needed = 0;
    HP_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(t.dtype)), &bytes_needed), what,
             ": tensor '", t.name, "' has too many bytes");
    HP_CHECK(t.begin <= t.end, what, ": tensor '", t.name, "' has data_offsets [", t.begin, ", ", t.end,
             "] that run backwards");
    HP_CHECK(t.end - t.begin == bytes_needed, what, ": tensor '", t.name, "' is ", t.dtype_name(), " of shape ",
             c10::IntArrayRef(t.shape), " (", bytes_needed, " bytes) but its data_offsets [", t.begin, ", ", t.end,
             "] hold ", t.end - t.begin);
    HP_CHECK(t.end <= data_bytes, what, ": tensor '", t.name, "' ends at data byte ", t.end, ", past the ",
             data_bytes, "-byte data section (truncated?)");
  }
  // The tensors must tile the data section: sorted by offset, each starts where the last ended.
  std::vector<const TensorEntry*> order;
  for (const auto& t : h.tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t at_byte = 0;
  for (const TensorEntry* t : order) {
    HP_CHECK(t->begin >= at_byte, what, ": tensor '", t->name, "' at data bytes [", t->begin, ", ", t->end,
             ") overlaps the tensor before it");
    HP_CHECK(t->begin == at_byte, what, ": data bytes [", at_byte, ", ", t->begin, ") belong to no tensor (before '",
             t->name, "')");
    at_byte = t->end;
  }
  HP_CHECK(at_byte == data_bytes, what, ": data bytes [", at_byte, ", ", data_bytes, ") belong to no tensor");
  std::vector<TensorEntry> sorted;
  for (const TensorEntry* t : order) sorted.push_back(*t);
  h.tensors = std::move(sorted);
  return h;
}

SafetensorsHeader read_header(const std::string& path) {
  Fd f(path);
  struct stat st;
  HP_CHECK(::fstat(f.fd, &st) == 0, path, ": cannot stat: ", os_error());
  const int64_t size = st.st_size;
  HP_CHECK(size >= 8, path, ": ", size, " bytes is too short for a safetensors file");
  uint8_t len[8];
  read_exact(f.fd, 0, 8, len, path);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | len[k];
  HP_CHECK(n <= static_cast<uint64_t>(kMaxHeaderBytes) && static_cast<int64_t>(n) <= size - 8, path,
           ": header length ", n, " runs past the end of the ", size, "-byte file");
  std::vector<uint8_t> buf(8 + n);
  std::memcpy(buf.data(), len, 8);
  read_exact(f.fd, 8, static_cast<int64_t>(n), buf.data() + 8, path);
  return parse_header(path, buf.data(), buf.size(), size);
}

void write_file(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                const std::map<std::string, std::string>& metadata, Storage& storage,
                const std::set<std::string>& e4m3fn) {
  auto quote = [](const std::string& s) {
    std::string out = "\"";
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += static_cast<char>(c);
      } else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      } else {
        out += static_cast<char>(c);
      }
    }
    return out + "\"";
  };
  std::set<std::string> names;
  std::vector<at::Tensor> data;
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      json += (first ? "" : ",") + quote(k) + ":" + quote(v);
      first = false;
    }
    json += "}";
  }
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    HP_CHECK(!name.empty() && name != "__metadata__", path, ": a tensor may not be named '", name, "'");
    HP_CHECK(names.insert(name).second, path, ": tensor '", name, "' is given twice");
    HP_CHECK(t.defined(), path, ": tensor '", name, "' is undefined");
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const int64_t bytes = static_cast<int64_t>(c.nbytes());
    const bool float8 = e4m3fn.count(name) > 0;
    HP_CHECK(!float8 || c.scalar_type() == at::kByte, path, ": tensor '", name, "' is to be written as F8_E4M3 but holds ",
             c.scalar_type(), ", not its bytes (uint8)");
    json += std::string(json.size() > 1 ? "," : "") + quote(name) + ":{\"dtype\":\"" +
            (float8 ? std::string(kE4m3fn) : dtype_string(c.scalar_type())) + "\",\"shape\":[";
    for (int64_t d = 0; d < c.dim(); ++d) json += (d ? "," : "") + std::to_string(c.size(d));
    json += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + bytes) + "]}";
    offset += bytes;
    data.push_back(c);
  }
  json += "}";
  while ((8 + json.size()) % 8 != 0) json += ' ';  // the data section starts 8-byte aligned
  const std::string partial = path + ".partial";
  uint8_t len[8];
  uint64_t n = json.size();
  for (int k = 0; k < 8; ++k) len[k] = static_cast<uint8_t>(n >> (8 * k));
  try {
    auto f = storage.create(partial);
    f->write(len, 8);
    f->write(json.data(), json.size());
    // An empty tensor may have no storage (a null pointer): nothing to write.
    for (const auto& c : data) f->write(c.data_ptr(), c.nbytes());
    f->sync();
    f->close();
  } catch (const std::exception& e) {
    try {
      storage.remove_tree(partial);
    } catch (const std::exception&) {
    }
    HP_CHECK(false, partial, ": writing failed: ", e.what());
  }
  storage.rename(partial, path);
}

at::Tensor read_tensor(const std::string& path, const SafetensorsHeader& h, const std::string& name) {
  const TensorEntry* t = h.find(name);
  HP_CHECK(t != nullptr, path, ": no tensor named '", name, "'");
  at::Tensor out = at::empty(t->shape, at::TensorOptions().dtype(t->dtype));
  Fd f(path);
  read_exact(f.fd, h.data_start + t->begin, t->end - t->begin, out.data_ptr(), path);
  return out;
}

}  // namespace hp::ckpt
