#include "reduce_kernels.h"

#include <c10/util/Half.h>

#include <cmath>
#include <cstring>

#include "hp/core/error.h"

namespace hp::detail {

uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(std::isnan(f) ? quiet_nan : rounded);
}

float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace {

struct Sum {
  template <typename T>
  T operator()(T a, T b) const { return a + b; }
};
// NaN-propagating max / min.
struct Max {
  template <typename T>
  T operator()(T a, T b) const { return (a > b || a != a) ? a : b; }
};
struct Min {
  template <typename T>
  T operator()(T a, T b) const { return (a < b || a != a) ? a : b; }
};

// __restrict__ is deliberately absent: out may alias a or b (elementwise, same index).
template <typename T, typename Op>
void plain(T* out, const T* a, const T* b, int64_t n, Op op) {
  for (int64_t i = 0; i < n; ++i) out[i] = op(a[i], b[i]);
}

template <typename Op>
void bf16(uint16_t* out, const uint16_t* a, const uint16_t* b, int64_t n, Op op) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = float_to_bf16_bits(op(bf16_bits_to_float(a[i]), bf16_bits_to_float(b[i])));
  }
}

template <typename Op>
void fp16(c10::Half* out, const c10::Half* a, const c10::Half* b, int64_t n, Op op) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = c10::Half(op(static_cast<float>(a[i]), static_cast<float>(b[i])));
  }
}

template <typename Op>
void dispatch(void* out, const void* a, const void* b, int64_t n, at::ScalarType dt, Op op) {
  switch (dt) {
    case at::kFloat:
      return plain(static_cast<float*>(out), static_cast<const float*>(a),
                   static_cast<const float*>(b), n, op);
    case at::kDouble:
      return plain(static_cast<double*>(out), static_cast<const double*>(a),
                   static_cast<const double*>(b), n, op);
    case at::kInt:
      return plain(static_cast<int32_t*>(out), static_cast<const int32_t*>(a),
                   static_cast<const int32_t*>(b), n, op);
    case at::kLong:
      return plain(static_cast<int64_t*>(out), static_cast<const int64_t*>(a),
                   static_cast<const int64_t*>(b), n, op);
    case at::kByte:
    case at::kBool:  // 0/1 bytes: max = or, min = and
      return plain(static_cast<uint8_t*>(out), static_cast<const uint8_t*>(a),
                   static_cast<const uint8_t*>(b), n, op);
    case at::kBFloat16:
      return bf16(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                  static_cast<const uint16_t*>(b), n, op);
    case at::kHalf:
      return fp16(static_cast<c10::Half*>(out), static_cast<const c10::Half*>(a),
                  static_cast<const c10::Half*>(b), n, op);
    default:
      HP_INTERNAL_ASSERT(false, "reduce_kernel: dtype ", dt);
  }
}

}  // namespace

void reduce_kernel(void* out, const void* a, const void* b, int64_t n, at::ScalarType dtype,
                   ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return dispatch(out, a, b, n, dtype, Sum{});
    case ReduceOp::MAX: return dispatch(out, a, b, n, dtype, Max{});
    case ReduceOp::MIN: return dispatch(out, a, b, n, dtype, Min{});
    case ReduceOp::AVG: break;
  }
  HP_INTERNAL_ASSERT(false, "reduce_kernel: AVG must be lowered to SUM first");
}

}  // namespace hp::detail
