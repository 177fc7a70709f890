#include <gtest/gtest.h>

#include "hp/core/env.h"
#include "hp/core/error.h"
#include "test_util.h"

TEST(Error, CheckCarriesTheValues) {
  int got = 3, want = 4;
  hp::test::expect_error([&] { HP_CHECK(got == want, "expected ", want, " items, got ", got); },
                         {"expected 4 items, got 3"});
}

TEST(Error, CommErrorNamesRankGroupOpAndSequence) {
  hp::CommError e(2, "dp_shard", "reduce_scatter", 17, "boom");
  std::string what = e.what();
  EXPECT_NE(what.find("[rank 2]"), std::string::npos) << what;
  EXPECT_NE(what.find("reduce_scatter #17"), std::string::npos) << what;
  EXPECT_NE(what.find("'dp_shard'"), std::string::npos) << what;
  EXPECT_NE(what.find("boom"), std::string::npos) << what;
}

TEST(Error, NotSupportedSaysSo) {
  hp::test::expect_error([] { HP_NOT_SUPPORTED("tensor_parallel=", 2); },
                         {"not supported yet: tensor_parallel=2"});
}

TEST(Env, KnobsHaveDefaultsAndRejectGarbage) {
  ::unsetenv("HP_COMM_TIMEOUT_S");
  EXPECT_EQ(hp::env::get_int("HP_COMM_TIMEOUT_S"), 600);
  ::setenv("HP_RS_SEGMENT_BYTES", "12abc", 1);
  hp::test::expect_error([] { hp::env::get_int("HP_RS_SEGMENT_BYTES"); },
                         {"HP_RS_SEGMENT_BYTES='12abc'", "not an integer"});
  ::unsetenv("HP_RS_SEGMENT_BYTES");
  hp::test::expect_error([] { hp::env::get_string("HP_NOT_A_KNOB"); }, {"undeclared"});
  for (const auto& k : hp::env::knobs()) EXPECT_NE(std::string(k.meaning), "");
}
