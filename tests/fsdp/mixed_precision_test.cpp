// The dtype resolver over every combination of policy fields and parameter dtypes,
// against the rules written out by hand here.
#include <gtest/gtest.h>

#include "hp/fsdp/mixed_precision.h"
#include "test_util.h"

using hp::MixedPrecisionPolicy;

namespace {
const std::vector<at::ScalarType> kFloats = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};
std::vector<c10::optional<at::ScalarType>> with_unset() {
  std::vector<c10::optional<at::ScalarType>> v = {c10::nullopt};
  for (auto t : kFloats) v.push_back(t);
  return v;
}
}  // namespace

TEST(MixedPrecision, EveryCombinationFollowsTheRules) {
  int cases = 0;
  for (auto param : kFloats) {
    for (auto pd : with_unset()) {
      for (auto rd : with_unset()) {
        for (auto od : with_unset()) {
          for (bool cast_inputs : {false, true}) {
            for (bool main_grad : {false, true}) {
              MixedPrecisionPolicy p{pd, rd, od, cast_inputs, main_grad};
              hp::GroupDtypes d = hp::resolve_dtypes(p, param);
              SCOPED_TRACE(d.to_string());
              at::ScalarType compute = pd ? *pd : param;
              EXPECT_EQ(d.param, param);
              EXPECT_EQ(d.compute, compute);
              EXPECT_EQ(d.all_gather, compute);
              EXPECT_EQ(d.grad, compute);
              // reduce_dtype unset = the gradient's own dtype.
              at::ScalarType reduce = rd ? *rd : compute;
              EXPECT_EQ(d.reduce, reduce);
              EXPECT_EQ(d.unsharded_accumulate, reduce);
              EXPECT_EQ(d.main_grad, main_grad);
              EXPECT_EQ(d.sharded_grad, main_grad ? at::kFloat : param);
              EXPECT_EQ(d.sharded_accumulate, main_grad ? at::kFloat : reduce);
              EXPECT_EQ(d.output, od);
              EXPECT_EQ(d.input, (cast_inputs && pd) ? pd : c10::nullopt);
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 5 * 5 * 5 * 2 * 2);
}

// Seed defect 000: bf16 params and compute, reduce_dtype unset, HSDP with fusion: the
// reduction (whose dtype every fused and per-parameter buffer takes) is bf16, never a
// default fp32.
TEST(MixedPrecision, Bf16WithReduceUnsetKeepsEveryBufferBf16) {
  MixedPrecisionPolicy p;
  p.param_dtype = at::kBFloat16;
  hp::GroupDtypes d = hp::resolve_dtypes(p, at::kBFloat16);
  EXPECT_EQ(d.reduce, at::kBFloat16);
  EXPECT_EQ(d.unsharded_accumulate, at::kBFloat16);
  EXPECT_EQ(d.sharded_accumulate, at::kBFloat16);
}

TEST(MixedPrecision, NonFloatingDtypesAreRejectedByName) {
  MixedPrecisionPolicy p;
  p.reduce_dtype = at::kInt;
  hp::test::expect_error([&] { hp::resolve_dtypes(p, at::kFloat); }, {"reduce_dtype is Int"});
  hp::test::expect_error([&] { hp::resolve_dtypes({}, at::kLong); },
                         {"parameters' dtype is Long"});
}
