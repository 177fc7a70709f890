#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <thread>

#include "hp/comm/communicator.h"
#include "hp/core/files.h"
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

// A trace that cannot be written is an error naming the file and the OS's reason, and no
// file is left under the trace's name or half-written under the temporary one.
TEST(Trace, AFailedWriteIsAnErrorAndLeavesNoFile) {
  const std::string dir = ::testing::TempDir() + "hp_trace_fail_test";
  hp::files::remove_tree(dir);  // a run before this one's leftovers
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  hp::trace::enable(dir);
  hp::trace::set_rank(0);
  hp::trace::clear();
  { hp::trace::Span s("work"); }
  const std::string path = dir + "/trace_rank0.json";
  std::remove(path.c_str());
  // A full disk: the temporary file is /dev/full.
  ASSERT_EQ(::symlink("/dev/full", (path + ".partial").c_str()), 0);
  try {
    hp::trace::flush();
    ADD_FAILURE() << "a trace written to a full disk raised nothing";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("trace_rank0.json.partial' failed: No space left on device"), std::string::npos)
        << e.what();
  }
  struct stat st{};
  EXPECT_NE(::lstat(path.c_str(), &st), 0) << "a trace file appeared under its name";
  EXPECT_NE(::lstat((path + ".partial").c_str(), &st), 0) << "the temporary file was left";
  // The folder removed while the run went on.
  ASSERT_EQ(::rmdir(dir.c_str()), 0);
  try {
    hp::trace::flush();
    ADD_FAILURE() << "a trace written to a removed folder raised nothing";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write the trace file '" + path + ".partial': No such file or directory"),
              std::string::npos)
        << e.what();
  }
  hp::trace::disable();
}
