// gtest main for every test binary: starts the hp runtime (mpi under mpirun, else local),
// runs the tests on every rank, and prints only rank 0's progress plus every rank's
// failures (prefixed with the rank). A failure on any rank fails the process and so the
// ctest entry.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "hp/runtime.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(),
                   info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // The tests exercise fully_shard's overlapped path (prefetches, reductions behind
  // backward), which HP_FSDP_OVERLAP=auto turns off on a node without a spare core per
  // rank; a test of the other path sets it itself.
  setenv("HP_FSDP_OVERLAP", "1", /*overwrite=*/0);
  hp::CommPtr world = hp::init();
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  int rc = RUN_ALL_TESTS();
  world.reset();
  hp::finalize();
  return rc;
}
