#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <thread>

#include "hp/comm/communicator.h"
#include "hp/core/trace.h"

TEST(Trace, WritesChromeTraceWithComputeAndCommSpans) {
  std::string dir = ::testing::TempDir() + "hp_trace_test";
  hp::trace::enable(dir);
  hp::trace::clear();
  hp::CommPtr c = hp::make_local_communicator({std::chrono::milliseconds(0), "solo"});
  {
    hp::trace::Span s("matmul block 0");
    at::Tensor a = at::randn({64, 64});
    at::mm(a, a);
  }
  at::Tensor x = at::ones({8});
  c->all_reduce(x).wait();
  c->barrier().wait();
  // A comm span is recorded before its Work reports completion: both are there now.
  EXPECT_GE(hp::trace::events().size(), 3u);
  std::string path = hp::trace::flush();
  hp::trace::disable();
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path;
  nlohmann::json j = nlohmann::json::parse(f);
  int compute = 0, comm_begin = 0, comm_end = 0;
  for (const auto& e : j["traceEvents"]) {
    std::string ph = e["ph"];
    if (ph == "X" && e["name"] == "matmul block 0") {
      ++compute;
      EXPECT_GE(e["dur"].get<int64_t>(), 0);
    }
    if (ph == "b" && e["name"] == "all_reduce") {
      ++comm_begin;
      EXPECT_EQ(e["args"]["group"], "solo");
      EXPECT_EQ(e["args"]["bytes"], 32);
    }
    if (ph == "e" && e["name"] == "all_reduce") ++comm_end;
  }
  EXPECT_EQ(compute, 1);
  EXPECT_EQ(comm_begin, 1);
  EXPECT_EQ(comm_end, 1);
}
