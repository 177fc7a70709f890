// Failure handling: a rank that withholds its call makes its peers raise TimeoutError
// within the op's timeout instead of hanging; the communicator then refuses further ops.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>

#include "hp/comm/communicator.h"
#include "hp/runtime.h"
#include "test_util.h"

TEST(Failure, WithheldCollectiveTimesOutOnPeers) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  ASSERT_GE(n, 2);
  const auto timeout = std::chrono::milliseconds(1500);
  // Group ranks in reverse world order, so the messages must tell the two apart.
  hp::CommPtr g = w->split(0, n - 1 - r, {timeout, "victim"});
  const int late = n - 1;  // world rank; group rank 0
  at::Tensor x = at::ones({1000});
  if (r != late) {
    auto t0 = std::chrono::steady_clock::now();
    hp::Work work = g->all_reduce(x);
    try {
      work.wait();
      ADD_FAILURE() << "all_reduce completed although rank " << late << " never joined";
    } catch (const hp::TimeoutError& e) {
      auto waited = std::chrono::steady_clock::now() - t0;
      EXPECT_GE(waited, timeout);
      const int gr = n - 1 - r;
      EXPECT_EQ(e.rank(), gr);
      EXPECT_EQ(e.world_rank(), r);
      EXPECT_EQ(e.op(), "all_reduce");
      EXPECT_EQ(e.group(), "victim");
      EXPECT_EQ(e.seq(), work.seq());
      std::string what = e.what();
      EXPECT_NE(what.find("timed out after 1500 ms"), std::string::npos) << what;
      const std::string who = gr == r ? "[rank " + std::to_string(r) + "]"
                                      : "[world rank " + std::to_string(r) + ", rank " + std::to_string(gr) +
                                            " of group 'victim']";
      EXPECT_NE(what.find(who), std::string::npos) << what;
      // The peer that never came, by its group and world rank (all ranks share this node).
      EXPECT_NE(what.find("rank 0 (world " + std::to_string(late) + ") of group 'victim' never started it"),
                std::string::npos) << what;
    }
    // Later ops on the broken communicator raise at once, naming the cause.
    hp::test::expect_error<hp::CommError>([&] { g->barrier().wait(); },
                                          {"unusable", "all_reduce #1", "victim"});
  }
  // The world communicator is unaffected.
  w->barrier().wait();
  if (r == late) {
    // Joining late lets the peers' stuck call finish, so the processes can exit cleanly.
    g->all_reduce(x).wait();
    EXPECT_EQ(x[0].item<float>(), float(n));
  }
  w->barrier().wait();
}

// new_group is called by the listed ranks only, so it must not count among the parent's
// collectives: if it did, a member would be one collective ahead of the others in the
// node's progress table, name a rank that did start an op as behind it, and (since the
// mpi backend waits for its peers to start each op) wait for that rank for good.
TEST(Failure, ANewGroupOfSomeRanksLeavesTheParentsCountsInStep) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  if (n < 3) GTEST_SKIP() << "needs a rank outside the new group";
  const auto timeout = std::chrono::milliseconds(1500);
  hp::CommPtr g = w->split(0, r, {timeout, "parent"});
  if (r < 2) {
    hp::CommPtr pair = g->new_group({0, 1});
    at::Tensor one = at::ones({4});
    pair->all_reduce(one).wait();
    EXPECT_EQ(one[0].item<float>(), 2.0f);
  }
  // Every rank: the parent still pairs its collectives.
  at::Tensor x = at::full({1000}, float(r));
  g->all_reduce(x).wait();
  EXPECT_EQ(x[7].item<float>(), float(n * (n - 1) / 2));
  // Rank 0 withholds the next one: the others time out, naming rank 0 alone.
  const int late = 0;
  at::Tensor y = at::ones({1000});
  if (r != late) {
    hp::Work work = g->all_reduce(y);
    try {
      work.wait();
      ADD_FAILURE() << "all_reduce completed although rank " << late << " never joined";
    } catch (const hp::TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 0 of group 'parent' never started it"), std::string::npos) << what;
    }
  }
  w->barrier().wait();
  if (r == late) {
    // Joining late lets the peers' stuck call finish, so the processes can exit cleanly.
    g->all_reduce(y).wait();
    EXPECT_EQ(y[0].item<float>(), float(n));
  }
  w->barrier().wait();
}

TEST(Failure, MismatchedCollectiveRaisesInsteadOfHanging) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  // Ranks disagree on the size of a point-to-point message: the receiver raises.
  hp::CommPtr g = w->split(0, r, {std::chrono::milliseconds(20000), "mismatch"});
  if (r == 0) {
    g->send(at::ones({8}), 1).wait();
  } else if (r == 1) {
    hp::test::expect_error<hp::CommError>([&] { g->recv(at::empty({4}), 0).wait(); },
                                          {"recv", "mismatch", "[rank 1]"});
  }
  (void)n;
  w->barrier().wait();
}

TEST(Failure, DestroyingACommunicatorRunsItsQueuedOpsFirst) {
  auto w = hp::world();
  const int n = w->size();
  hp::CommPtr g = w->split(0, w->rank());
  at::Tensor x = at::ones({1 << 16});
  at::Tensor y = at::full({3}, 2.0);
  hp::Work a = g->all_reduce(x), b = g->all_reduce(y);
  g.reset();  // the worker drains its queue before it stops
  EXPECT_TRUE(a.is_completed() && b.is_completed());
  EXPECT_EQ(x[100].item<float>(), float(n));
  EXPECT_EQ(y[2].item<float>(), 2.0f * n);
  w->barrier().wait();
}
