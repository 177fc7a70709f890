// Helpers shared by the tests.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "hp/core/error.h"
#include "hp/runtime.h"

namespace hp::test {

// Runs `fn` and checks that it raises E whose message contains every one of `parts`.
template <typename E = hp::Error, typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << *parts.begin() << "'";
  } catch (const E& e) {
    std::string what = e.what();
    for (const auto& p : parts) {
      EXPECT_NE(what.find(p), std::string::npos) << "error '" << what << "' lacks '" << p << "'";
    }
  }
}

// Small integers, distinct per rank and index, exact in every dtype (|v| <= 8): sums
// over up to 4 ranks are exact whatever the reduction order.
inline at::Tensor pattern(int64_t rank, int64_t numel, int64_t offset, at::ScalarType dt) {
  at::Tensor i = at::arange(offset, offset + numel, at::kLong);
  if (dt == at::kBool) return ((i + rank) % 3 == 0);
  at::Tensor v = (i * 3 + rank * 7) % 17;
  if (dt != at::kByte) v = v - 8;
  return v.to(dt);
}

inline const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

// The device tests that support it run on: HP_TEST_DEVICE (cpu, the default, or cuda;
// the GPU check runs them with cuda and the nccl backend).
inline c10::Device test_device() {
  const char* v = std::getenv("HP_TEST_DEVICE");
  return c10::Device(v && *v ? v : "cpu");
}

// `got` (any floating dtype, on any device) against `exact` (float64, the exact value of an
// AVG: a sum exact in every dtype divided once): in float32 and float64 bitwise the exact
// value rounded once to the dtype; in bfloat16 and float16, whose division runs in float32
// and rounds again, within one unit in the last place of the exact value.
inline void expect_rounded_once(const at::Tensor& got_any, const at::Tensor& exact, const std::string& what) {
  const at::Tensor got = got_any.cpu();
  ASSERT_EQ(got.sizes(), exact.sizes()) << what;
  if (got.numel() == 0) return;
  const at::ScalarType dt = got.scalar_type();
  if (dt == at::kFloat || dt == at::kDouble) {
    EXPECT_TRUE(at::equal(got, exact.to(dt))) << what << ": max abs diff "
                                              << (got.to(at::kDouble) - exact).abs().max().item<double>();
    return;
  }
  // One ulp: 2^(exponent - mantissa bits), 7 for bfloat16, 10 for float16.
  const double bits = dt == at::kBFloat16 ? 7 : 10;
  const at::Tensor ulp = at::pow(2.0, at::floor(at::log2(exact.abs().clamp_min(1e-30))) - bits);
  const at::Tensor err = (got.to(at::kDouble) - exact).abs();
  EXPECT_TRUE((err <= ulp).all().item<bool>()) << what << ": max error " << (err / ulp).max().item<double>()
                                               << " ulp";
}

}  // namespace hp::test
