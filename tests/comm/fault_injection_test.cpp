// The fault-injecting decorator itself (tests/comm/fault_injection.h), on the local backend:
// it fires at the point asked and nowhere else, and each action reaches the caller as the
// Communicator reports a failing transport (a CommError naming rank, op, group and seq).
// Its use across layouts and ranks: fault_matrix.sh.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>

#include "comm/fault_injection.h"
#include "hp/comm/communicator.h"
#include "test_util.h"

namespace {

using hp::test::Fault;
using hp::test::FaultInjection;
using Clock = std::chrono::steady_clock;

hp::CommPtr local(const std::string& name, int timeout_ms = 60000) {
  return hp::make_local_communicator({std::chrono::milliseconds(timeout_ms), name});
}

}  // namespace

TEST(FaultInjection, ParsesAndPrintsItsTextForm) {
  const Fault f = Fault::parse("hang:rank=3:op=reduce_scatter:nth=7:group=dp_shard");
  EXPECT_EQ(f.action, Fault::Action::kHang);
  EXPECT_EQ(f.world_rank, 3);
  EXPECT_EQ(f.op, hp::CommOp::kReduceScatter);
  EXPECT_EQ(f.nth, 7u);
  EXPECT_EQ(f.group, "dp_shard");
  EXPECT_EQ(Fault::parse(f.to_string()).to_string(), f.to_string());
  EXPECT_EQ(Fault::parse("delay:delay_ms=250").delay, std::chrono::milliseconds(250));
  hp::test::expect_error([] { Fault::parse("explode"); }, {"'explode'", "error, delay, hang, kill"});
  hp::test::expect_error([] { Fault::parse("error:op=gather"); }, {"op 'gather'"});
  hp::test::expect_error([] { Fault::parse("error:nth=0"); }, {"nth counts from 1"});
  hp::test::expect_error([] { Fault::parse("error:when=now"); }, {"unknown key 'when'"});
}

// The k-th op overall is the op of sequence number k, split included.
TEST(FaultInjection, AnErrorAtTheKthOpNamesItsRankOpGroupAndSeq) {
  FaultInjection inject(Fault::parse("error:nth=3"));
  auto g = local("victim");
  at::Tensor x = at::ones({4});
  g->all_reduce(x).wait();
  g->barrier().wait();
  EXPECT_FALSE(inject.fired());
  hp::Work w = g->broadcast(x, 0);
  try {
    w.wait();
    ADD_FAILURE() << "the third op completed";
  } catch (const hp::CommError& e) {
    EXPECT_EQ(e.op(), "broadcast");
    EXPECT_EQ(e.group(), "victim");
    EXPECT_EQ(e.seq(), 3u);
    EXPECT_EQ(e.rank(), 0);
    const std::string what = e.what();
    EXPECT_NE(what.find("[rank 0] broadcast #3 on group 'victim' failed: injected fault"), std::string::npos) << what;
  }
  ASSERT_TRUE(inject.fired());
  EXPECT_EQ(inject.where().seq, 3u);
  // The communicator is broken for good, and says by what.
  hp::test::expect_error<hp::CommError>([&] { g->all_reduce(x).wait(); }, {"broadcast #3", "victim"});
}

// With an op kind, the k-th op of that kind; only on communicators whose name holds the
// group text, split children under their own names; only on the rank asked.
TEST(FaultInjection, FiresOnlyAtTheOpKindGroupAndRankAsked) {
  {
    FaultInjection inject(Fault::parse("error:op=all_reduce:nth=2:group=child"));
    auto parent = local("parent");
    at::Tensor x = at::ones({4});
    for (int i = 0; i < 3; ++i) parent->all_reduce(x).wait();  // not the group asked
    auto child = parent->split(0, 0, {std::chrono::milliseconds(60000), "parent/child"});
    child->broadcast(x, 0).wait();
    child->all_reduce(x).wait();
    child->broadcast(x, 0).wait();
    EXPECT_FALSE(inject.fired());
    hp::test::expect_error<hp::CommError>([&] { child->all_reduce(x).wait(); },
                                          {"all_reduce #4 on group 'parent/child'", "injected fault"});
    EXPECT_TRUE(inject.fired());
    parent->all_reduce(x).wait();  // the parent is untouched
  }
  {
    FaultInjection inject(Fault::parse("error:rank=1:nth=1"));  // this process is world rank 0
    auto g = local("g");
    at::Tensor x = at::ones({4});
    g->all_reduce(x).wait();
    EXPECT_FALSE(inject.fired());
  }
  // Uninstalled: communicators made afterwards run plain.
  auto g = local("after");
  at::Tensor x = at::ones({4});
  g->all_reduce(x).wait();
}

// A straggler held past the op's timeout: the waiter raises TimeoutError at the deadline,
// naming the op; the op itself completes once the hold ends.
TEST(FaultInjection, ADelayPastTheTimeoutTimesOutTheWaiter) {
  FaultInjection inject(Fault::parse("delay:op=all_reduce:nth=1:delay_ms=1500"));
  auto g = local("slow", 300);
  at::Tensor x = at::ones({4});
  const auto t0 = Clock::now();
  hp::Work w = g->all_reduce(x);
  hp::test::expect_error<hp::TimeoutError>([&] { w.wait(); }, {"all_reduce #1 on group 'slow'", "timed out after 300 ms"});
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 1.4);
}

// A hang: the waiter raises at the deadline; release_hangs lets the op run, so the worker
// (and the process) can stop.
TEST(FaultInjection, AHangTimesOutTheWaiterUntilReleased) {
  FaultInjection inject(Fault::parse("hang:op=barrier:nth=1"));
  auto g = local("stuck", 300);
  hp::Work w = g->barrier();
  hp::test::expect_error<hp::TimeoutError>([&] { w.wait(); }, {"barrier #1 on group 'stuck'", "timed out"});
  EXPECT_TRUE(inject.fired());
  hp::test::release_hangs();
  const auto t0 = Clock::now();
  g.reset();  // joins the worker: it returned from the hang
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.5);
}
