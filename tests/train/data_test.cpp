// hp-train's data: the three sources read what the files hold, bad files are rejected
// with the offending offset, and the sharder gives every sample exactly once per epoch.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "hp/core/error.h"
#include "hp/train/data.h"
#include "hp/train/report.h"
#include "test_util.h"

namespace ht = hp::train;

namespace {

std::string temp_file(const std::string& name, const std::string& bytes) {
  std::string path = ::testing::TempDir() + "/hp_data_test_" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

template <typename T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string error_of(const ht::DataSpec& d, int64_t seq, int64_t vocab) {
  try {
    ht::make_dataset(d, seq, vocab, 1);
  } catch (const hp::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TrainData, BinaryFileSamplesAreConsecutiveWindows) {
  std::vector<uint16_t> toks(23);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint16_t>(1000 + i);
  ht::DataSpec d;
  d.type = ht::DataType::kBinary;
  d.path = temp_file("u16.bin", raw(toks));
  auto ds = ht::make_dataset(d, 5, 2000, 0);
  ASSERT_EQ(ds->size(), (23 - 1) / 5);  // 4 windows of 6 tokens, each starting 5 later
  at::Tensor b = ht::load_batch(*ds, {3, 0}, 5);
  for (int t = 0; t <= 5; ++t) {
    EXPECT_EQ(b[0][t].item<int64_t>(), 1000 + 15 + t);
    EXPECT_EQ(b[1][t].item<int64_t>(), 1000 + t);
  }
  std::vector<uint32_t> wide = {70000, 1, 2, 3};
  d.path = temp_file("u32.bin", raw(wide));
  d.token_dtype = ht::TokenDtype::kUint32;
  auto ds32 = ht::make_dataset(d, 3, 80000, 0);
  EXPECT_EQ(ht::load_batch(*ds32, {0}, 3)[0][0].item<int64_t>(), 70000);
}

// A file that changes under a running job: each change is named with the file and the byte
// offset (no SIGBUS from a mapping, no bare "index out of range" from the embedding).
TEST(TrainData, FileChangedWhileTrainingIsNamed) {
  std::vector<uint16_t> toks(64);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint16_t>(i % 50);
  ht::DataSpec d;
  d.type = ht::DataType::kBinary;
  const std::string bytes = raw(toks);
  auto error_reading = [&](const ht::TokenDataset& ds, int64_t sample) -> std::string {
    try {
      ht::load_batch(ds, {sample}, 7);
    } catch (const hp::Error& e) {
      return e.what();
    }
    return "";
  };
  // Truncated.
  d.path = temp_file("changing.bin", bytes);
  auto ds = ht::make_dataset(d, 7, 100, 0);
  EXPECT_EQ(error_reading(*ds, 8), "");
  std::filesystem::resize_file(d.path, 40);
  std::string e = error_reading(*ds, 8);
  EXPECT_NE(e.find("was truncated while training"), std::string::npos) << e;
  EXPECT_NE(e.find(d.path), std::string::npos) << e;
  EXPECT_NE(e.find("byte offset 112"), std::string::npos) << e;
  // Rewritten in place with tokens outside the vocabulary.
  d.path = temp_file("changing.bin", bytes);
  ds = ht::make_dataset(d, 7, 100, 0);
  {
    std::fstream f(d.path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(30);
    const uint16_t big = 5000;
    f.write(reinterpret_cast<const char*>(&big), 2);
  }
  e = error_reading(*ds, 2);  // tokens 14..21, bytes 28..43
  EXPECT_NE(e.find("token at byte offset 30 is 5000, not in [0, model.vocab=100)"), std::string::npos) << e;
  // Replaced by another file.
  d.path = temp_file("changing.bin", bytes);
  ds = ht::make_dataset(d, 7, 100, 0);
  const std::string other = temp_file("other.bin", bytes);
  std::filesystem::rename(other, d.path);
  e = error_reading(*ds, 0);
  EXPECT_NE(e.find("was replaced or removed while training"), std::string::npos) << e;
}

// Files are validated in 1 MiB chunks: a character cut by a chunk's end is whole, and an
// invalid byte past the first chunk is named at its file offset.
TEST(TrainData, TextValidatedAcrossChunkBoundaries) {
  std::string text(1 << 20, 'a');
  text.replace((1 << 20) - 1, 1, "\xc3");  // the first byte of a 2-byte character ends chunk 1
  text += "\xa9 and more text after the boundary";
  ht::DataSpec d;
  d.type = ht::DataType::kText;
  d.path = temp_file("chunks.txt", text);
  EXPECT_EQ(error_of(d, 8, 256), "");
  text += "\xff";
  d.path = temp_file("chunks_bad.txt", text);
  EXPECT_NE(error_of(d, 8, 256).find("not valid UTF-8 at byte offset " + std::to_string(text.size() - 1)),
            std::string::npos) << error_of(d, 8, 256);
}

TEST(TrainData, TextIsBytes) {
  ht::DataSpec d;
  d.type = ht::DataType::kText;
  d.path = temp_file("a.txt", "h\xc3\xa9llo!");  // "héllo!" in UTF-8: 7 bytes
  auto ds = ht::make_dataset(d, 3, 256, 0);
  ASSERT_EQ(ds->size(), 2);
  at::Tensor b = ht::load_batch(*ds, {0, 1}, 3);
  EXPECT_EQ(b[0][0].item<int64_t>(), 'h');
  EXPECT_EQ(b[0][1].item<int64_t>(), 0xc3);
  EXPECT_EQ(b[0][2].item<int64_t>(), 0xa9);
  EXPECT_EQ(b[1][0].item<int64_t>(), 'l');
}

TEST(TrainData, BadFilesNameTheProblem) {
  ht::DataSpec d;
  d.type = ht::DataType::kBinary;
  d.path = "/nonexistent/tokens.bin";
  EXPECT_NE(error_of(d, 4, 100).find("/nonexistent/tokens.bin"), std::string::npos);
  d.path = temp_file("odd.bin", std::string(7, '\1'));
  EXPECT_NE(error_of(d, 2, 1000).find("7 bytes"), std::string::npos) << error_of(d, 2, 1000);
  std::vector<uint16_t> toks = {1, 2, 300, 4, 5, 6};
  d.path = temp_file("big.bin", raw(toks));
  std::string e = error_of(d, 2, 256);
  EXPECT_NE(e.find("token 2 is 300"), std::string::npos) << e;
  EXPECT_NE(e.find("model.vocab=256"), std::string::npos) << e;
  d.path = temp_file("short.bin", raw(std::vector<uint16_t>{1, 2, 3}));
  EXPECT_NE(error_of(d, 4, 256).find("3 tokens"), std::string::npos) << error_of(d, 4, 256);
  d.path = "/tmp";
  EXPECT_NE(error_of(d, 2, 256).find("not a regular file"), std::string::npos) << error_of(d, 2, 256);
  d.type = ht::DataType::kText;
  // Each invalid sequence sits at byte offset 2: a stray byte, a truncated sequence, an
  // overlong of each length, a surrogate, beyond U+10FFFF, a lead byte past F4.
  for (const char* bad : {"ok\xff" "abc", "ok\xc3", "ok\xc0\xaf", "ok\xe0\x80\xaf", "ok\xf0\x80\x80\xaf",
                          "ok\xed\xa0\x80", "ok\xf4\x90\x80\x80", "ok\xf5\x80\x80\x80"}) {
    d.path = temp_file("bad.txt", bad);
    EXPECT_NE(error_of(d, 1, 256).find("byte offset 2"), std::string::npos) << error_of(d, 1, 256);
  }
  // The largest valid forms of each length pass: U+7FF, U+D7FF, U+FFFF, U+10FFFF.
  d.path = temp_file("good.txt", "ab\xdf\xbf\xed\x9f\xbf\xef\xbf\xbf\xf4\x8f\xbf\xbf");
  EXPECT_EQ(error_of(d, 1, 256), "");
}

// Megatron-LM's indexed dataset, written here field by field from the format's description
// (not by the reader's code): documents of several sequences, back to back in the .bin.
namespace {

struct MegatronFiles {
  std::vector<int32_t> lengths;     // tokens per sequence
  std::vector<int64_t> pointers;    // byte offset of each sequence in the .bin
  std::vector<int64_t> doc_index;   // first sequence of each document, then the count
  uint8_t dtype_code = 8;           // uint16
  uint64_t version = 1;
  std::string magic = std::string("MMIDIDX\0\0", 9);
  std::string bin;

  std::string idx() const {
    std::string out = magic;
    auto put = [&out](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
    put(&version, 8);
    put(&dtype_code, 1);
    const uint64_t seqs = lengths.size(), docs = doc_index.size();
    put(&seqs, 8);
    put(&docs, 8);
    put(lengths.data(), 4 * lengths.size());
    put(pointers.data(), 8 * pointers.size());
    put(doc_index.data(), 8 * doc_index.size());
    return out;
  }
  // Writes PREFIX.idx and PREFIX.bin; returns PREFIX.
  std::string write(const std::string& name, const std::string& idx_bytes) const {
    const std::string prefix = ::testing::TempDir() + "/hp_data_test_" + name;
    temp_file(name + ".idx", idx_bytes);
    temp_file(name + ".bin", bin);
    return prefix;
  }
  std::string write(const std::string& name) const { return write(name, idx()); }
};

// Three documents (of 2, 1 and 2 sequences) of token t = 100 + position, `width` bytes each.
template <typename T>
MegatronFiles megatron_corpus(uint8_t code) {
  MegatronFiles m;
  m.dtype_code = code;
  m.lengths = {4, 3, 5, 2, 6};
  m.doc_index = {0, 2, 3, 5};
  std::vector<T> toks;
  for (int32_t len : m.lengths) {
    m.pointers.push_back(static_cast<int64_t>(toks.size() * sizeof(T)));
    for (int32_t k = 0; k < len; ++k) toks.push_back(static_cast<T>(100 + toks.size()));
  }
  m.bin = raw(toks);
  return m;
}

}  // namespace

TEST(TrainData, MegatronIndexedDatasetReadsAsOneStream) {
  ht::DataSpec d;
  d.type = ht::DataType::kMegatron;
  // uint16 (code 8) and int32 (code 4): what preprocess_data.py writes below and above a
  // vocabulary of 65500.
  for (auto [code, name] : {std::pair<uint8_t, const char*>{8, "u16"}, {4, "i32"}}) {
    MegatronFiles m = code == 8 ? megatron_corpus<uint16_t>(code) : megatron_corpus<int32_t>(code);
    const std::string prefix = m.write(std::string("mega_") + name);
    // The prefix, or either file's path.
    for (const std::string& path : {prefix, prefix + ".bin", prefix + ".idx"}) {
      d.path = path;
      auto ds = ht::make_dataset(d, 4, 200, 0);
      ASSERT_EQ(ds->size(), (20 - 1) / 4) << path;  // 20 tokens in all
      at::Tensor b = ht::load_batch(*ds, {2, 0}, 4);
      for (int t = 0; t <= 4; ++t) {
        EXPECT_EQ(b[0][t].item<int64_t>(), 100 + 8 + t) << name;
        EXPECT_EQ(b[1][t].item<int64_t>(), 100 + t) << name;
      }
      EXPECT_NE(ds->describe().find("3 documents"), std::string::npos) << ds->describe();
    }
  }
}

TEST(TrainData, BadMegatronFilesNameTheProblem) {
  ht::DataSpec d;
  d.type = ht::DataType::kMegatron;
  const MegatronFiles good = megatron_corpus<uint16_t>(8);
  auto error_with = [&](const MegatronFiles& m, const std::string& idx_bytes) {
    d.path = m.write("mega_bad", idx_bytes);
    return error_of(d, 4, 200);
  };
  auto expect_error = [&](const MegatronFiles& m, const std::string& idx_bytes, const std::string& want) {
    const std::string e = error_with(m, idx_bytes);
    EXPECT_NE(e.find(want), std::string::npos) << "want '" << want << "' in: " << e;
    EXPECT_NE(e.find("hp_data_test_mega_bad"), std::string::npos) << "the file is not named: " << e;
  };
  EXPECT_EQ(error_with(good, good.idx()), "");
  MegatronFiles m = good;
  m.magic = std::string("MMIDIDY\0\0", 9);
  expect_error(m, m.idx(), "not a Megatron-LM indexed dataset index");
  expect_error(good, good.idx().substr(0, 20), "truncated: 20 bytes");
  expect_error(good, good.idx().substr(0, good.idx().size() - 3), "(truncated?)");
  m = good;
  m.version = 2;
  expect_error(m, m.idx(), "version 2 is not supported yet");
  m = good;
  m.dtype_code = 7;
  expect_error(m, m.idx(), "dtype code 7 is a floating type");
  m.dtype_code = 9;
  expect_error(m, m.idx(), "dtype code 9 is not one of Megatron's");
  m = good;
  m.pointers[3] += 2;
  expect_error(m, m.idx(), "sequence 3 starts at byte 26 of the .bin, but the sequences before it end at 24");
  m = good;
  m.lengths[1] = -3;
  expect_error(m, m.idx(), "sequence 1 has length -3");
  m = good;
  m.doc_index = {0, 3, 2, 5};
  expect_error(m, m.idx(), "document index entry 2 is 2 (after 3");
  m.doc_index = {0, 2, 3, 4};
  expect_error(m, m.idx(), "ends at 4, not at the sequence count 5");
  m = good;
  m.bin.pop_back();
  m.bin.pop_back();
  expect_error(m, m.idx(), "sequence 4 of 6 tokens (uint16) at byte 28 runs past the end of data.path");
  m.bin += "abcd";
  expect_error(m, m.idx(), "is 42 bytes, but its index");
  // A token past the vocabulary, named with its offset in the .bin.
  m = good;
  m.bin[2 * 7] = static_cast<char>(0xff);  // token 7 becomes 0x..ff: far above 200
  expect_error(m, m.idx(), "token 7 is ");
  // int32 tokens below 0.
  MegatronFiles neg = megatron_corpus<int32_t>(4);
  const int32_t minus = -5;
  std::memcpy(&neg.bin[4 * 2], &minus, 4);
  expect_error(neg, neg.idx(), "token 2 is -5");
}

// An index's sequences must lie inside the .bin, checked as each is read (so their sum
// cannot overflow): a length past the end, a pointer past the end, each named with the .bin
// and its size.
TEST(TrainData, MegatronSequencesStayInsideTheBin) {
  ht::DataSpec d;
  d.type = ht::DataType::kMegatron;
  const MegatronFiles good = megatron_corpus<uint16_t>(8);  // 20 tokens, 40 bytes
  auto expect_error = [&](const MegatronFiles& m, std::initializer_list<std::string> want) {
    d.path = m.write("mega_past");
    const std::string e = error_of(d, 4, 200);
    for (const std::string& w : want) EXPECT_NE(e.find(w), std::string::npos) << "want '" << w << "' in: " << e;
  };
  MegatronFiles m = good;
  m.lengths[4] = 2147483647;
  expect_error(m, {"hp_data_test_mega_past.idx", "sequence 4 of 2147483647 tokens",
                   "runs past the end of data.path '", "hp_data_test_mega_past.bin' (40 bytes)"});
  m = good;
  m.pointers[2] = int64_t(1) << 62;
  expect_error(m, {"hp_data_test_mega_past.idx", "sequence 2 starts at byte 4611686018427387904",
                   "past the end of data.path '", "hp_data_test_mega_past.bin' (40 bytes)"});
}

// A header's counts are bounded by the .bin before anything is read by them: an index can be
// a sparse file of terabytes (a hole reads as zeros: empty sequences, empty documents, all
// valid), which was read to its end (hours) before the .bin's size was looked at.
TEST(TrainData, MegatronHeaderCountsBoundedByTheBin) {
  ht::DataSpec d;
  d.type = ht::DataType::kMegatron;
  const MegatronFiles good = megatron_corpus<uint16_t>(8);  // 20 tokens
  const std::string prefix = good.write("mega_sparse");
  d.path = prefix;
  // The header and `tail` at byte `at`, a hole between.
  auto write_sparse = [&](const std::string& head, int64_t at, const std::string& tail) {
    const int fd = ::open((prefix + ".idx").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return false;
    const bool ok = ::pwrite(fd, head.data(), head.size(), 0) == static_cast<ssize_t>(head.size()) &&
                    ::pwrite(fd, tail.data(), tail.size(), at) == static_cast<ssize_t>(tail.size());
    ::close(fd);
    if (!ok) std::filesystem::remove(prefix + ".idx");
    return ok;
  };
  auto header = [&](uint64_t seqs, uint64_t docs) {
    std::string h = good.magic;
    const uint64_t version = 1;
    const uint8_t code = 8;
    h.append(reinterpret_cast<const char*>(&version), 8);
    h.append(reinterpret_cast<const char*>(&code), 1);
    h.append(reinterpret_cast<const char*>(&seqs), 8);
    h.append(reinterpret_cast<const char*>(&docs), 8);
    return h;
  };
  // 2^38 sequences (3 TiB of lengths and pointers, all a hole), then the document index [0, 2^38].
  const uint64_t many = uint64_t(1) << 38;
  const std::vector<int64_t> docs = {0, static_cast<int64_t>(many)};
  ASSERT_TRUE(write_sparse(header(many, 2), 34 + 12 * static_cast<int64_t>(many), raw(docs)))
      << "this file system cannot hold a sparse file of 3 TiB";
  std::string e = error_of(d, 4, 200);
  EXPECT_NE(e.find("274877906944 sequences"), std::string::npos) << e;
  EXPECT_NE(e.find("hp_data_test_mega_sparse.bin' holds 20 tokens"), std::string::npos) << e;
  // 5 real sequences, then 2^38 document entries (2 TiB, a hole but the last).
  std::string head = header(5, many);
  head += raw(good.lengths) + raw(good.pointers);
  ASSERT_TRUE(write_sparse(head, static_cast<int64_t>(head.size()) + 8 * static_cast<int64_t>(many - 1),
                           raw(std::vector<int64_t>{5})));
  e = error_of(d, 4, 200);
  EXPECT_NE(e.find("274877906944 document index entries"), std::string::npos) << e;
  EXPECT_NE(e.find("hp_data_test_mega_sparse.bin' holds 20 tokens"), std::string::npos) << e;
  std::filesystem::remove(prefix + ".idx");
}

TEST(TrainData, SyntheticIsDeterministicAndLearnable) {
  ht::DataSpec d;
  auto a = ht::make_dataset(d, 32, 256, 7), b = ht::make_dataset(d, 32, 256, 7), c = ht::make_dataset(d, 32, 256, 8);
  at::Tensor x = ht::load_batch(*a, {5, 9}, 32);
  EXPECT_TRUE(at::equal(x, ht::load_batch(*b, {5, 9}, 32)));
  EXPECT_FALSE(at::equal(x, ht::load_batch(*c, {5, 9}, 32)));
  EXPECT_TRUE((x >= 0).all().item<bool>() && (x < 256).all().item<bool>());
  // Learnable: each token is followed by at most 4 distinct tokens across the corpus.
  std::map<int64_t, std::set<int64_t>> next;
  at::Tensor all = ht::load_batch(*a, [] { std::vector<int64_t> v(200); for (int i = 0; i < 200; ++i) v[i] = i; return v; }(), 32);
  for (int64_t i = 0; i < all.size(0); ++i) {
    for (int64_t t = 0; t < 32; ++t) next[all[i][t].item<int64_t>()].insert(all[i][t + 1].item<int64_t>());
  }
  size_t most = 0;
  for (auto& kv : next) most = std::max(most, kv.second.size());
  EXPECT_LE(most, 4u);
  EXPECT_GT(next.size(), 100u);  // yet the corpus uses most of the vocabulary
}

// The validation set: for synthetic data eval_steps global batches of samples held out
// after the training corpus (the same chain: sample k is the larger corpus's sample
// num_samples + k); for a file, data.valid_path read as data.type, its errors naming that
// key; an evaluation's batch count checked against what the set holds.
TEST(TrainData, ValidationSetIsHeldOutOrItsOwnFile) {
  ht::TrainConfig c = ht::parse_config(
      "data:\n  num_samples: 20\neval_interval: 3\neval_steps: 2\nglobal_batch_size: 4\nseq_length: 16\n");
  c.validate(1);
  auto valid = ht::make_validation_dataset(c);
  ASSERT_EQ(valid->size(), 8);
  EXPECT_EQ(ht::validation_batches(c, *valid), 2);
  ht::DataSpec larger = c.data;
  larger.num_samples = 28;
  auto corpus = ht::make_dataset(larger, 16, c.model->vocab(), c.seed);
  for (int64_t k = 0; k < 8; ++k) {
    EXPECT_TRUE(at::equal(ht::load_batch(*valid, {k}, 16), ht::load_batch(*corpus, {20 + k}, 16))) << k;
  }
  EXPECT_NE(valid->describe().find("held out"), std::string::npos) << valid->describe();

  // A file: 3 samples of 16 + 1 tokens (49 tokens).
  std::vector<uint16_t> toks(49);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint16_t>(i % 200);
  const std::string train = temp_file("train.bin", raw(toks)), held = temp_file("valid.bin", raw(toks));
  ht::TrainConfig f = ht::parse_config("data:\n  type: binary\n  path: " + train + "\n  valid_path: " + held +
                                       "\neval_interval: 3\neval_steps: 0\nglobal_batch_size: 2\nseq_length: 16\n");
  f.validate(1);
  auto fv = ht::make_validation_dataset(f);
  EXPECT_EQ(fv->size(), 3);
  EXPECT_EQ(ht::validation_batches(f, *fv), 1) << "all whole batches: 3 samples hold one of 2";
  f.eval_steps = 2;
  hp::test::expect_error([&] { ht::validation_batches(f, *fv); },
                         {"eval_steps=2", "4 validation samples", held, "holds 3"});
  f.eval_steps = 0;
  f.global_batch_size = 4;
  hp::test::expect_error([&] { ht::validation_batches(f, *fv); }, {held, "fewer than one global batch"});
  // Its errors name data.valid_path, not data.path.
  toks[30] = 60000;
  f.data.valid_path = temp_file("valid_bad.bin", raw(toks));
  hp::test::expect_error([&] { ht::make_validation_dataset(f); },
                         {"data.valid_path '" + f.data.valid_path + "'", "token 30 is 60000"});
  f.data.valid_path = ::testing::TempDir() + "/hp_data_test_missing.bin";
  hp::test::expect_error([&] { ht::make_validation_dataset(f); }, {"data.valid_path '", "cannot open"});
}

// Every sample exactly once per epoch, the ranks' micro-batches partition the global
// batch, and rank r's part is the r-th slice of a single process's micro-batch.
TEST(TrainData, SharderGivesEachSampleOncePerEpoch) {
  for (bool shuffle : {true, false}) {
    const int64_t N = 36, G = 8, M = 2, dp = 2;  // 36 samples: epochs end mid-step; 64-wide domain
    ht::DataSharder s(N, G, M, dp, 3, shuffle);
    std::vector<int64_t> stream;
    for (int64_t step = 0; step < 9; ++step) {  // 72 positions: two whole epochs
      for (int64_t j = 0; j < M; ++j) {
        std::vector<int64_t> glob = s.global_samples(step, j);
        std::vector<int64_t> joined;
        for (int64_t r = 0; r < dp; ++r) {
          auto part = s.samples(step, j, r);
          EXPECT_EQ(static_cast<int64_t>(part.size()), G / (M * dp));
          joined.insert(joined.end(), part.begin(), part.end());
        }
        EXPECT_EQ(joined, glob);
        stream.insert(stream.end(), glob.begin(), glob.end());
      }
    }
    ASSERT_EQ(stream.size(), 72u);
    for (int e = 0; e < 2; ++e) {
      std::set<int64_t> seen(stream.begin() + e * N, stream.begin() + (e + 1) * N);
      EXPECT_EQ(seen.size(), static_cast<size_t>(N)) << "epoch " << e;
      EXPECT_EQ(*seen.begin(), 0);
      EXPECT_EQ(*seen.rbegin(), N - 1);
    }
    const bool reordered = !std::equal(stream.begin(), stream.begin() + N, stream.begin() + N);
    EXPECT_EQ(reordered, shuffle);
  }
  // Large corpora cost no memory: a permutation of 10^12 samples, checked on a window.
  ht::DataSharder big(1000000000000, 4, 1, 1, 5, true);
  std::set<int64_t> seen;
  for (int64_t p = 0; p < 1000; ++p) {
    int64_t x = big.sample_at(p);
    EXPECT_TRUE(x >= 0 && x < 1000000000000);
    seen.insert(x);
  }
  EXPECT_EQ(seen.size(), 1000u);
  // Every size from 1 to 70 is a permutation (odd powers of two, n = 1, exact powers).
  for (int64_t n = 1; n <= 70; ++n) {
    ht::DataSharder s(n, 1, 1, 1, 9, true);
    std::set<int64_t> all;
    for (int64_t p = 0; p < n; ++p) all.insert(s.sample_at(p));
    EXPECT_EQ(static_cast<int64_t>(all.size()), n);
    EXPECT_EQ(*all.rbegin(), n - 1);
  }
}

TEST(TrainReport, LinesAndFiles) {
  ht::StepStats st;
  st.step = 3;
  st.loss = 2.5;
  st.lr = 1e-3;
  st.grad_norm = 0.5;
  st.tokens_per_s = 12345;
  st.peak_bytes = 3 << 20;
  std::string line = ht::progress_line(st, 50, 65, 2.5001, 2.75);
  for (const char* want : {"step  3/50", "loss 2.5000", "lr 1.00e-03", "grad norm 0.500", "12.3k tok/s",
                           "peak 3.0 MiB", "ETA 1:05", "valid 2.7500", "ref diff 1.0e-04"}) {
    EXPECT_NE(line.find(want), std::string::npos) << line << " lacks " << want;
  }
  EXPECT_EQ(ht::progress_line(st, 50, 65, std::nan(""), std::nan("")).find("valid"), std::string::npos);
  ht::EvalStats ev;
  ev.step = 4;
  ev.loss = std::log(20.0);
  ev.perplexity = 20;
  ev.tokens = 4096;
  ev.seconds = 1.2;
  const std::string eline = ht::eval_line(ev, 50, std::nan(""));
  EXPECT_EQ(eline, "validation after step 4/50 | loss 2.9957 | ppl 20.00 | 4.1k tokens in 0:01") << eline;
  EXPECT_EQ(ht::format_duration(3723), "1:02:03");
  std::string jsonl = ::testing::TempDir() + "/hp_metrics.jsonl", svg = ::testing::TempDir() + "/hp_loss.svg";
  std::remove(jsonl.c_str());
  std::remove(svg.c_str());
  {
    ht::MetricsLog m(jsonl);
    m.step(st, std::nan(""));
    m.eval(ev, 3.0);
    m.summary({{"final_loss", 2.5}, {"bad", std::nan("")}});
    EXPECT_FALSE(std::ifstream(jsonl).good()) << "the final name appeared before the log was finished";
    m.finish();
  }
  std::ifstream f(jsonl);
  std::string l1, le, l2;
  std::getline(f, l1);
  std::getline(f, le);
  std::getline(f, l2);
  EXPECT_EQ(l1.rfind("{\"step\":3,\"loss\":2.5,", 0), 0u) << l1;
  EXPECT_EQ(l1.find("reference_loss"), std::string::npos);
  EXPECT_EQ(le, "{\"eval\":{\"step\":4,\"loss\":2.99573227,\"perplexity\":20,\"tokens\":4096,\"seconds\":1.2,"
                "\"reference_loss\":3}}");
  EXPECT_EQ(l2, "{\"summary\":{\"final_loss\":2.5,\"bad\":null}}");
  ht::LossCurve curve;
  curve.loss = {3, 2, 1};
  curve.reference = {3, 2.1, 1.1};
  curve.validation = {{2, 2.5}, {3, 1.5}};
  ht::write_loss_svg(svg, curve, "a <b>");
  std::ifstream g(svg);
  std::string text((std::istreambuf_iterator<char>(g)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("<svg", 0), 0u);
  EXPECT_NE(text.find("a &lt;b&gt;"), std::string::npos);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n') > 10, true);
  EXPECT_NE(text.find("stroke-dasharray"), std::string::npos);  // the reference curve
  // The two validation points, each a marker.
  size_t circles = 0;
  for (size_t at = text.find("<circle"); at != std::string::npos; at = text.find("<circle", at + 1)) ++circles;
  EXPECT_EQ(circles, 2u);
  EXPECT_NE(text.find(">validation<"), std::string::npos);
  EXPECT_THROW(ht::MetricsLog("/nonexistent/dir/m.jsonl"), hp::Error);
}
