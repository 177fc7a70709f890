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

}  // namespace hp::test
