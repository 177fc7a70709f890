#include "hp/ckpt/float8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cmath>
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
  // The nearest of the non-negative codes 0x00..0x7e (increasing in value), ties to the
  // even code (an even code's mantissa is even): a binary search for the first code >= a.
  const auto& t = e4m3fn_table();
  int lo = 0, hi = 0x7E;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (t[static_cast<size_t>(mid)] < a) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  int code = lo;
  if (code > 0 && t[static_cast<size_t>(code)] != a) {
    const float below = t[static_cast<size_t>(code - 1)], above = t[static_cast<size_t>(code)];
    const float d_below = a - below, d_above = above - a;  // exact: both within one binade step
    if (d_below < d_above || (d_below == d_above && (code - 1) % 2 == 0)) code -= 1;
  }
  return sign | static_cast<uint8_t>(code);
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
