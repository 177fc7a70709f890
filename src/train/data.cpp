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
#include "hp/core/untrusted.h"

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
  // Samples [first, first + samples) of the corpus the seed defines (a held-out validation
  // set starts after the training samples: the same chain, samples never trained on).
  SyntheticDataset(int64_t samples, int64_t seq, int64_t vocab, uint64_t seed, int64_t first = 0)
      : n_(samples), first_(first), seq_(seq), vocab_(vocab), seed_(seed) {}
  int64_t size() const override { return n_; }
  void read(int64_t index, int64_t* out) const override {
    index += first_;
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
    if (first_ == 0) return "synthetic Markov corpus, " + std::to_string(n_) + " samples";
    return "synthetic Markov corpus, samples " + std::to_string(first_) + " to " + std::to_string(first_ + n_ - 1) +
           " (held out)";
  }

 private:
  int64_t n_, first_, seq_, vocab_;
  uint64_t seed_;
};

// An open file read with pread: never mapped, so a file truncated while training gives a
// short read (named) rather than SIGBUS. The size and identity (device, inode) seen at open
// are checked again at every read.
class OpenFile {
 public:
  // `key`: the config key naming it in errors (data.path, data.valid_path).
  OpenFile(const std::string& path, std::string key) : path_(path), key_(std::move(key)) {
    fd_ = files::open_regular(path, key_);  // a FIFO refused, not waited on
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      throw Error(named() + ": cannot stat: " + std::strerror(err));
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
  std::string named() const { return key_ + " '" + path_ + "'"; }

  // Reads n bytes at `offset`; raises naming the file and the offset when the file changed
  // (truncated, replaced) since it was opened, or the read fails.
  void read(int64_t offset, int64_t n, uint8_t* out) const {
    struct stat now;
    HP_CHECK(::fstat(fd_, &now) == 0, named(), ": cannot stat: ", std::strerror(errno));
    HP_CHECK(now.st_size >= size_, named(), " was truncated while training: ", size_,
             " bytes when opened, ", now.st_size, " now (reading byte offset ", offset, ")");
    struct stat by_name;
    HP_CHECK(::stat(path_.c_str(), &by_name) == 0 && by_name.st_dev == dev_ && by_name.st_ino == ino_,
             named(), " was replaced or removed while training (reading byte offset ", offset, ")");
    int64_t done = 0;
    while (done < n) {
      ssize_t r = ::pread(fd_, out + done, static_cast<size_t>(n - done), static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      HP_CHECK(r >= 0, named(), ": read at byte offset ", offset + done, " failed: ", std::strerror(errno));
      HP_CHECK(r > 0, named(), " ended at byte offset ", offset + done, " while reading ", n,
               " bytes at ", offset, " (truncated while training?)");
      done += r;
    }
  }

 private:
  std::string path_, key_;
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

// Token ids from a file: bytes (text), or integers of 1, 2, 4 or 8 bytes, unsigned or
// signed (binary: uint16 or uint32; megatron: its index's dtype). Validated whole at open
// (UTF-8 for text, every token in [0, vocab) otherwise), then read sample by sample, each
// token checked again as it is read (the file may be rewritten while training).
struct TokenFormat {
  int64_t width = 1;
  bool is_signed = false;
  std::string name;  // "uint16", ...
};

class FileDataset : public TokenDataset {
 public:
  FileDataset(const std::string& path, const std::string& key, DataType type, TokenFormat format, int64_t seq,
              int64_t vocab, std::string what)
      : file_(path, key), seq_(seq), vocab_(vocab), width_(format.width), signed_(format.is_signed), what_(std::move(what)) {
    HP_CHECK(file_.size() % width_ == 0, file_.named(), ": ", file_.size(), " bytes is not a whole number of ",
             format.name, " tokens");
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
      if (type == DataType::kText) {
        int64_t bad = invalid_utf8_at(buf.data(), buf.size());
        if (bad >= 0 && !last && bad + 4 > static_cast<int64_t>(buf.size())) {
          buf.erase(buf.begin(), buf.begin() + bad);  // may complete in the next chunk
          base += bad;
          continue;
        }
        HP_CHECK(bad < 0, file_.named(), ": not valid UTF-8 at byte offset ", base + bad);
      } else {
        for (size_t i = 0; i + width_ <= buf.size(); i += static_cast<size_t>(width_)) {
          int64_t t = decode(buf.data() + i);
          HP_CHECK(t >= 0 && t < vocab, file_.named(), ": token ", (base + static_cast<int64_t>(i)) / width_,
                   " is ", t, " (byte offset ", base + static_cast<int64_t>(i), "), not in [0, model.vocab=", vocab,
                   ")");
        }
      }
      base += static_cast<int64_t>(buf.size());
      buf.clear();
    }
    n_ = tokens_ > seq ? (tokens_ - 1) / seq : 0;
    HP_CHECK(n_ > 0, file_.named(), ": ", tokens_, " tokens, but one sample needs seq_length + 1 = ", seq + 1);
  }
  int64_t size() const override { return n_; }
  void read(int64_t index, int64_t* out) const override {
    const int64_t first = index * seq_, count = seq_ + 1;
    std::vector<uint8_t> raw(static_cast<size_t>(count * width_));
    file_.read(first * width_, count * width_, raw.data());
    for (int64_t t = 0; t < count; ++t) {
      out[t] = decode(raw.data() + t * width_);
      HP_CHECK(out[t] >= 0 && out[t] < vocab_, file_.named(), ": token at byte offset ",
               (first + t) * width_, " is ", out[t], ", not in [0, model.vocab=", vocab_,
               ") (the file changed while training?)");
    }
  }
  std::string describe() const override {
    return what_ + ", " + std::to_string(tokens_) + " tokens, " + std::to_string(n_) + " samples";
  }

 private:
  int64_t decode(const uint8_t* b) const {
    switch (width_) {
      case 1:
        return signed_ ? static_cast<int64_t>(static_cast<int8_t>(b[0])) : b[0];
      case 2: {
        uint16_t v;
        std::memcpy(&v, b, 2);
        return signed_ ? static_cast<int64_t>(static_cast<int16_t>(v)) : v;
      }
      case 4: {
        uint32_t v;
        std::memcpy(&v, b, 4);
        return signed_ ? static_cast<int64_t>(static_cast<int32_t>(v)) : v;
      }
      default: {
        int64_t v;  // int64 only: Megatron has no uint64
        std::memcpy(&v, b, 8);
        return v;
      }
    }
  }
  OpenFile file_;
  int64_t seq_, vocab_, width_ = 1;
  bool signed_ = false;
  int64_t tokens_ = 0, n_ = 0;
  std::string what_;
};

// Megatron-LM's index (PREFIX.idx): the 9-byte magic "MMIDIDX\0\0", a uint64 version (1), a
// uint8 dtype code, uint64 sequence and document-index counts, then int32 sequence lengths
// (tokens), int64 sequence pointers (bytes into PREFIX.bin) and int64 document indices (the
// first sequence of each document, then the sequence count). All little-endian. Read
// against the .bin's size: the header's counts are bounded by its tokens before anything is
// read by them (a sparse .idx of terabytes reads as zeros, valid empty sequences and
// documents, for hours), and each sequence must end inside it (so their sum cannot overflow).
struct MegatronIndex {
  TokenFormat format;
  int64_t sequences = 0, documents = 0, bin_bytes = 0;
};

MegatronIndex read_megatron_index(const std::string& idx, const OpenFile& bin, const std::string& key) {
  OpenFile f(idx, key);
  constexpr int64_t kHeader = 9 + 8 + 1 + 8 + 8;
  const std::string where = key + ": Megatron index '" + idx + "'";
  HP_CHECK(f.size() >= kHeader, where, " is truncated: ", f.size(), " bytes, its header alone is ", kHeader);
  uint8_t h[kHeader];
  f.read(0, kHeader, h);
  HP_CHECK(std::memcmp(h, "MMIDIDX\0\0", 9) == 0, where,
           " is not a Megatron-LM indexed dataset index (its first bytes are not MMIDIDX\\0\\0)");
  auto u64 = [&](int64_t at) {
    uint64_t v;
    std::memcpy(&v, h + at, 8);
    return v;
  };
  const uint64_t version = u64(9);
  HP_CHECK(version == 1, where, ": version ", version, " is not supported yet (version 1 is)");
  MegatronIndex m;
  const int code = h[17];
  static const std::vector<std::pair<int, TokenFormat>> kCodes = {
      {1, {1, false, "uint8"}}, {2, {1, true, "int8"}},  {3, {2, true, "int16"}},
      {4, {4, true, "int32"}},  {5, {8, true, "int64"}}, {8, {2, false, "uint16"}}};
  bool known = false;
  for (const auto& [c, fmt] : kCodes) {
    if (c == code) {
      m.format = fmt;
      known = true;
    }
  }
  HP_CHECK(known, where, ": dtype code ", code,
           code == 6 || code == 7 ? " is a floating type, not token ids"
                                  : " is not one of Megatron's (1-5, 8: uint8, int8, int16, int32, int64, uint16)");
  const uint64_t seqs = u64(18), docs = u64(26);
  // Bounded first, so the sizes below cannot overflow.
  HP_CHECK(seqs < (uint64_t(1) << 40) && docs < (uint64_t(1) << 40), where, ": ", seqs, " sequences and ", docs,
           " document entries cannot be right (a damaged header?)");
  // Megatron's tools write no empty sequence, and an empty document per empty text: more of
  // either than the .bin has tokens is no dataset they wrote.
  const int64_t tokens = bin.size() / m.format.width;
  HP_CHECK(seqs <= static_cast<uint64_t>(tokens) && docs <= static_cast<uint64_t>(tokens) + 1, where, ": ", seqs,
           " sequences and ", docs, " document index entries, but ", bin.named(), " holds ", tokens, " tokens (",
           bin.size(), " bytes of ", m.format.name, "): more than it has tokens (a damaged header?)");
  m.sequences = static_cast<int64_t>(seqs);
  const int64_t need = kHeader + 12 * m.sequences + 8 * static_cast<int64_t>(docs);
  HP_CHECK(f.size() != need + m.sequences || m.sequences == 0, where,
           ": per-sequence modes (a multimodal index) are not supported yet");
  HP_CHECK(f.size() == need, where, ": ", f.size(), " bytes, but its header's ", seqs, " sequences and ", docs,
           " document entries take ", need, (f.size() < need ? " (truncated?)" : ""));
  HP_CHECK(docs >= 1, where, ": no document index entries (at least the final one, ", seqs, ", is needed)");
  // The sequences back to back, in order: pointer i = the bytes of sequences before it.
  constexpr int64_t kChunk = int64_t(1) << 16;
  const int64_t lengths_at = kHeader, pointers_at = kHeader + 4 * m.sequences;
  int64_t expect = 0;
  for (int64_t i0 = 0; i0 < m.sequences; i0 += kChunk) {
    const int64_t n = std::min(kChunk, m.sequences - i0);
    std::vector<int32_t> len(static_cast<size_t>(n));
    std::vector<int64_t> ptr(static_cast<size_t>(n));
    f.read(lengths_at + 4 * i0, 4 * n, reinterpret_cast<uint8_t*>(len.data()));
    f.read(pointers_at + 8 * i0, 8 * n, reinterpret_cast<uint8_t*>(ptr.data()));
    for (int64_t k = 0; k < n; ++k) {
      const int64_t l = len[static_cast<size_t>(k)], p = ptr[static_cast<size_t>(k)], i = i0 + k;
      HP_CHECK(l >= 0, where, ": sequence ", i, " has length ", l);
      HP_CHECK(p >= 0 && p <= bin.size(), where, ": sequence ", i, " starts at byte ", p, ", past the end of ",
               bin.named(), " (", bin.size(), " bytes)");
      HP_CHECK(p == expect, where, ": sequence ", i, " starts at byte ", p,
               " of the .bin, but the sequences before it end at ", expect,
               " (sequences not stored back to back, in order, are not supported yet)");
      // expect <= bin.size(): what is left cannot go negative, nor the sum past it.
      HP_CHECK(l <= (bin.size() - expect) / m.format.width, where, ": sequence ", i, " of ", l, " tokens (", m.format.name,
               ") at byte ", p, " runs past the end of ", bin.named(), " (", bin.size(), " bytes)");
      expect += l * m.format.width;
    }
  }
  m.bin_bytes = expect;
  // Document starts: from 0, never decreasing, ending at the sequence count.
  const int64_t docs_at = pointers_at + 8 * m.sequences, D = static_cast<int64_t>(docs);
  int64_t prev = 0;
  for (int64_t i0 = 0; i0 < D; i0 += kChunk) {
    const int64_t n = std::min(kChunk, D - i0);
    std::vector<int64_t> d(static_cast<size_t>(n));
    f.read(docs_at + 8 * i0, 8 * n, reinterpret_cast<uint8_t*>(d.data()));
    for (int64_t k = 0; k < n; ++k) {
      const int64_t v = d[static_cast<size_t>(k)], at = i0 + k;
      HP_CHECK(at > 0 || v == 0, where, ": the document index starts at ", v, ", not 0");
      HP_CHECK(v >= prev && v <= m.sequences, where, ": document index entry ", at, " is ", v,
               " (after ", prev, "; there are ", m.sequences, " sequences)");
      HP_CHECK(at < D - 1 || v == m.sequences, where, ": the document index ends at ", v, ", not at the sequence count ",
               m.sequences);
      prev = v;
    }
  }
  m.documents = D - 1;
  return m;
}

// PREFIX for a data.path of PREFIX, PREFIX.bin or PREFIX.idx.
std::string megatron_prefix(const std::string& path) {
  for (const char* ext : {".bin", ".idx"}) {
    const size_t n = std::strlen(ext);
    if (path.size() > n && path.compare(path.size() - n, n, ext) == 0) return path.substr(0, path.size() - n);
  }
  return path;
}

std::unique_ptr<TokenDataset> megatron_dataset(const std::string& path, const std::string& key, int64_t seq,
                                               int64_t vocab) {
  const std::string prefix = megatron_prefix(path);
  const std::string bin = prefix + ".bin";
  MegatronIndex m;
  {
    OpenFile f(bin, key);
    m = read_megatron_index(prefix + ".idx", f, key);
    HP_CHECK(f.size() == m.bin_bytes, key, ": Megatron data '", bin, "' is ", f.size(), " bytes, but its index '",
             prefix, ".idx' describes ", m.bin_bytes, " (", m.sequences, " sequences of ", m.format.name, ")");
  }
  return std::make_unique<FileDataset>(bin, key, DataType::kMegatron, m.format, seq, vocab,
                                       "megatron indexed dataset " + prefix + " (" + std::to_string(m.documents) +
                                           " documents, " + m.format.name + ")");
}

// A file of `spec.type` at `path`, its errors naming `key`.
std::unique_ptr<TokenDataset> file_dataset(const DataSpec& spec, const std::string& path, const std::string& key,
                                           int64_t seq_length, int64_t vocab) {
  if (spec.type == DataType::kMegatron) return megatron_dataset(path, key, seq_length, vocab);
  TokenFormat format{1, false, "byte"};
  if (spec.type == DataType::kBinary) {
    format = spec.token_dtype == TokenDtype::kUint32 ? TokenFormat{4, false, "uint32"} : TokenFormat{2, false, "uint16"};
  }
  return std::make_unique<FileDataset>(path, key, spec.type, format, seq_length, vocab, to_string(spec.type) + " file");
}

}  // namespace

std::unique_ptr<TokenDataset> make_dataset(const DataSpec& spec, int64_t seq_length, int64_t vocab,
                                           uint64_t seed) {
  if (spec.type == DataType::kSynthetic) {
    return std::make_unique<SyntheticDataset>(spec.num_samples, seq_length, vocab, seed);
  }
  return file_dataset(spec, spec.path, "data.path", seq_length, vocab);
}

std::unique_ptr<TokenDataset> make_validation_dataset(const TrainConfig& c) {
  HP_CHECK(c.eval_interval > 0, "make_validation_dataset: eval_interval=0 (no validation)");
  if (c.data.type == DataType::kSynthetic) {
    HP_CHECK(c.eval_steps > 0, "make_validation_dataset: synthetic data needs eval_steps > 0 (validate the config)");
    return std::make_unique<SyntheticDataset>(c.eval_steps * c.global_batch_size, c.seq_length, c.model->vocab(),
                                              c.seed, /*first=*/c.data.num_samples);
  }
  return file_dataset(c.data, c.data.valid_path, "data.valid_path", c.seq_length, c.model->vocab());
}

int64_t validation_batches(const TrainConfig& c, const TokenDataset& valid) {
  const int64_t G = c.global_batch_size, n = valid.size();
  if (c.eval_steps == 0) {
    HP_CHECK(n >= G, "data.valid_path '", c.data.valid_path, "': ", n, " samples of seq_length + 1 = ",
             c.seq_length + 1, " tokens, fewer than one global batch (global_batch_size=", G, ")");
    return n / G;
  }
  HP_CHECK(c.eval_steps <= n / G, "eval_steps=", c.eval_steps, " global batches of ", G, " samples need ",
           c.eval_steps * G, " validation samples, but data.valid_path '", c.data.valid_path, "' holds ", n,
           " (of seq_length + 1 = ", c.seq_length + 1, " tokens)");
  return c.eval_steps;
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
