// The safetensors layer: round trips bit for bit, every malformed file named, a fuzzed
// header never crashes, and files that Hugging Face's own `safetensors` package reads and
// writes (when a Python with it is given in HP_TEST_PYTHON).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>

#include "hp/ckpt/safetensors.h"
#include "hp/core/error.h"
#include "test_util.h"

namespace hc = hp::ckpt;

namespace {

std::string temp_path(const std::string& name) { return ::testing::TempDir() + "/hp_st_" + name; }

std::vector<std::pair<std::string, at::Tensor>> sample_tensors() {
  at::manual_seed(5);
  return {{"w", at::randn({3, 4})},
          {"b16", at::randn({5}).to(at::kBFloat16)},
          {"ids", at::arange(6, at::kLong).view({2, 3})},
          {"mask", at::rand({4}) > 0.5},
          {"scalar", at::tensor(2.5, at::kDouble)},
          {"empty", at::empty({0, 3})},
          {"strided", at::randn({4, 4}).t()}};  // written contiguous
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A file from a header and a data section, both given as text.
std::string raw_file(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>(n >> (8 * k));
  return out + json + data;
}

std::string parse_error(const std::string& bytes) {
  try {
    hc::parse_header("f.safetensors", reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                     static_cast<int64_t>(bytes.size()));
  } catch (const hp::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, RoundTripIsBitwise) {
  const std::string path = temp_path("round.safetensors");
  auto tensors = sample_tensors();
  hc::write_file(path, tensors, {{"step", "12"}, {"note", "quote \" and \\ and \n"}});
  EXPECT_FALSE(std::ifstream(path + ".partial").good()) << "the temporary file was left";
  hc::SafetensorsHeader h = hc::read_header(path);
  EXPECT_EQ(h.metadata.at("step"), "12");
  EXPECT_EQ(h.metadata.at("note"), "quote \" and \\ and \n");
  EXPECT_EQ(h.data_start % 8, 0);
  ASSERT_EQ(h.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    at::Tensor got = hc::read_tensor(path, h, name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), t.sizes()) << name;
    EXPECT_TRUE(at::equal(got, t.contiguous())) << name;
  }
  hp::test::expect_error([&] { hc::read_tensor(path, h, "nope"); }, {"no tensor named 'nope'"});
  hp::test::expect_error([&] { hc::write_file(path, {{"a", at::ones({1})}, {"a", at::ones({1})}}); },
                         {"tensor 'a' is given twice"});
}

TEST(Safetensors, MalformedFilesAreNamed) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(parse_error(raw_file(ok, std::string(8, '\0'))), "");
  struct Case {
    std::string bytes;
    std::vector<std::string> expect;
  };
  std::string long_len = raw_file(ok, std::string(8, '\0'));
  long_len[0] = '\x7f';
  const std::vector<Case> cases = {
      {"abc", {"too short"}},
      {long_len, {"header length 127 runs past the end"}},
      {raw_file("{\"a\":", ""), {"not valid safetensors JSON", "ends early"}},
      {raw_file(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
       {"tensor 'a' has dtype 'F33'"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')),
       {"tensor 'a' is F32 of shape [3] (12 bytes)", "hold 8"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, '\0')),
       {"tensor 'a' ends at data byte 8, past the 4-byte data section"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                std::string(8, '\0')),
       {"overlaps"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0')),
       {"data bytes [0, 4) belong to no tensor"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                std::string(8, '\0')),
       {"tensor 'a' is named twice"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, '\0')),
       {"a negative number"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, '\0')),
       {"run backwards"}},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, '\0')), {"lacks dtype, shape or data_offsets"}},
      {raw_file(ok + "x", std::string(8, '\0')), {"bytes after its JSON object"}},
  };
  for (const auto& c : cases) {
    std::string e = parse_error(c.bytes);
    ASSERT_FALSE(e.empty()) << "accepted: " << c.bytes.substr(8);
    EXPECT_NE(e.find("f.safetensors"), std::string::npos) << e;
    for (const auto& want : c.expect) EXPECT_NE(e.find(want), std::string::npos) << e << "\nlacks: " << want;
  }
  // A file cut short on disk: named by read_header.
  const std::string path = temp_path("cut.safetensors");
  hc::write_file(path, sample_tensors());
  std::string bytes = file_bytes(path);
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 3));
  }
  hp::test::expect_error([&] { hc::read_header(path); }, {path, "past the"});
}

// Random corruptions of a valid file: each is either accepted with every invariant intact
// or rejected with hp::Error; nothing else (a crash fails the whole test binary).
TEST(Safetensors, FuzzedHeadersNeverCrash) {
  const std::string path = temp_path("fuzz.safetensors");
  hc::write_file(path, sample_tensors(), {{"k", "v"}});
  const std::string good = file_bytes(path);
  std::mt19937_64 rng(123);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string b = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const size_t limit = std::min<size_t>(b.size(), 8 + 400);  // mostly the header
      switch (rng() % 4) {
        case 0: b[rng() % limit] = static_cast<char>(rng()); break;
        case 1: b[rng() % limit] ^= static_cast<char>(1u << (rng() % 8)); break;
        case 2: b.resize(rng() % (b.size() + 1)); break;
        case 3: b.insert(b.begin() + static_cast<long>(rng() % (b.size() + 1)), static_cast<char>(rng())); break;
      }
      if (b.empty()) break;
    }
    try {
      hc::SafetensorsHeader h = hc::parse_header("fuzz", reinterpret_cast<const uint8_t*>(b.data()), b.size(),
                                                 static_cast<int64_t>(b.size()));
      int64_t at = 0;
      for (const auto& t : h.tensors) {
        ASSERT_EQ(t.begin, at);
        at = t.end;
      }
      ASSERT_EQ(h.data_start + at, static_cast<int64_t>(b.size()));
      ++accepted;
    } catch (const hp::Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 10000);
  EXPECT_GT(accepted, 0);  // e.g. a changed metadata character
}

// Interchange with Hugging Face's safetensors package: it loads what we write with the same
// values, and we load what it writes. Needs a Python with safetensors and numpy in
// HP_TEST_PYTHON (tests/ckpt/interop.sh makes one); skipped otherwise.
TEST(Safetensors, HuggingFacePackageReadsAndWritesTheSameFiles) {
  const char* py = std::getenv("HP_TEST_PYTHON");
  if (py == nullptr || *py == '\0') GTEST_SKIP() << "HP_TEST_PYTHON not set (tests/ckpt/interop.sh sets it)";
  const std::string ours = temp_path("ours.safetensors"), theirs = temp_path("theirs.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> ts = {{"w", at::arange(12, at::kFloat).view({3, 4}) / 7},
                                                        {"ids", at::arange(5, at::kLong) * 3},
                                                        {"d", at::tensor({1.25, -2.5}, at::kDouble)}};
  hc::write_file(ours, ts, {{"format", "pt"}});
  const std::string script = temp_path("interop.py");
  {
    std::ofstream f(script);
    f << "import sys, numpy as np\n"
         "from safetensors.numpy import load_file, save_file\n"
         "t = load_file(sys.argv[1])\n"
         "assert np.array_equal(t['w'], (np.arange(12, dtype=np.float32).reshape(3, 4) / np.float32(7))), t['w']\n"
         "assert t['ids'].dtype == np.int64 and list(t['ids']) == [0, 3, 6, 9, 12]\n"
         "assert list(t['d']) == [1.25, -2.5]\n"
         "save_file({'x': np.arange(6, dtype=np.float32).reshape(2, 3) * 0.5, 'y': np.array([7, 8], dtype=np.int32)},"
         " sys.argv[2], metadata={'from': 'safetensors'})\n";
  }
  const std::string cmd = std::string(py) + " " + script + " " + ours + " " + theirs;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  hc::SafetensorsHeader h = hc::read_header(theirs);
  EXPECT_EQ(h.metadata.at("from"), "safetensors");
  EXPECT_TRUE(at::equal(hc::read_tensor(theirs, h, "x"), at::arange(6, at::kFloat).view({2, 3}) * 0.5));
  EXPECT_TRUE(at::equal(hc::read_tensor(theirs, h, "y"), at::tensor({7, 8}, at::kInt)));
}
