// The simulated network: its spec, the modelled times against the formula worked by hand,
// and ops held until the model's time (read back from the trace) on a world made with it;
// a group spanning simulated nodes on the inter-node link. And fully_shard's overlap rule.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <thread>

#include "hp/comm/simulated_network.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"
#include "test_util.h"

TEST(SimulatedNetwork, ParsesSpecsAndNamesWhatIsWrong) {
  hp::SimulatedNetwork a = hp::SimulatedNetwork::parse("5:100");
  EXPECT_EQ(a.intra.alpha_us, 5);
  EXPECT_EQ(a.intra.gbytes_per_s, 100);
  EXPECT_EQ(a.ranks_per_node, 0);
  EXPECT_FALSE(a.spans_nodes({0, 1, 7}));
  hp::SimulatedNetwork b = hp::SimulatedNetwork::parse("5:100,10:12.5:4");
  EXPECT_EQ(b.inter.alpha_us, 10);
  EXPECT_EQ(b.inter.gbytes_per_s, 12.5);
  EXPECT_EQ(b.ranks_per_node, 4);
  EXPECT_FALSE(b.spans_nodes({4, 5, 7}));
  EXPECT_TRUE(b.spans_nodes({3, 4}));
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("5"); }, {"'5'", "ALPHA_US:GB_PER_S"});
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("5:0"); }, {"bandwidth '0' is not a positive number"});
  // Links no machine has: refused, not modelled into step times of hundreds of digits.
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("5:1e-300"); }, {"bandwidth '1e-300' GB/s is outside"});
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("5:2e6"); }, {"bandwidth '2e6' GB/s is outside"});
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("1e300:100"); }, {"latency '1e300' us is beyond"});
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("5:100,5:1e-9:4"); }, {"bandwidth '1e-9' GB/s is outside"});
  EXPECT_EQ(hp::SimulatedNetwork::parse("1e7:1e-6").intra.alpha_us, 1e7) << "the limits themselves are allowed";
  EXPECT_EQ(hp::SimulatedNetwork::parse("0:1e6").intra.gbytes_per_s, 1e6);
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("x:1"); }, {"latency 'x'"});
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("1:1,2:2"); }, {"RANKS_PER_NODE"});
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("1:1,2:2:1.5"); }, {"'1.5' is not a whole number"});
  hp::test::expect_error([] { hp::SimulatedNetwork::parse("1:1,2:2:4,3:3"); }, {"expected"});
}

// alpha + bus factor x bytes / bandwidth, by hand: 4 ranks, 10 us, 2 GB/s, 8e6 bytes.
TEST(SimulatedNetwork, ModelsEachCollectiveWithItsBusFactor) {
  const hp::LinkModel l{10, 2};
  auto s = [&](hp::CommOp op, int n) { return hp::SimulatedNetwork::seconds(op, 8000000, n, l); };
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kAllGather, 4), 10e-6 + 0.75 * 4e-3);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kReduceScatter, 4), 10e-6 + 0.75 * 4e-3);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kAllToAll, 4), 10e-6 + 0.75 * 4e-3);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kAllReduce, 4), 10e-6 + 1.5 * 4e-3);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kBroadcast, 4), 10e-6 + 4e-3);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kSend, 2), 10e-6 + 4e-3);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kBatchSendRecv, 2), 10e-6 + 4e-3);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kBarrier, 4), 10e-6);
  EXPECT_DOUBLE_EQ(s(hp::CommOp::kAllReduce, 1), 0);  // a group of one moves nothing
  hp::test::expect_error([&] { s(hp::CommOp::kNewGroup, 2); }, {"no model for the op 'new_group'"});
}

namespace {
// The trace's last span of `op`, with its "model_us" read from the args.
std::pair<int64_t, int64_t> last_span(const std::string& op) {
  auto events = hp::trace::events();
  for (auto it = events.rbegin(); it != events.rend(); ++it) {
    if (it->name != op || it->cat != "comm") continue;
    auto k = it->args.find("\"model_us\":");
    if (k == std::string::npos) continue;
    return {it->dur_us, std::stoll(it->args.substr(k + 11))};
  }
  return {-1, -1};
}
}  // namespace

// A 4 MB all_reduce over the world at 1 GB/s with 2 ms latency: held until its model's time
// (the trace's span lasts at least that long), the model being the formula's figure; a
// group spanning simulated nodes (one rank per node) takes the slower inter-node link.
TEST(SimulatedNetwork, HoldsEachOpUntilTheModelsTime) {
  auto w = hp::world();
  const bool mpi = w->backend() == "mpi";
  hp::CommOptions o;
  o.simulated_network = "2000:1,3000:0.5:1";
  hp::CommPtr c = mpi ? hp::make_mpi_world_communicator(o) : hp::make_local_communicator(o);
  const int n = c->size();
  const bool was = hp::trace::enabled();
  hp::trace::enable(::testing::TempDir());
  at::Tensor t = at::ones({1000000});  // 4e6 bytes
  c->all_reduce(t).wait();
  EXPECT_TRUE(at::equal(t, at::full({1000000}, static_cast<float>(n))));  // ran for real
  // By hand: one rank per node, so a world of 2 or more spans nodes and takes the inter link,
  // 3000 us + 2 (n-1)/n x 4e6 bytes / 0.5e9 B/s; a world of one moves nothing.
  const int64_t want = n > 1 ? static_cast<int64_t>(3000 + 2.0 * (n - 1) / n * 4e6 / 0.5e9 * 1e6) : 0;
  auto [dur, model] = last_span("all_reduce");
  EXPECT_EQ(model, want);
  EXPECT_GE(dur, model);
  // Groups made from it are simulated too.
  hp::CommPtr g = c->split(0, c->rank());
  g->barrier().wait();
  auto [bdur, bmodel] = last_span("barrier");
  EXPECT_EQ(bmodel, n > 1 ? 3000 : 0);
  EXPECT_GE(bdur, bmodel);
  if (!was) hp::trace::disable();
}

// HP_FSDP_OVERLAP=auto: on for nccl always; on a CPU backend only with a core to spare per
// rank beyond its compute threads (a simulated network changes nothing: the real copies
// still take the core; this binary made one above). Forcing and resetting.
TEST(FsdpOverlap, AutoFollowsTheSpareCoreRule) {
  auto w = hp::world();
  if (w->size() > 1) GTEST_SKIP() << "the rule is per node; checked in one process";
  const int threads = at::get_num_threads();
  setenv("HP_FSDP_OVERLAP", "auto", 1);
  hp::reset_fsdp_overlap();
  EXPECT_TRUE(hp::detail::fsdp_overlap_for(true));
  // As many compute threads as the machine has cores: none to spare.
  hp::set_compute_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_FALSE(hp::spare_core_per_rank());
  EXPECT_FALSE(hp::fsdp_overlap());
  EXPECT_TRUE(hp::detail::fsdp_overlap_for(true));
  hp::set_compute_threads(1);
  const bool spare = std::thread::hardware_concurrency() >= 2;  // this process may use them (no binding)
  EXPECT_EQ(hp::spare_core_per_rank(), spare);
  EXPECT_EQ(hp::fsdp_overlap(), spare);
  hp::set_fsdp_overlap(false);
  EXPECT_FALSE(hp::detail::fsdp_overlap_for(true));
  hp::set_fsdp_overlap(true);
  EXPECT_TRUE(hp::fsdp_overlap());
  hp::set_compute_threads(threads);
  setenv("HP_FSDP_OVERLAP", "1", 1);
  hp::reset_fsdp_overlap();
}
