// Pipeline schedules as data, without ranks: text round trips, validation of hand-broken
// schedules, and the simulator against the closed forms of the anchors (1F1B at unit
// costs: 2(m + p - 1) slots and bubble (p - 1) / (m + p - 1); interleaved: bubble time over
// compute time (p - 1) / (v m)).
#include <gtest/gtest.h>

#include <algorithm>

#include "hp/pp/schedule.h"
#include "test_util.h"

namespace {

using hp::pp::Action;
using hp::pp::ActionKind;

TEST(PpSchedule, TextRoundTrips) {
  for (const char* t : {"0F1", "1B0", "2W3", "12I7", "1UNSHARD", "0RESHARD", "3REDUCE_GRAD"}) {
    EXPECT_EQ(Action::parse(t).to_string(), t);
  }
  EXPECT_EQ(Action::parse("2W3"), (Action{2, ActionKind::kBackwardWeight, 3}));
  for (auto s : {hp::pp::gpipe(3, 4), hp::pp::one_f_one_b(4, 6), hp::pp::interleaved_1f1b(2, 2, 4)}) {
    auto back = hp::pp::Schedule::parse(s.to_string(), s.stages, s.microbatches);
    EXPECT_EQ(back.to_string(), s.to_string());
    EXPECT_EQ(back.actions, s.actions);
  }
  hp::test::expect_error([] { Action::parse("F1"); }, {"'F1' is not an action"});
  hp::test::expect_error([] { Action::parse("1X2"); }, {"'1X2' is not an action"});
  hp::test::expect_error([] { Action::parse("1F"); }, {"'1F' is not an action"});
}

TEST(PpSchedule, OneFOneBMatchesTheClosedForm) {
  for (int p : {2, 4}) {
    for (int m : {p, 2 * p, 2 * p + 1}) {
      auto s = hp::pp::one_f_one_b(p, m);
      hp::pp::validate(s);
      auto r = hp::pp::simulate(s, hp::pp::Costs{1, 1, 1, 1});
      EXPECT_DOUBLE_EQ(r.makespan, 2.0 * (m + p - 1)) << "p=" << p << " m=" << m;
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_NEAR(r.bubble[rank], (p - 1.0) / (m + p - 1), 1e-12);
        EXPECT_EQ(r.peak_in_flight[rank], std::min(m, p - rank));  // 1F1B's activation bound
      }
      auto g = hp::pp::simulate(hp::pp::gpipe(p, m), hp::pp::Costs{1, 1, 1, 1});
      EXPECT_DOUBLE_EQ(g.makespan, 2.0 * (m + p - 1));
      EXPECT_EQ(g.peak_in_flight[0], m);  // GPipe holds every micro-batch
    }
  }
}

TEST(PpSchedule, InterleavedBubbleIsDividedByTheChunks) {
  for (int p : {2, 4}) {
    for (int v : {2, 3}) {
      for (int m : {p, 2 * p}) {
        auto s = hp::pp::interleaved_1f1b(p, v, m);
        hp::pp::validate(s);
        auto r = hp::pp::simulate(s, hp::pp::Costs{1, 1, 1, 1});
        const double busy = 2.0 * m * v;
        EXPECT_DOUBLE_EQ(r.busy[0], busy);
        EXPECT_NEAR((r.makespan - busy) / busy, (p - 1.0) / (v * m), 1e-12) << "p=" << p << " v=" << v << " m=" << m;
      }
    }
  }
  // Counts that are not multiples of the ranks: in rounds of m / max(1, m / p) where that
  // divides (as the anchors run them); 5 over 2 ranks (2 rounds of 2.5) is not.
  for (auto [p, m] : std::vector<std::pair<int, int>>{{2, 3}, {4, 6}, {4, 10}, {4, 5}}) {
    auto s = hp::pp::interleaved_1f1b(p, 2, m);
    hp::pp::validate(s);
    hp::pp::validate(hp::pp::lower(s, {.fully_shard = true}));
  }
  hp::test::expect_error([] { hp::pp::interleaved_1f1b(2, 2, 5); }, {"5 micro-batches", "not supported yet"});
}

TEST(PpSchedule, BrokenSchedulesAreNamed) {
  auto parse = [](const std::string& t) { return hp::pp::Schedule::parse(t, 2, 1); };
  hp::test::expect_error([&] { hp::pp::validate(parse("rank 0: 0F0 0B0\nrank 1: 1F0\n")); },
                         {"stage 1 micro-batch 0 is never backwarded"});
  hp::test::expect_error([&] { hp::pp::validate(parse("rank 0: 0B0 0F0\nrank 1: 1F0 1B0\n")); },
                         {"rank 0, action 0 (0B0)", "backward before its forward"});
  hp::test::expect_error([&] { hp::pp::validate(parse("rank 0: 1F0 0B0\nrank 1: 0F0 1B0\n")); },
                         {"stage 1 runs on rank 1, not 0"});
  hp::test::expect_error([&] { hp::pp::validate(parse("rank 0: 0F0 0F0 0B0\nrank 1: 1F0 1B0\n")); },
                         {"(0F0)", "runs twice"});
  hp::test::expect_error([&] { hp::pp::validate(parse("rank 0: 0F0 0REDUCE_GRAD 0B0\nrank 1: 1F0 1B0\n")); },
                         {"backward after stage 0's REDUCE_GRAD"});
  // Each rank waits on the other: stage 1 backwards micro-batch 0 only after forwarding 1,
  // which needs stage 0's forward of 1, which comes after stage 0's backward of 0.
  auto two = [](const std::string& t) { return hp::pp::Schedule::parse(t, 2, 2); };
  hp::test::expect_error(
      [&] { hp::pp::validate(two("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1\n")); },
      {"cannot complete", "rank 0 at 0B0", "rank 1 at 1F1"});
  hp::test::expect_error([&] { hp::pp::Schedule::parse("rank 1: 0F0\n", 1, 1); }, {"does not start with 'rank 0:'"});
  // The split backward: I then W, validated and simulated like B.
  hp::pp::validate(parse("rank 0: 0F0 0I0 0W0 0REDUCE_GRAD\nrank 1: 1F0 1I0 1W0 1REDUCE_GRAD\n"));
  hp::test::expect_error([&] { hp::pp::validate(parse("rank 0: 0F0 0W0 0I0\nrank 1: 1F0 1B0\n")); },
                         {"W before its I"});
}

// Lowering, checked against a hand-lowered 1F1B (p = 2, m = 3): each receive right before
// the compute that reads it, each send right after the compute that produced it; 1F1B's
// links already carry their transfers in one order on both ends, so nothing moves.
TEST(PpSchedule, LoweringInsertsTheTransfers) {
  auto low = hp::pp::lower(hp::pp::one_f_one_b(2, 3));
  EXPECT_EQ(low.to_string(),
            "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2\n"
            "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2\n");
  auto back = hp::pp::Schedule::parse(low.to_string(), low.stages, low.microbatches);
  EXPECT_EQ(back.actions, low.actions);
  auto fs = hp::pp::lower(hp::pp::one_f_one_b(2, 2), {.fully_shard = true});
  EXPECT_EQ(fs.to_string(),
            "rank 0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD\n"
            "rank 1: 1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD\n");
  for (const char* t : {"0SEND_F1", "1RECV_F0", "3SEND_B12", "0RECV_B2"}) EXPECT_EQ(Action::parse(t).to_string(), t);
  hp::test::expect_error([] { Action::parse("0SEND_X1"); }, {"'0SEND_X1' is not an action"});
}

// Every built-in lowers to a schedule that validates (transfers matched, in order, and
// completing with the strictest transport), with one send and one receive per transfer:
// (stages - 1) activations and as many gradients per micro-batch.
TEST(PpSchedule, BuiltinsLowerAndValidate) {
  for (int p : {2, 4}) {
    for (int v : {1, 2}) {
      for (int m : {p, 2 * p, 2 * p + 1}) {
        if (v > 1 && m % p != 0) continue;
        std::vector<hp::pp::Schedule> all = {hp::pp::interleaved_1f1b(p, v, m)};
        if (v == 1) all.push_back(hp::pp::gpipe(p, m));
        for (const auto& s : all) {
          for (bool fsdp : {false, true}) {
            auto low = hp::pp::lower(s, {.fully_shard = fsdp});
            hp::pp::validate(low);
            int comm = 0;
            for (const auto& list : low.actions) {
              for (const auto& a : list) comm += a.is_comm();
            }
            EXPECT_EQ(comm, 4 * (low.stages - 1) * m) << "p=" << p << " v=" << v << " m=" << m;
            auto sim = hp::pp::simulate(low);
            EXPECT_DOUBLE_EQ(sim.makespan, hp::pp::simulate(s).makespan);  // transfers cost nothing
          }
        }
      }
    }
  }
}

TEST(PpSchedule, BrokenTransfersAreNamed) {
  auto two = [](const std::string& t) { return hp::pp::Schedule::parse(t, 2, 1); };
  hp::test::expect_error(
      [&] { hp::pp::validate(two("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\nrank 1: 1F0 1B0 1SEND_B0\n")); },
      {"rank 1, action 0 (1F0) has no 1RECV_F0"});
  hp::test::expect_error(
      [&] { hp::pp::validate(two("rank 0: 0SEND_F0 0F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n")); },
      {"(0SEND_F0)", "sent before 0F0 produced it"});
  hp::test::expect_error(
      [&] { hp::pp::validate(two("rank 0: 0F0 0SEND_F0 0B0 0RECV_B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n")); },
      {"(0RECV_B0)", "received after 0B0 read it"});
  // Rank 1 posts its receive of micro-batch 1's activation before micro-batch 0's, but rank 0
  // sends 0 first: on their link each waits for the other.
  auto two_mb = [](const std::string& t) { return hp::pp::Schedule::parse(t, 2, 2); };
  const char* fifo =
      "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
      "rank 1: 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F0 1F0 1B0 1SEND_B0\n";
  hp::test::expect_error([&] { hp::pp::validate(two_mb(fifo)); },
                         {"transfers cannot complete", "link 0->1 sends 0SEND_F0 first but rank 1 posted 1RECV_F1 first"});
  // Lowering orders each link's receives as its sends go: 1RECV_F0 and 0RECV_B1 earlier.
  hp::pp::Schedule fixed = two_mb(fifo);
  for (auto& list : fixed.actions) {
    list.erase(std::remove_if(list.begin(), list.end(), [](const Action& a) { return a.is_comm(); }), list.end());
  }
  auto low = hp::pp::lower(fixed);
  hp::pp::validate(low);
  EXPECT_EQ(low.to_string(),
            "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0RECV_B0 0B0 0B1\n"
            "rank 1: 1RECV_F0 1RECV_F1 1F1 1B1 1SEND_B1 1F0 1B0 1SEND_B0\n");
}

// ZB-H1 against the zero-bubble paper's closed form at F = I = W = 1: 3m + p - 1 slots
// (1F1B: 3(m + p - 1)), its bubble (p - 1) / (3m + p - 1), and at most p micro-batches held
// (from F to W) on any rank, as 1F1B's first rank holds from F to B.
TEST(PpSchedule, ZeroBubbleH1MatchesTheClosedForm) {
  for (int p : {2, 4}) {
    for (int m : {p, 2 * p, 2 * p + 1, 3 * p}) {
      auto s = hp::pp::zero_bubble_h1(p, m);
      hp::pp::validate(s);
      auto back = hp::pp::Schedule::parse(s.to_string(), s.stages, s.microbatches);
      EXPECT_EQ(back.actions, s.actions);
      auto r = hp::pp::simulate(s, hp::pp::Costs{1, 2, 1, 1});
      EXPECT_DOUBLE_EQ(r.makespan, 3.0 * m + p - 1) << "p=" << p << " m=" << m << "\n" << s.to_string();
      auto one = hp::pp::simulate(hp::pp::one_f_one_b(p, m), hp::pp::Costs{1, 2, 1, 1});
      EXPECT_DOUBLE_EQ(one.makespan, 3.0 * (m + p - 1));
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_NEAR(r.bubble[rank], (p - 1.0) / (3.0 * m + p - 1), 1e-12);
        EXPECT_LE(r.peak_in_flight[rank], p);
      }
      auto low = hp::pp::lower(s, {.fully_shard = true});
      hp::pp::validate(low);
    }
  }
}

// ZBV: two stages per rank in a V (stage s on rank s, then back), the backward split. At
// unit costs per stage (F = I = W = 1) it takes 6m + p - 1 slots within one (where ZB-H1 over
// p stages of twice the size takes 2(3m + p - 1)), holds at most 2p stage-micro-batches per
// rank (p of 1F1B's whole-rank ones), and round-trips through its text form with the
// placement line.
TEST(PpSchedule, ZeroBubbleVIsNearlyBubbleFree) {
  for (int p : {2, 3, 4, 8}) {
    for (int m : {p, 2 * p, 2 * p + 1, 4 * p}) {
      auto s = hp::pp::zero_bubble_v(p, m);
      hp::pp::validate(s);
      for (int r = 0; r < p; ++r) EXPECT_EQ(s.stages_of(r), (std::vector<int>{r, 2 * p - 1 - r}));
      auto back = hp::pp::Schedule::parse(s.to_string(), s.stages, s.microbatches);
      EXPECT_EQ(back.placement, s.placement);
      EXPECT_EQ(back.actions, s.actions);
      auto r = hp::pp::simulate(s, hp::pp::Costs{1, 2, 1, 1});
      EXPECT_GE(r.makespan, 6.0 * m + p - 1) << "p=" << p << " m=" << m;
      EXPECT_LE(r.makespan, 6.0 * m + p) << "p=" << p << " m=" << m;
      EXPECT_LT(r.makespan, 2 * (3.0 * m + p - 1));
      for (int rank = 0; rank < p; ++rank) EXPECT_LE(r.peak_in_flight[rank], 2 * p);
      hp::pp::validate(hp::pp::lower(s, {.fully_shard = true}));
    }
  }
  hp::test::expect_error([] { hp::pp::Schedule::parse("placement: 0 1 2\nrank 0: 0F0\n", 2, 1); },
                         {"placement line gives 3 ranks for 2 stages"});
}

// DualPipeV over 2 ranks and 4 micro-batches, written out by hand from its phases (rank 0:
// 2 forwards of stage 0, a forward of each stage, stage 3's I, W and forward, one steady
// round F0+ B1 F1+ B0, one more round of B1 F1+ B0, B1 whole and B0 split, then W, a split
// B0 and the last W; rank 1: no warm-up, two pairs of forwards, the steady round twice, the
// last rank's first forward unpaired, then B1 B0 whole and B1 B0 split, and the two W's).
TEST(PpSchedule, DualPipeVIsItsPhasesWrittenByHand) {
  const std::string want =
      "placement: 0 1 1 0\n"
      "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3+ 3B1 3F2+ 0B0 3B2 3F3+ 0B1 3B3 0I2 0W2 0I3 0W3\n"
      "rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2+ 1B0 1F3+ 2B1 2F3+ 1B1 2B2 1B2 2I3 1I3 2W3 1W3\n";
  EXPECT_EQ(hp::pp::dualpipev(2, 4).to_string(), want);
  auto back = hp::pp::Schedule::parse(want, 4, 4);
  EXPECT_EQ(back.actions, hp::pp::dualpipev(2, 4).actions);
  EXPECT_TRUE(back.actions[0][7].paired);
  hp::test::expect_error([] { hp::pp::dualpipev(3, 5); }, {"dualpipev over 3 ranks needs at least 6 micro-batches"});
}

// Its bubble is DualPipe's closed form (p - 1)(F&B + B - 3W) per rank (the largest rank's)
// when a stage's F, I and W cost the same, whatever the paired unit F&B costs: with F = I =
// W = 1 (B = 2) that is 2(p - 1) for F&B = F + B = 3 and 1.5(p - 1) for F&B = 2.5 (a
// rank's bubble: the makespan less its busy time). With F 1, I 1.5, W 0.7 and F&B 2.9 the replay
// finds less than the form's 3(p - 1) (its pairs wait less than the form assumes): 2.5 at
// p = 2. Every order validates lowered with fully_shard's verbs.
// (The pairs as units need a pair cost; without one they replay in turn, last case.)
TEST(PpSchedule, DualPipeVBubbleIsTheClosedForm) {
  for (int p : {2, 3, 4, 8}) {
    for (int m : {2 * p, 2 * p + 3, 6 * p}) {
      const auto s = hp::pp::dualpipev(p, m);
      for (int r = 0; r < p; ++r) EXPECT_EQ(s.stages_of(r), (std::vector<int>{r, 2 * p - 1 - r}));
      for (double fb : {3.0, 2.5}) {
        hp::pp::Costs c{1, 2, 1, 1};
        c.forward_backward = fb;
        const auto r = hp::pp::simulate(s, c);
        double worst = 0;
        for (int rank = 0; rank < p; ++rank) worst = std::max(worst, r.makespan - r.busy[rank]);
        const double form = (p - 1) * (fb + 2 - 3 * 1);
        EXPECT_NEAR(worst, form, 1e-9) << "p=" << p << " m=" << m << " F&B=" << fb;
      }
      // Lowered, every pair stays adjacent (its transfers before and after it: the runtime
      // runs it as one unit), with as many pairs as before.
      const auto lowered = hp::pp::lower(s, {.fully_shard = true});
      hp::pp::validate(lowered);
      for (int r = 0; r < p; ++r) {
        int pairs = 0, lowered_pairs = 0;
        for (const auto& a : s.actions[r]) pairs += a.paired ? 1 : 0;
        const auto& list = lowered.actions[r];
        for (size_t i = 0; i < list.size(); ++i) {
          if (!list[i].paired) continue;
          ++lowered_pairs;
          ASSERT_LT(i + 1, list.size());
          EXPECT_TRUE(list[i + 1].is_compute() && list[i + 1].stage != list[i].stage)
              << "p=" << p << " m=" << m << " rank " << r << ": " << list[i].to_string() << " then "
              << list[i + 1].to_string();
        }
        EXPECT_EQ(lowered_pairs, pairs) << "p=" << p << " m=" << m << " rank " << r;
        EXPECT_GT(pairs, 0);
      }
    }
  }
  hp::pp::Costs c{1, 2.2, 1.5, 0.7};
  c.forward_backward = 2.9;
  const auto r = hp::pp::simulate(hp::pp::dualpipev(2, 8), c);
  double worst = 0;
  for (int rank = 0; rank < 2; ++rank) worst = std::max(worst, r.makespan - r.busy[rank]);
  EXPECT_NEAR(worst, 2.5, 1e-9);
  // Without a pair cost the pairs replay in turn, as the same order unpaired does (what hp's
  // runtime runs).
  auto unpaired = hp::pp::dualpipev(3, 9);
  for (auto& list : unpaired.actions) {
    for (auto& a : list) a.paired = false;
  }
  const hp::pp::Costs unit{1, 2, 1, 1};
  EXPECT_DOUBLE_EQ(hp::pp::simulate(hp::pp::dualpipev(3, 9), unit).makespan, hp::pp::simulate(unpaired, unit).makespan);
}

// A pair ("+") is a forward followed, among the rank's compute actions, by a backward of
// another stage; anything else is refused, naming the action.
TEST(PpSchedule, PairsAreAForwardAndAnotherStagesBackward) {
  hp::test::expect_error([] { hp::pp::Schedule::parse("rank 0: 0B0+\n", 1, 1); }, {"'0B0+'", "only a forward pairs"});
  hp::test::expect_error([] { hp::pp::Schedule::parse("rank 0: 0UNSHARD+\n", 1, 1); },
                         {"'0UNSHARD+'", "only a forward pairs"});
  hp::test::expect_error([] { hp::pp::validate(hp::pp::Schedule::parse("rank 0: 0F0+ 0B0\n", 1, 1)); },
                         {"rank 0, action 0 (0F0+)", "a backward (B or I) of another stage"});
  hp::test::expect_error(
      [] { hp::pp::validate(hp::pp::Schedule::parse("rank 0: 0F0 0F1+\nrank 1: 1F0 1B0 1F1 1B1\n", 2, 2)); },
      {"rank 0, action 1 (0F1+)"});
}

}  // namespace

// Stages of unequal cost (a last stage with the head and the loss): 1F1B over 2 stages and
// 4 micro-batches, stage 0 forward 4 / backward 8, stage 1 10 / 20. Replayed by hand: stage 1
// starts after stage 0's first forward and never waits (F0 4-14, B0 14-34, F1 34-44, ...,
// B3 104-124); stage 0's last backward ends at 132.
TEST(Schedule, SimulatesStagesOfUnequalCost) {
  hp::pp::Costs c;
  c.per_stage = {hp::pp::Costs{4, 8, 4, 4}, hp::pp::Costs{10, 20, 10, 10}};
  const auto r = hp::pp::simulate(hp::pp::one_f_one_b(2, 4), c);
  EXPECT_DOUBLE_EQ(r.makespan, 132);
  EXPECT_DOUBLE_EQ(r.busy[0], 48);
  EXPECT_DOUBLE_EQ(r.busy[1], 120);
  c.per_stage.pop_back();
  try {
    hp::pp::simulate(hp::pp::one_f_one_b(2, 4), c);
    FAIL() << "one cost for two stages was accepted";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 per-stage costs for a schedule of 2 stages"), std::string::npos) << e.what();
  }
}
