#include "hp/train/data.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <vector>

#include "hp/core/error.h"

namespace hp::train {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
uint64_t hash(uint64_t a, uint64_t b, uint64_t c = 0) { return mix(mix(mix(a) ^ b) ^ c); }

class SyntheticDataset : public TokenDataset {
 public:
  SyntheticDataset(int64_t samples, int64_t seq, int64_t vocab, uint64_t seed)
      : n_(samples), seq_(seq), vocab_(vocab), seed_(seed) {}
  int64_t size() const override { return n_; }
  void read(int64_t index, int64_t* out) const override {
    uint64_t tok = hash(seed_, 1, static_cast<uint64_t>(index)) % vocab_;
    for (int64_t t = 0; t <= seq_; ++t) {
      out[t] = static_cast<int64_t>(tok);
      // Successor choice: 0 half the time, else 1..3; successor k of token a is fixed.
      uint64_t r = hash(seed_ ^ 0x5eedULL, static_cast<uint64_t>(index), static_cast<uint64_t>(t)) % 6;
      uint64_t k = r < 3 ? 0 : r - 2;
      tok = hash(seed_, 2 + k, tok) % vocab_;
    }
  }
  std::string describe() const override {
    return "synthetic Markov corpus, " + std::to_string(n_) + " samples";
  }

 private:
  int64_t n_, seq_, vocab_;
  uint64_t seed_;
};

// An open file read with pread: never mapped, so a file truncated while training gives a
// short read (named) rather than SIGBUS. The size and identity (device, inode) seen at open
// are checked again at every read.
class OpenFile {
 public:
  explicit OpenFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    HP_CHECK(fd_ >= 0, "data.path '", path, "': cannot open: ", std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw Error("data.path '" + path + "' is not a regular file");
    }
    size_ = static_cast<int64_t>(st.st_size);
    dev_ = st.st_dev;
    ino_ = st.st_ino;
  }
  ~OpenFile() { ::close(fd_); }
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Reads n bytes at `offset`; raises naming the file and the offset when the file changed
  // (truncated, replaced) since it was opened, or the read fails.
  void read(int64_t offset, int64_t n, uint8_t* out) const {
    struct stat now;
    HP_CHECK(::fstat(fd_, &now) == 0, "data.path '", path_, "': cannot stat: ", std::strerror(errno));
    HP_CHECK(now.st_size >= size_, "data.path '", path_, "' was truncated while training: ", size_,
             " bytes when opened, ", now.st_size, " now (reading byte offset ", offset, ")");
    struct stat by_name;
    HP_CHECK(::stat(path_.c_str(), &by_name) == 0 && by_name.st_dev == dev_ && by_name.st_ino == ino_,
             "data.path '", path_, "' was replaced or removed while training (reading byte offset ", offset, ")");
    int64_t done = 0;
    while (done < n) {
      ssize_t r = ::pread(fd_, out + done, static_cast<size_t>(n - done), static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      HP_CHECK(r >= 0, "data.path '", path_, "': read at byte offset ", offset + done, " failed: ", std::strerror(errno));
      HP_CHECK(r > 0, "data.path '", path_, "' ended at byte offset ", offset + done, " while reading ", n,
               " bytes at ", offset, " (truncated while training?)");
      done += r;
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

// Byte offset of the first invalid UTF-8 sequence, or -1: overlong forms, surrogates
// (U+D800..DFFF), code points above U+10FFFF and truncated sequences are all invalid.
int64_t invalid_utf8_at(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    const uint8_t c = s[i];
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xbf;  // allowed range of the second byte
    if (c < 0x80) {
      len = 1;
    } else if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;  // overlong
      if (c == 0xed) hi = 0x9f;  // surrogates
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;  // overlong
      if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
    }
    if (len == 0 || i + len > n) return static_cast<int64_t>(i);
    if (len > 1 && (s[i + 1] < lo || s[i + 1] > hi)) return static_cast<int64_t>(i);
    for (size_t k = 2; k < len; ++k) {
      if ((s[i + k] & 0xc0) != 0x80) return static_cast<int64_t>(i);
    }
    i += len;
  }
  return -1;
}

// Token ids from a file: bytes (text), uint16 or uint32. Validated whole at open (UTF-8 for
// text, every token below the vocabulary for binary), then read sample by sample, each
// token checked again as it is read (the file may be rewritten while training).
class FileDataset : public TokenDataset {
 public:
  FileDataset(const DataSpec& spec, int64_t seq, int64_t vocab)
      : file_(spec.path), seq_(seq), vocab_(vocab), kind_(to_string(spec.type)) {
    width_ = spec.type == DataType::kText ? 1 : spec.token_dtype == TokenDtype::kUint32 ? 4 : 2;
    const std::string& p = spec.path;
    HP_CHECK(file_.size() % width_ == 0, "data.path '", p, "': ", file_.size(),
             " bytes is not a whole number of ", to_string(spec.token_dtype), " tokens");
    tokens_ = file_.size() / width_;
    // The whole file in chunks; a UTF-8 sequence cut by a chunk's end is carried over.
    constexpr int64_t kChunk = int64_t(1) << 20;
    std::vector<uint8_t> buf;
    int64_t base = 0;  // file offset of buf[0]
    for (int64_t off = 0; off < file_.size(); off += kChunk) {
      const int64_t n = std::min(kChunk, file_.size() - off);
      const size_t keep = buf.size();
      buf.resize(keep + static_cast<size_t>(n));
      file_.read(off, n, buf.data() + keep);
      const bool last = off + n == file_.size();
      if (spec.type == DataType::kText) {
        int64_t bad = invalid_utf8_at(buf.data(), buf.size());
        if (bad >= 0 && !last && bad + 4 > static_cast<int64_t>(buf.size())) {
          buf.erase(buf.begin(), buf.begin() + bad);  // may complete in the next chunk
          base += bad;
          continue;
        }
        HP_CHECK(bad < 0, "data.path '", p, "': not valid UTF-8 at byte offset ", base + bad);
      } else {
        for (size_t i = 0; i + width_ <= buf.size(); i += static_cast<size_t>(width_)) {
          int64_t t = decode(buf.data() + i);
          HP_CHECK(t < vocab, "data.path '", p, "': token ", (base + static_cast<int64_t>(i)) / width_, " is ", t,
                   ", not below model.vocab=", vocab);
        }
      }
      base += static_cast<int64_t>(buf.size());
      buf.clear();
    }
    n_ = tokens_ > seq ? (tokens_ - 1) / seq : 0;
    HP_CHECK(n_ > 0, "data.path '", p, "': ", tokens_, " tokens, but one sample needs seq_length + 1 = ", seq + 1);
  }
  int64_t size() const override { return n_; }
  void read(int64_t index, int64_t* out) const override {
    const int64_t first = index * seq_, count = seq_ + 1;
    std::vector<uint8_t> raw(static_cast<size_t>(count * width_));
    file_.read(first * width_, count * width_, raw.data());
    for (int64_t t = 0; t < count; ++t) {
      out[t] = decode(raw.data() + t * width_);
      HP_CHECK(out[t] < vocab_, "data.path '", file_.path(), "': token at byte offset ", (first + t) * width_, " is ",
               out[t], ", not below model.vocab=", vocab_, " (the file changed while training?)");
    }
  }
  std::string describe() const override {
    return kind_ + " file, " + std::to_string(tokens_) + " tokens, " + std::to_string(n_) + " samples";
  }

 private:
  int64_t decode(const uint8_t* b) const {
    if (width_ == 1) return b[0];
    if (width_ == 2) {
      uint16_t v;
      std::memcpy(&v, b, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, b, 4);
    return v;
  }
  OpenFile file_;
  int64_t seq_, vocab_, width_ = 1, tokens_ = 0, n_ = 0;
  std::string kind_;
};

}  // namespace

std::unique_ptr<TokenDataset> make_dataset(const DataSpec& spec, int64_t seq_length, int64_t vocab,
                                           uint64_t seed) {
  if (spec.type == DataType::kSynthetic) {
    return std::make_unique<SyntheticDataset>(spec.num_samples, seq_length, vocab, seed);
  }
  return std::make_unique<FileDataset>(spec, seq_length, vocab);
}

DataSharder::DataSharder(int64_t num_samples, int64_t global_batch_size, int64_t micro_batch_num, int64_t dp_size,
                         uint64_t seed, bool shuffle)
    : n_(num_samples), g_(global_batch_size), mb_num_(micro_batch_num), dp_(dp_size), seed_(seed), shuffle_(shuffle) {
  HP_CHECK(n_ > 0 && dp_ > 0 && mb_num_ > 0 && g_ % (dp_ * mb_num_) == 0, "DataSharder: global_batch_size=", g_,
           " must be a positive multiple of dp (", dp_, ") x micro_batch_num (", mb_num_, "), samples=", n_);
  m_ = g_ / (dp_ * mb_num_);
}

int64_t DataSharder::sample_at(int64_t position) const {
  const int64_t epoch = position / n_, i = position % n_;
  if (!shuffle_ || n_ == 1) return i;
  // A random permutation of [0, n) without storing it: a 4-round Feistel network over
  // the smallest even-width power of two >= n, keyed by (seed, epoch), applied until the
  // value falls inside [0, n) (cycle walking; under 4 rounds of it on average).
  int bits = 2;
  while ((int64_t(1) << bits) < n_) bits += 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t(1) << half) - 1;
  uint64_t x = static_cast<uint64_t>(i);
  do {
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = hash(seed_ ^ 0xda7aULL, static_cast<uint64_t>(epoch) * 4 + round, r) & mask;
      const uint64_t next = l ^ f;
      l = r;
      r = next;
    }
    x = (l << half) | r;
  } while (x >= static_cast<uint64_t>(n_));
  return static_cast<int64_t>(x);
}

std::vector<int64_t> DataSharder::samples(int64_t step, int64_t micro, int64_t dp_rank) const {
  HP_CHECK(micro >= 0 && micro < mb_num_ && dp_rank >= 0 && dp_rank < dp_, "DataSharder: micro=", micro,
           " dp_rank=", dp_rank, " out of range");
  std::vector<int64_t> out(m_);
  const int64_t base = step * g_ + micro * dp_ * m_ + dp_rank * m_;
  for (int64_t i = 0; i < m_; ++i) out[i] = sample_at(base + i);
  return out;
}

std::vector<int64_t> DataSharder::global_samples(int64_t step, int64_t micro) const {
  std::vector<int64_t> out;
  for (int64_t r = 0; r < dp_; ++r) {
    auto s = samples(step, micro, r);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

at::Tensor load_batch(const TokenDataset& d, const std::vector<int64_t>& samples, int64_t seq_length) {
  at::Tensor out = at::empty({static_cast<int64_t>(samples.size()), seq_length + 1}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < samples.size(); ++i) d.read(samples[i], p + i * (seq_length + 1));
  return out;
}

}  // namespace hp::train
