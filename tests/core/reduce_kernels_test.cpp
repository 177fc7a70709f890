// The reduction kernels against naive references written here.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "comm/reduce_kernels.h"

namespace {

// Naive bf16 rounding: pick the nearer of the two bf16 neighbours of f (computed in
// double), ties to the one with an even last mantissa bit.
uint16_t naive_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t lo = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffff) == 0) return lo;
  uint16_t hi = lo + 1;  // next bf16 away from zero
  auto val = [](uint16_t b) {
    // Past the largest finite value the next "neighbour" is 2^128: RNE overflows to inf
    // exactly when f is at or beyond the midpoint to it.
    if ((b & 0x7fff) == 0x7f80) return (b & 0x8000) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
    uint32_t v = static_cast<uint32_t>(b) << 16;
    float x;
    std::memcpy(&x, &v, 4);
    return static_cast<double>(x);
  };
  double dl = std::fabs(f - val(lo)), dh = std::fabs(val(hi) - f);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

}  // namespace

TEST(ReduceKernels, Bf16RoundingMatchesNaiveReference) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(gen);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isinf(f)) continue;
    uint16_t got = hp::detail::float_to_bf16_bits(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(hp::detail::bf16_bits_to_float(got)));
      continue;
    }
    ASSERT_EQ(got, naive_bf16(f)) << "f=" << f << " bits=" << std::hex << u;
  }
}

// The vectorized bf16 sum against the pairwise definition, one element at a time: widen
// both, add in fp32, round with float_to_bf16_bits. Random bit patterns, so NaNs,
// infinities and subnormals all occur (a NaN plus a number is checked bit for bit; two
// NaNs only as a NaN); lengths and offsets exercise the 16-wide body and the tail, and out
// aliases an input, cached and streamed.
TEST(ReduceKernels, Bf16SumMatchesTheElementwiseDefinitionOnRandomBitPatterns) {
  std::mt19937 gen(11);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffff);
  const int64_t n = 70001;
  std::vector<uint16_t> a(n + 3), b(n + 3), out(n + 3);
  for (int64_t i = 0; i < n + 3; ++i) {
    a[i] = static_cast<uint16_t>(bits(gen));
    b[i] = static_cast<uint16_t>(bits(gen));
  }
  // Specials next to each other: inf + -inf, NaN + inf, the largest finite doubled.
  a[100] = 0x7f80, b[100] = 0xff80, a[101] = 0x7fc1, b[101] = 0x7f80, a[102] = 0x7f7f, b[102] = 0x7f7f;
  auto check = [&](const uint16_t* x, const uint16_t* y, const uint16_t* got, int64_t len) {
    for (int64_t i = 0; i < len; ++i) {
      float want = hp::detail::bf16_bits_to_float(x[i]) + hp::detail::bf16_bits_to_float(y[i]);
      float g = hp::detail::bf16_bits_to_float(got[i]);
      const bool nan_x = std::isnan(hp::detail::bf16_bits_to_float(x[i]));
      const bool nan_y = std::isnan(hp::detail::bf16_bits_to_float(y[i]));
      if (nan_x != nan_y) {
        // One NaN operand: that NaN, quieted (its payload kept), whatever the operand order.
        ASSERT_EQ(got[i], static_cast<uint16_t>((nan_x ? x[i] : y[i]) | 0x40)) << "element " << i;
        continue;
      }
      if (std::isnan(want)) {  // two NaNs (which one wins is the CPU's), or inf - inf
        ASSERT_TRUE(std::isnan(g)) << i;
        continue;
      }
      ASSERT_EQ(got[i], hp::detail::float_to_bf16_bits(want))
          << "element " << i << ": " << std::hex << x[i] << " + " << y[i];
    }
  };
  for (bool streaming : {false, true}) {
    for (int64_t len : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{33}, n}) {
      for (int64_t off : {0, 1, 3}) {  // the output offset too: unaligned heads when streaming
        hp::detail::reduce_kernel(out.data() + off, a.data() + off, b.data() + off, len, at::kBFloat16,
                                  hp::ReduceOp::SUM, streaming);
        check(a.data() + off, b.data() + off, out.data() + off, len);
      }
    }
  }
  for (bool streaming : {false, true}) {
    std::vector<uint16_t> acc(a.begin(), a.begin() + n);  // in place: out is the first input
    hp::detail::reduce_kernel(acc.data(), acc.data(), b.data(), n, at::kBFloat16, hp::ReduceOp::SUM, streaming);
    check(a.data(), b.data(), acc.data(), n);
  }
}

// Streaming (non-temporal) stores give the same float32 sums, at any output alignment.
TEST(ReduceKernels, Float32StreamingSumMatchesATen) {
  at::manual_seed(5);
  at::Tensor a = at::randn({5003}), b = at::randn({5003});
  for (int64_t off : {0, 1, 2, 7}) {
    at::Tensor out = at::zeros({5003 + 8});
    const int64_t n = 5003 - off;
    hp::detail::reduce_kernel(out.data_ptr<float>() + off, a.data_ptr<float>() + off, b.data_ptr<float>() + off, n,
                              at::kFloat, hp::ReduceOp::SUM, /*streaming=*/true);
    EXPECT_TRUE(at::equal(out.narrow(0, off, n), a.narrow(0, off, n) + b.narrow(0, off, n))) << "offset " << off;
  }
  at::Tensor acc = a.clone();  // in place, as the ring's last step writes over its own chunk
  hp::detail::reduce_kernel(acc.data_ptr<float>(), acc.data_ptr<float>(), b.data_ptr<float>(), 5003, at::kFloat,
                            hp::ReduceOp::SUM, /*streaming=*/true);
  EXPECT_TRUE(at::equal(acc, a + b));
}

TEST(ReduceKernels, EveryDtypeAndOpAgreesWithATen) {
  const int64_t n = 1003;
  for (auto dt : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong,
                  at::kByte}) {
    at::manual_seed(3);
    at::Tensor a = (at::randn({n}) * 20).to(dt), b = (at::randn({n}) * 20).to(dt);
    for (auto op : {hp::ReduceOp::SUM, hp::ReduceOp::MAX, hp::ReduceOp::MIN}) {
      at::Tensor out = at::empty({n}, dt);
      hp::detail::reduce_kernel(out.data_ptr(), a.data_ptr(), b.data_ptr(), n, dt, op);
      at::Tensor want;
      // ATen's own ops: half types compute in float and round to nearest-even.
      if (op == hp::ReduceOp::SUM) want = (a + b);
      if (op == hp::ReduceOp::MAX) want = at::maximum(a, b);
      if (op == hp::ReduceOp::MIN) want = at::minimum(a, b);
      EXPECT_TRUE(at::equal(out, want)) << c10::toString(dt) << " " << hp::to_string(op);
    }
  }
  // Bool: max = or, min = and. In place (out aliases a).
  at::Tensor a = at::tensor({1, 1, 0, 0}).to(at::kBool), b = at::tensor({1, 0, 1, 0}).to(at::kBool);
  at::Tensor x = a.clone();
  hp::detail::reduce_kernel(x.data_ptr(), x.data_ptr(), b.data_ptr(), 4, at::kBool, hp::ReduceOp::MAX);
  EXPECT_TRUE(at::equal(x, at::logical_or(a, b)));
  x = a.clone();
  hp::detail::reduce_kernel(x.data_ptr(), x.data_ptr(), b.data_ptr(), 4, at::kBool, hp::ReduceOp::MIN);
  EXPECT_TRUE(at::equal(x, at::logical_and(a, b)));
}

TEST(ReduceKernels, MaxAndMinPropagateNaN) {
  at::Tensor a = at::tensor({1.0f, NAN, 3.0f}), b = at::tensor({NAN, 2.0f, 1.0f});
  at::Tensor out = at::empty({3});
  hp::detail::reduce_kernel(out.data_ptr(), a.data_ptr(), b.data_ptr(), 3, at::kFloat, hp::ReduceOp::MAX);
  EXPECT_TRUE(std::isnan(out[0].item<float>()));
  EXPECT_TRUE(std::isnan(out[1].item<float>()));
  EXPECT_EQ(out[2].item<float>(), 3.0f);
}
