#include "hp/ckpt/float8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "hp/core/error.h"
#include "hp/core/untrusted.h"

namespace hp::ckpt {
namespace {

const std::array<float, 256>& e4m3fn_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
      float v;
      if (exponent == 0xF && mantissa == 7) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (exponent == 0) {
        v = std::ldexp(static_cast<float>(mantissa), -9);  // m / 8 x 2^-6
      } else {
        v = std::ldexp(static_cast<float>(8 + mantissa), exponent - 7 - 3);  // (1 + m / 8) x 2^(e - 7)
      }
      t[static_cast<size_t>(b)] = (b & 0x80) ? -v : v;
    }
    return t;
  }();
  return table;
}

}  // namespace

float e4m3fn_value(uint8_t bits) { return e4m3fn_table()[bits]; }

uint8_t e4m3fn_bits(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0.015625f) {  // below 2^-6: subnormals, m x 2^-9 (m = 8 is the smallest normal, code 8)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // exact product; ties to even
  }
  // A normal: the fp32 mantissa rounded to 3 bits, ties to even (a carry moves the exponent).
  uint32_t bits;
  std::memcpy(&bits, &a, 4);
  int exponent = static_cast<int>(bits >> 23) - 127 + 7;  // e4m3's biased exponent, >= 1 here
  uint32_t mantissa = (bits & 0x7FFFFF) >> 20;
  const uint32_t rest = bits & 0xFFFFF;
  if (rest > 0x80000 || (rest == 0x80000 && (mantissa & 1))) {
    if (++mantissa == 8) {
      mantissa = 0;
      ++exponent;
    }
  }
  const int code = exponent << 3 | static_cast<int>(mantissa);
  return sign | static_cast<uint8_t>(std::min(code, 0x7E));
}

at::Tensor decode_e4m3fn(const at::Tensor& bytes) {
  HP_CHECK(bytes.scalar_type() == at::kByte, "decode_e4m3fn: bytes must be uint8, got ", bytes.scalar_type());
  const at::Tensor in = bytes.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kFloat));
  const uint8_t* src = in.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const auto& t = e4m3fn_table();
  at::parallel_for(0, in.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = t[src[i]];
  });
  return out;
}

at::Tensor encode_e4m3fn(const at::Tensor& values) {
  const at::Tensor in = values.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kByte));
  const float* src = in.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, in.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = e4m3fn_bits(src[i]);
  });
  return out;
}

namespace {

// dequantize_e4m3fn_blocks_into for a contiguous `out` of element type T.
template <typename T>
int64_t dequantize_rows(const uint8_t* src, const float* s, int64_t stride, int64_t rows, int64_t cols, int64_t row0,
                        int64_t col0, const Float8Blocks& b, T* dst) {
  const int64_t first_row = row0 / b.rows, first_col = col0 / b.cols;
  const auto& t = e4m3fn_table();
  std::atomic<int64_t> nans{0};
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    int64_t mine = 0;
    for (int64_t i = begin; i < end; ++i) {
      const float* srow = s + ((row0 + i) / b.rows - first_row) * stride;
      const uint8_t* x = src + i * cols;
      T* y = dst + i * cols;
      for (int64_t j = 0; j < cols; ++j) {
        y[j] = static_cast<T>(t[x[j]] * srow[(col0 + j) / b.cols - first_col]);
        mine += (x[j] & 0x7F) == 0x7F;
      }
    }
    nans += mine;
  });
  return nans.load();
}

}  // namespace

void dequantize_e4m3fn_blocks_into(const at::Tensor& bytes, const at::Tensor& scales, int64_t row0, int64_t col0,
                                   const Float8Blocks& b, const at::Tensor& out, int64_t* nan_bytes) {
  HP_CHECK(bytes.dim() == 2 && bytes.scalar_type() == at::kByte && scales.dim() == 2 && out.sizes() == bytes.sizes() &&
               at::isFloatingType(out.scalar_type()),
           "dequantize_e4m3fn_blocks: 2-D uint8 bytes, 2-D scales and a floating-point output of the bytes' shape are ",
           "expected, got ", bytes.sizes(), " ", bytes.scalar_type(), ", ", scales.sizes(), " and ", out.sizes(), " ",
           out.scalar_type());
  const at::Tensor in = bytes.contiguous(), sc = scales.to(at::kFloat).contiguous();
  const int64_t rows = in.size(0), cols = in.size(1), first_row = row0 / b.rows, first_col = col0 / b.cols;
  HP_CHECK(rows == 0 || cols == 0 ||
               ((row0 + rows - 1) / b.rows - first_row < sc.size(0) && (col0 + cols - 1) / b.cols - first_col < sc.size(1)),
           "dequantize_e4m3fn_blocks: scales ", sc.sizes(), " do not cover the box at (", row0, ", ", col0, ") of ",
           in.sizes());
  const at::ScalarType dtype = out.scalar_type();
  const bool direct = out.is_contiguous() && out.device().is_cpu() &&
                      (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble);
  const at::Tensor target = direct ? out : at::empty(in.sizes(), in.options().dtype(at::kFloat));
  const uint8_t* src = in.data_ptr<uint8_t>();
  const float* s = sc.data_ptr<float>();
  const int64_t stride = sc.size(1);
  int64_t nans = 0;
  switch (target.scalar_type()) {
    case at::kBFloat16:
      nans = dequantize_rows(src, s, stride, rows, cols, row0, col0, b, target.data_ptr<at::BFloat16>());
      break;
    case at::kHalf:
      nans = dequantize_rows(src, s, stride, rows, cols, row0, col0, b, target.data_ptr<at::Half>());
      break;
    case at::kDouble:
      nans = dequantize_rows(src, s, stride, rows, cols, row0, col0, b, target.data_ptr<double>());
      break;
    default:
      nans = dequantize_rows(src, s, stride, rows, cols, row0, col0, b, target.data_ptr<float>());
  }
  if (!direct) out.copy_(target);
  if (nan_bytes != nullptr) *nan_bytes = nans;
}

at::Tensor dequantize_e4m3fn_blocks(const at::Tensor& bytes, const at::Tensor& scales, int64_t row0, int64_t col0,
                                    const Float8Blocks& b, int64_t* nan_bytes) {
  at::Tensor out = at::empty(bytes.sizes(), bytes.options().dtype(at::kFloat));
  dequantize_e4m3fn_blocks_into(bytes, scales, row0, col0, b, out, nan_bytes);
  return out;
}

std::pair<at::Tensor, at::Tensor> quantize_e4m3fn_blocks(const at::Tensor& weight, const Float8Blocks& b) {
  HP_CHECK(weight.dim() == 2, "quantize_e4m3fn_blocks: a 2-D weight is expected, got shape ", weight.sizes());
  const at::Tensor w = weight.to(at::kFloat);
  const int64_t rows = w.size(0), cols = w.size(1);
  const int64_t nr = (rows + b.rows - 1) / b.rows, nc = (cols + b.cols - 1) / b.cols;
  at::Tensor padded = at::zeros({nr * b.rows, nc * b.cols}, w.options());
  padded.narrow(0, 0, rows).narrow(1, 0, cols).copy_(w);
  const at::Tensor amax = padded.view({nr, b.rows, nc, b.cols}).abs().amax({1, 3});
  const at::Tensor scales = at::where(amax > 0, amax / 448.0, at::ones_like(amax));
  const at::Tensor each =
      scales.repeat_interleave(b.rows, 0).repeat_interleave(b.cols, 1).narrow(0, 0, rows).narrow(1, 0, cols);
  return {encode_e4m3fn(w / each), scales.contiguous()};
}

c10::optional<Float8Blocks> hf_float8_blocks(const std::string& text, const std::string& path) {
  hp::text::check_json_nesting(text, "'" + path + "'");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    HP_CHECK(false, "'", path, "' is not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("quantization_config") || j["quantization_config"].is_null()) return c10::nullopt;
  const nlohmann::json& q = j["quantization_config"];
  const std::string where = "'" + path + "': quantization_config ";
  HP_CHECK(q.is_object(), where, q.dump(), " is not an object");
  const auto field = [&](const char* key) { return q.contains(key) ? q[key] : nlohmann::json(); };
  HP_CHECK(field("quant_method") == "fp8", where, "quant_method ", field("quant_method").dump(),
           " is not supported yet (fp8 with 128 x 128 block scales, as DeepSeek-V3 publishes it, is read; other quantized ",
           "weights: convert them to bf16 or fp32 first)");
  HP_CHECK(!q.contains("fmt") || field("fmt") == "e4m3", where, "fmt ", field("fmt").dump(),
           " is not supported yet (e4m3 only)");
  HP_CHECK(!q.contains("activation_scheme") || field("activation_scheme") == "dynamic", where, "activation_scheme ",
           field("activation_scheme").dump(), " is not supported yet (dynamic only: no activation scales are read)");
  const nlohmann::json& b = field("weight_block_size");
  HP_CHECK(b.is_array() && b.size() == 2 && b[0].is_number_integer() && b[1].is_number_integer(), where,
           "weight_block_size ", b.dump(), " is not supported yet (per-block scales of [128, 128]; per-tensor and "
           "per-channel fp8 are not read)");
  Float8Blocks blocks{b[0].get<int64_t>(), b[1].get<int64_t>()};
  HP_CHECK(blocks.rows == 128 && blocks.cols == 128, where, "weight_block_size ", b.dump(),
           " is not supported yet (128 x 128 only, as published)");
  return blocks;
}

std::string float8_scale_name(const std::string& weight) { return weight + "_scale_inv"; }

}  // namespace hp::ckpt
