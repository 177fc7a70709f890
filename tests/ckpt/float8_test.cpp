// FP8 weights with block scales (hp/ckpt/float8.h): the float8_e4m3fn decoding of all 256
// bytes against the format's definition worked out here bit by bit (and, when the ctest entry
// float8_torch_test gives HP_TEST_FLOAT8_REFERENCE, against PyTorch 2.11's own
// float8_e4m3fn); rounding to the nearest code; config.json's quantization_config; and
// load_consolidated of a folder written byte by byte here (F8_E4M3 weights whose shapes 128
// does not divide, fp32 scales), whole and in boxes, against a dequantization written in the
// test, with every damaged or missing piece named.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

#include "hp/ckpt/consolidated.h"
#include "hp/ckpt/float8.h"
#include "hp/ckpt/safetensors.h"
#include "hp/core/error.h"
#include "hp/core/files.h"
#include "hp/mesh/shard_spec.h"

namespace hc = hp::ckpt;

// std::filesystem's remove_all crashes under PyTorch 2.x's libtorch (hp/core/files.h).
#define ASSERT_FOLDER(error) \
  do {                       \
    const std::string e = (error); \
    if (!e.empty()) throw std::runtime_error(e); \
  } while (0)

namespace {

// The definition, as fp32 bit patterns: a normal byte s eeee mmm is 2^(e-7) x 1.mmm, so its
// fp32 exponent field is e - 7 + 127 and its mantissa mmm followed by 20 zero bits; a
// subnormal (e = 0) is mmm x 2^-9, exact in fp32; 0x7f and 0xff are NaN.
uint32_t reference_bits(int b) {
  const uint32_t sign = static_cast<uint32_t>(b >> 7) << 31;
  const int e = (b >> 3) & 0xF, m = b & 7;
  if (e == 0xF && m == 7) return sign | 0x7FC00000u;
  if (e != 0) return sign | static_cast<uint32_t>(e - 7 + 127) << 23 | static_cast<uint32_t>(m) << 20;
  const float v = static_cast<float>(m) / 512.0f;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return sign | bits;
}

float reference_value(int b) {
  const uint32_t bits = reference_bits(b);
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

// A safetensors file written byte by byte: (name, dtype string, shape, raw bytes).
struct Raw {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
void write_raw(const std::string& path, const std::vector<Raw>& tensors) {
  std::string json = "{", data;
  for (const Raw& t : tensors) {
    json += std::string(json.size() > 1 ? "," : "") + "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) json += (d ? "," : "") + std::to_string(t.shape[d]);
    json += "],\"data_offsets\":[" + std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) +
            "]}";
    data += t.bytes;
  }
  json += "}";
  std::string out(8, '\0');
  for (int k = 0; k < 8; ++k) out[static_cast<size_t>(k)] = static_cast<char>(static_cast<uint64_t>(json.size()) >> (8 * k));
  std::ofstream(path, std::ios::binary) << out << json << data;
}

std::string as_bytes(const std::vector<float>& v) { return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4); }

const char* kConfig =
    R"({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})";

// A folder holding the F8_E4M3 weight "w.weight" [200, 130] (2 x 2 blocks, the last ones
// partial), its scales, and a plain fp32 "n.weight" [3]. `edit` changes the pieces first.
struct Folder {
  std::string dir;
  std::vector<uint8_t> w;
  std::vector<float> scales = {0.5f, 0.001f, 3.0f, 1e-6f};
  std::string config = kConfig;
  std::string scale_dtype = "F32";
  std::vector<int64_t> scale_shape = {2, 2};
  bool with_scales = true;

  explicit Folder(const std::string& name) : dir(::testing::TempDir() + "/hp_fp8_" + name) {
    std::mt19937 gen(3);
    w.resize(200 * 130);
    for (auto& b : w) {
      do {
        b = static_cast<uint8_t>(gen());
      } while ((b & 0x7F) == 0x7F);  // no NaN
    }
  }
  void write() const {
    ASSERT_FOLDER(hp::files::remove_tree(dir));
    ASSERT_FOLDER(hp::files::create_folders(dir));
    std::ofstream(dir + "/config.json") << config;
    std::vector<Raw> t = {{"w.weight", "F8_E4M3", {200, 130}, std::string(w.begin(), w.end())},
                          {"n.weight", "F32", {3}, as_bytes({1.f, 2.f, 3.f})}};
    if (with_scales) t.push_back({"w.weight_scale_inv", scale_dtype, scale_shape, as_bytes(scales)});
    write_raw(dir + "/model.safetensors", t);
  }
  // The test's own dequantization of the box [r0, r0 + nr) x [c0, c0 + nc).
  at::Tensor expected(int64_t r0, int64_t nr, int64_t c0, int64_t nc) const {
    at::Tensor out = at::empty({nr, nc});
    for (int64_t i = 0; i < nr; ++i) {
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t r = r0 + i, c = c0 + j;
        out[i][j] = reference_value(w[static_cast<size_t>(r * 130 + c)]) * scales[static_cast<size_t>(r / 128 * 2 + c / 128)];
      }
    }
    return out;
  }
};

std::string load_error(const Folder& f, const std::string& name = "w.weight") {
  f.write();
  at::Tensor t = at::empty({200, 130});
  try {
    hc::load_consolidated({{name, t, hp::make_shard_spec({200, 130}, {})}}, f.dir);
  } catch (const hp::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Float8, EveryByteDecodesAsTheFormatDefinesIt) {
  at::Tensor bytes = at::arange(256, at::kInt).to(at::kByte);
  at::Tensor values = hc::decode_e4m3fn(bytes);
  for (int b = 0; b < 256; ++b) {
    const float v = values[b].item<float>();
    if (b == 0x7F || b == 0xFF) {
      EXPECT_TRUE(std::isnan(v)) << b;
      EXPECT_TRUE(std::isnan(hc::e4m3fn_value(static_cast<uint8_t>(b)))) << b;
    } else {
      EXPECT_EQ(bits_of(v), reference_bits(b)) << "byte " << b << ": " << v << " vs " << reference_value(b);
      EXPECT_EQ(bits_of(hc::e4m3fn_value(static_cast<uint8_t>(b))), reference_bits(b)) << b;
    }
  }
  EXPECT_EQ(reference_value(0x7E), 448.0f);                // the largest
  EXPECT_EQ(reference_value(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(reference_value(0x08), std::ldexp(1.0f, -6));  // the smallest normal
}

TEST(Float8, RoundsToTheNearestCodeTiesToEven) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    EXPECT_EQ(hc::e4m3fn_bits(reference_value(b)), b) << "byte " << b << " does not round-trip";
  }
  // Between consecutive non-negative codes: just below the midpoint, the lower one; just
  // above, the upper; at it, the even one.
  for (int b = 0; b < 0x7E; ++b) {
    const float lo = reference_value(b), hi = reference_value(b + 1), mid = (lo + hi) / 2;
    EXPECT_EQ(hc::e4m3fn_bits(std::nextafter(mid, lo)), b);
    EXPECT_EQ(hc::e4m3fn_bits(std::nextafter(mid, hi)), b + 1);
    EXPECT_EQ(hc::e4m3fn_bits(mid), b % 2 == 0 ? b : b + 1) << "the midpoint of " << b << " and " << b + 1;
    EXPECT_EQ(hc::e4m3fn_bits(-mid), 0x80 | (b % 2 == 0 ? b : b + 1));
  }
  EXPECT_EQ(hc::e4m3fn_bits(1e6f), 0x7E);  // saturated
  EXPECT_EQ(hc::e4m3fn_bits(-500.f), 0xFE);
  EXPECT_EQ(hc::e4m3fn_bits(std::nanf("")), 0x7F);
  EXPECT_EQ(hc::e4m3fn_bits(-0.0f), 0x80);
  at::Tensor x = at::tensor({1.0f, 0.3f, -17.0f, 1e-4f});
  at::Tensor enc = hc::encode_e4m3fn(x);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(enc[i].item<uint8_t>(), hc::e4m3fn_bits(x[i].item<float>()));
}

// HP_TEST_FLOAT8_REFERENCE (tests/ckpt/float8_torch.sh): a safetensors file PyTorch 2.11
// wrote: "codes" F8_E4M3 [256] (every byte), "decoded" their float32 values by torch;
// "x" float32 values and "x_codes" torch's float8_e4m3fn of them (within +-448).
TEST(Float8, AgreesWithPyTorch) {
  const char* path = std::getenv("HP_TEST_FLOAT8_REFERENCE");
  if (path == nullptr) GTEST_SKIP() << "HP_TEST_FLOAT8_REFERENCE not set (ctest's float8_torch_test sets it)";
  const auto h = hc::read_header(path);
  ASSERT_TRUE(h.find("codes")->e4m3fn);
  const at::Tensor codes = hc::read_tensor(path, h, "codes"), decoded = hc::read_tensor(path, h, "decoded");
  ASSERT_EQ(codes.scalar_type(), at::kByte);
  ASSERT_EQ(codes.numel(), 256);
  const at::Tensor ours = hc::decode_e4m3fn(codes);
  for (int i = 0; i < 256; ++i) {
    const float a = ours[i].item<float>(), b = decoded[i].item<float>();
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(a)) << "byte " << codes[i].item<int>();
    } else {
      EXPECT_EQ(bits_of(a), bits_of(b)) << "byte " << codes[i].item<int>() << ": ours " << a << ", torch " << b;
    }
  }
  const at::Tensor x = hc::read_tensor(path, h, "x"), want = hc::read_tensor(path, h, "x_codes");
  const at::Tensor got = hc::encode_e4m3fn(x);
  EXPECT_GT(x.numel(), 1000);
  EXPECT_TRUE(at::equal(got, want.view(at::kByte))) << "encodings differ at "
                                                    << (got != want.view(at::kByte)).nonzero().slice(0, 0, 5);
}

TEST(Float8, QuantizationConfigIsReadOrRefusedByName) {
  EXPECT_FALSE(hc::hf_float8_blocks(R"({"model_type": "x"})", "c.json").has_value());
  EXPECT_FALSE(hc::hf_float8_blocks(R"({"quantization_config": null})", "c.json").has_value());
  const auto b = hc::hf_float8_blocks(kConfig, "c.json");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->rows, 128);
  EXPECT_EQ(b->cols, 128);
  const auto error = [](const std::string& q) {
    try {
      hc::hf_float8_blocks(R"({"quantization_config": )" + q + "}", "c.json");
    } catch (const hp::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error(R"({"quant_method": "gptq", "bits": 4})").find("quant_method \"gptq\" is not supported yet"),
            std::string::npos);
  EXPECT_NE(error(R"({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})")
                .find("fmt \"e5m2\" is not supported yet"),
            std::string::npos);
  EXPECT_NE(error(R"({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]})")
                .find("activation_scheme \"static\" is not supported yet"),
            std::string::npos);
  EXPECT_NE(error(R"({"quant_method": "fp8", "weight_block_size": [64, 64]})").find("weight_block_size [64,64] is not supported yet"),
            std::string::npos);
  EXPECT_NE(error(R"({"quant_method": "fp8"})").find("weight_block_size null is not supported yet"), std::string::npos);
  EXPECT_NE(error("[1]").find("is not an object"), std::string::npos);
}

TEST(Float8, ALoadDequantizesEachBoxByItsBlocksScales) {
  Folder f("load");
  f.write();
  // Whole, and boxes that start and end inside blocks (as shards do), into fp32 and bf16.
  struct Box {
    int64_t r0, nr, c0, nc;
  };
  for (const Box& b : {Box{0, 200, 0, 130}, Box{100, 100, 60, 70}, Box{127, 2, 127, 2}, Box{150, 50, 0, 130}}) {
    hp::ShardSpec spec = hp::make_shard_spec({200, 130}, {});
    spec.offsets = {b.r0, b.c0};
    spec.lengths = {b.nr, b.nc};
    at::Tensor t = at::empty({b.nr, b.nc}), t16 = at::empty({b.nr, b.nc}, at::kBFloat16), n = at::empty({3});
    hc::load_consolidated({{"w", t, spec, "w.weight"}, {"w16", t16, spec, "w.weight"},
                           {"n.weight", n, hp::make_shard_spec({3}, {})}},
                          f.dir);
    const at::Tensor want = f.expected(b.r0, b.nr, b.c0, b.nc);
    EXPECT_TRUE(at::equal(t, want)) << "box " << b.r0 << "+" << b.nr << " x " << b.c0 << "+" << b.nc;
    EXPECT_TRUE(at::equal(t16, want.to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(n, at::tensor({1.f, 2.f, 3.f})));
  }
}

TEST(Float8, DamagedOrMissingPiecesAreNamed) {
  {
    Folder f("nan");
    f.w[12345] = 0xFF;
    EXPECT_NE(load_error(f).find("tensor 'w.weight' (in 'model.safetensors') holds 1 float8 NaN byte(s)"),
              std::string::npos)
        << load_error(f);
  }
  for (float bad : {0.0f, -1.0f, INFINITY, NAN}) {
    Folder f("scale");
    f.scales[2] = bad;
    EXPECT_NE(load_error(f).find("the scales 'w.weight_scale_inv' (in 'model.safetensors') hold 1 value(s) that are 0, "
                                 "negative, infinite or NaN"),
              std::string::npos)
        << bad << ": " << load_error(f);
  }
  {
    Folder f("noscale");
    f.with_scales = false;
    EXPECT_NE(load_error(f).find("is F8_E4M3, but the folder has no 'w.weight_scale_inv'"), std::string::npos)
        << load_error(f);
  }
  {
    Folder f("shape");
    f.scale_shape = {4, 1};
    EXPECT_NE(load_error(f).find("are F32 of shape [4, 1]; the 128 x 128 blocks of 'w.weight' [200, 130] need "
                                 "floating-point scales of shape [2, 2]"),
              std::string::npos)
        << load_error(f);
  }
  {
    Folder f("noconfig");
    f.config = R"({"model_type": "deepseek_v3"})";
    EXPECT_NE(load_error(f).find("is F8_E4M3, but config.json has no quantization_config"), std::string::npos)
        << load_error(f);
  }
  {
    Folder f("block");
    f.config = R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}})";
    EXPECT_NE(load_error(f).find("weight_block_size [1,128] is not supported yet"), std::string::npos) << load_error(f);
  }
}

// quantize_e4m3fn_blocks against the test's own: each block's amax / 448 (1 for zeros), each
// element divided by it and rounded to the nearest of the 254 finite codes by search (ties
// to the even code); written with write_file as F8_E4M3 and read back by load_consolidated,
// the dequantized values.
TEST(Float8, BlocksQuantizeWriteAndReadBack) {
  at::manual_seed(4);
  at::Tensor w = at::randn({200, 130}) * at::rand({200, 1}) * 3;
  w.narrow(0, 128, 72).narrow(1, 0, 128).zero_();  // a block of zeros
  const auto [codes, scales] = hc::quantize_e4m3fn_blocks(w);
  ASSERT_EQ(scales.sizes(), (std::vector<int64_t>{2, 2}));
  for (int64_t br = 0; br < 2; ++br) {
    for (int64_t bc = 0; bc < 2; ++bc) {
      const float amax = w.narrow(0, br * 128, std::min<int64_t>(128, 200 - br * 128))
                             .narrow(1, bc * 128, std::min<int64_t>(128, 130 - bc * 128))
                             .abs()
                             .max()
                             .item<float>();
      EXPECT_EQ(scales[br][bc].item<float>(), amax > 0 ? amax / 448.0f : 1.0f) << br << "," << bc;
    }
  }
  const auto nearest = [](float x) {  // by search over every finite code of x's sign
    const int sign = std::signbit(x) ? 0x80 : 0;
    int best = sign;
    for (int b = sign; b < sign + 0x7F; ++b) {
      const float d = std::fabs(reference_value(b) - x), e = std::fabs(reference_value(best) - x);
      if (d < e || (d == e && (b & 1) == 0 && (best & 1) == 1)) best = b;
    }
    return best;
  };
  const at::Tensor c = codes.contiguous(), s = scales;
  for (int64_t i = 0; i < 200; i += 7) {
    for (int64_t j = 0; j < 130; j += 3) {
      const float x = w[i][j].item<float>() / s[i / 128][j / 128].item<float>();
      const int want = nearest(x);
      EXPECT_EQ(c[i][j].item<uint8_t>(), want) << i << "," << j << ": " << x;
    }
  }
  const std::string dir = ::testing::TempDir() + "/hp_fp8_written";
  ASSERT_EQ(hp::files::remove_tree(dir), "");
  ASSERT_EQ(hp::files::create_folders(dir), "");
  std::ofstream(dir + "/config.json") << kConfig;
  hc::write_file(dir + "/model.safetensors", {{"w.weight", codes}, {"w.weight_scale_inv", scales}}, {},
                 *hc::local_storage(), {"w.weight"});
  EXPECT_TRUE(hc::read_header(dir + "/model.safetensors").find("w.weight")->e4m3fn);
  at::Tensor back = at::empty({200, 130});
  hc::load_consolidated({{"w.weight", back, hp::make_shard_spec({200, 130}, {})}}, dir);
  at::Tensor want = at::empty({200, 130});
  for (int64_t i = 0; i < 200; ++i) {
    for (int64_t j = 0; j < 130; ++j) {
      want[i][j] = reference_value(c[i][j].item<uint8_t>()) * s[i / 128][j / 128].item<float>();
    }
  }
  EXPECT_TRUE(at::equal(back, want));
  // Written as F8_E4M3, a tensor must be its bytes.
  EXPECT_THROW(hc::write_file(dir + "/bad.safetensors", {{"x", at::zeros({2})}}, {}, *hc::local_storage(), {"x"}),
               hp::Error);
}
