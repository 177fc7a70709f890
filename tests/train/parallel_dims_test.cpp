// ParallelDims without ranks: the degrees' checks, and every group of every layout of 8 and
// 12 ranks against a naive enumeration written here (a rank's coordinates from its number,
// the experts' regrouping from the flattened dp_shard x cp x tp index), plus the layouts
// docs/ep.md draws, by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "hp/core/error.h"
#include "hp/train/config.h"
#include "hp/train/parallel_dims.h"
#include "test_util.h"

namespace ht = hp::train;
using ht::Group;

namespace {

struct Coords {
  int64_t p, r, s, c, t;
};

// The naive layout: rank = ((((p R + r) S + s) C + c) T + t), pp outermost, tp innermost.
struct Naive {
  int64_t P, R, S, C, T, E;
  int n() const { return static_cast<int>(P * R * S * C * T); }
  Coords at(int rank) const {
    int64_t x = rank;
    Coords k{};
    k.t = x % T;
    x /= T;
    k.c = x % C;
    x /= C;
    k.s = x % S;
    x /= S;
    k.r = x % R;
    k.p = x / R;
    return k;
  }
  // The experts' split of the flattened (s, c, t): ep the inner E of it.
  int64_t inner(const Coords& k) const { return (k.s * C + k.c) * T + k.t; }
  // The ranks whose coordinates `same` says agree with `rank`'s, ordered by `order`.
  std::vector<int> group(int rank, const std::function<bool(const Coords&, const Coords&)>& same,
                         const std::function<int64_t(const Coords&)>& order) const {
    const Coords me = at(rank);
    std::vector<int> out;
    for (int q = 0; q < n(); ++q) {
      if (same(me, at(q))) out.push_back(q);
    }
    std::stable_sort(out.begin(), out.end(), [&](int a, int b) { return order(at(a)) < order(at(b)); });
    return out;
  }
  std::vector<int> expect(Group g, int rank) const {
    using K = const Coords&;
    switch (g) {
      case Group::kPp:
        return group(rank, [](K a, K b) { return a.r == b.r && a.s == b.s && a.c == b.c && a.t == b.t; },
                     [](K a) { return a.p; });
      case Group::kDpReplicate:
        return group(rank, [](K a, K b) { return a.p == b.p && a.s == b.s && a.c == b.c && a.t == b.t; },
                     [](K a) { return a.r; });
      case Group::kTp:
        return group(rank, [](K a, K b) { return a.p == b.p && a.r == b.r && a.s == b.s && a.c == b.c; },
                     [](K a) { return a.t; });
      case Group::kCp:
        return group(rank, [](K a, K b) { return a.p == b.p && a.r == b.r && a.s == b.s && a.t == b.t; },
                     [](K a) { return a.c; });
      case Group::kShard:
        return group(rank, [](K a, K b) { return a.p == b.p && a.r == b.r && a.t == b.t; },
                     [this](K a) { return a.s * C + a.c; });
      case Group::kBatch:
        return group(rank, [](K a, K b) { return a.p == b.p && a.c == b.c && a.t == b.t; },
                     [this](K a) { return a.r * S + a.s; });
      case Group::kData:
        return group(rank, [](K a, K b) { return a.p == b.p && a.t == b.t; },
                     [this](K a) { return (a.r * S + a.s) * C + a.c; });
      case Group::kRouting:
        if (E > 1 && T > 1) {
          return group(rank, [](K a, K b) { return a.p == b.p; }, [](K a) { return 0; });  // already in rank order
        }
        return expect(Group::kData, rank);
      case Group::kEp:
        return group(rank,
                     [this](K a, K b) { return a.p == b.p && a.r == b.r && inner(a) / E == inner(b) / E; },
                     [this](K a) { return inner(a) % E; });
      case Group::kExpertShard:
        return group(rank,
                     [this](K a, K b) { return a.p == b.p && a.r == b.r && inner(a) % E == inner(b) % E; },
                     [this](K a) { return inner(a) / E; });
      case Group::kExpertData:
        return group(rank, [this](K a, K b) { return a.p == b.p && inner(a) % E == inner(b) % E; },
                     [this](K a) { return a.r * (S * C * T / E) + inner(a) / E; });
    }
    return {};
  }
};

constexpr Group kAll[] = {Group::kPp,    Group::kDpReplicate, Group::kTp,          Group::kCp,
                          Group::kShard, Group::kBatch,       Group::kData,        Group::kRouting,
                          Group::kEp,    Group::kExpertShard, Group::kExpertData};

}  // namespace

// Every factorization of 8 and 12 ranks into pp x dp_replicate x dp_shard x cp x tp, with
// every expert_parallel the rules allow: each group of each rank as the naive layout has it.
TEST(ParallelDims, EveryGroupOfEveryLayoutMatchesTheNaiveLayout) {
  int layouts = 0;
  for (int n : {8, 12}) {
    for (int64_t P = 1; P <= n; ++P) {
      for (int64_t R = 1; R <= n; ++R) {
        for (int64_t C = 1; C <= n; ++C) {
          for (int64_t T = 1; T <= n; ++T) {
            if (n % (P * R * C * T) != 0) continue;
            const int64_t S = n / (P * R * C * T);
            for (int64_t E = 1; E <= S * C * T; ++E) {
              const bool ok = E == 1 || (T == 1 ? (S * C) % E == 0 : E % T == 0 && (S * C) % (E / T) == 0);
              if (!ok) continue;
              ht::ParallelDims d({R, -1, C, T, P, E}, n);
              ASSERT_EQ(d.dp_shard(), S);
              const Naive naive{P, R, S, C, T, E};
              ++layouts;
              for (Group g : kAll) {
                for (int rank = 0; rank < n; ++rank) {
                  const std::vector<int> want = naive.expect(g, rank);
                  ASSERT_EQ(d.ranks(g, rank), want) << d.describe() << " ep " << E << " group " << d.label(g)
                                                    << " rank " << rank;
                  ASSERT_EQ(d.size(g), static_cast<int64_t>(want.size())) << d.label(g);
                  ASSERT_EQ(want[static_cast<size_t>(d.rank_in(g, rank))], rank) << d.label(g);
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(layouts, 100);
}

// docs/ep.md's picture, by hand: 8 ranks, expert_parallel 4 -> EP groups {0..3} {4..7},
// experts sharded over {r, r+4}; expert_parallel 2 -> EP groups {0,1} {2,3}..., experts over
// {0,2,4,6} {1,3,5,7}; HSDP's replicas outside; with tensor parallel 2 the EP groups take the
// tp pairs.
TEST(ParallelDims, ExpertParallelIsInside) {
  ht::ParallelDims a({1, -1, 1, 1, 1, 4}, 8);
  EXPECT_EQ(a.ranks(Group::kEp, 5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(a.ranks(Group::kExpertShard, 5), (std::vector<int>{1, 5}));
  ht::ParallelDims b({1, -1, 1, 1, 1, 2}, 8);
  EXPECT_EQ(b.ranks(Group::kEp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(b.ranks(Group::kExpertShard, 5), (std::vector<int>{1, 3, 5, 7}));
  ht::ParallelDims h({2, -1, 1, 1, 1, 2}, 8);
  EXPECT_EQ(h.ranks(Group::kEp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(h.ranks(Group::kExpertShard, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(h.ranks(Group::kDpReplicate, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(h.ranks(Group::kExpertData, 5), (std::vector<int>{1, 3, 5, 7}));
  ht::ParallelDims t({1, -1, 1, 2, 1, 4}, 8);
  EXPECT_EQ(t.ranks(Group::kEp, 5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(t.ranks(Group::kExpertShard, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(t.ranks(Group::kTp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(t.ranks(Group::kRouting, 5), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  ht::ParallelDims t2({1, -1, 1, 2, 1, 2}, 8);
  EXPECT_EQ(t2.ranks(Group::kEp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(t2.ranks(Group::kExpertShard, 5), (std::vector<int>{1, 3, 5, 7}));
  // Context parallel 2 inside dp_shard 2: fully_shard over both, the batch over dp_shard alone.
  ht::ParallelDims c({1, 2, 2, 1, 2, 1}, 8);
  EXPECT_EQ(c.ranks(Group::kShard, 5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(c.ranks(Group::kCp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(c.ranks(Group::kBatch, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(c.rank_in(Group::kBatch, 5), 0);
  EXPECT_EQ(c.ranks(Group::kPp, 5), (std::vector<int>{1, 5}));
}

TEST(ParallelDims, LabelsAndLayoutLine) {
  ht::ParallelDims f({1, -1, 1, 1, 1, 1}, 4);
  EXPECT_EQ(f.label(Group::kShard), "dp_shard");
  EXPECT_EQ(f.label(Group::kData), "dp_shard");
  EXPECT_EQ(f.label(Group::kCp), "cp");
  EXPECT_EQ(f.describe(), "data_parallel 1 x data_parallel_shard 4");
  ht::ParallelDims h({2, 2, 2, 2, 1, 4}, 16);
  EXPECT_EQ(h.label(Group::kShard), "dp_shard+cp");
  EXPECT_EQ(h.label(Group::kData), "dp_replicate+dp_shard+cp");
  EXPECT_EQ(h.label(Group::kRouting), "dp_replicate+dp_shard+cp+tp");
  EXPECT_EQ(h.label(Group::kExpertData), "dp_replicate+expert_shard");
  EXPECT_EQ(h.size(Group::kExpertShard), 2);
  EXPECT_EQ(h.describe(), "data_parallel 2 x data_parallel_shard 2 x context_parallel 2 x tensor_parallel 2");
}

// Each bad set of degrees is refused naming the keys and values; none overflows.
TEST(ParallelDims, BadDegreesAreRefused) {
  using hp::test::expect_error;
  expect_error([] { ht::ParallelDims({0, -1, 1, 1, 1, 1}, 4); }, {"data_parallel=0", "positive"});
  expect_error([] { ht::ParallelDims({1, 0, 1, 1, 1, 1}, 4); }, {"data_parallel_shard=0"});
  expect_error([] { ht::ParallelDims({1, -1, 1, 1, 1, 0}, 4); }, {"expert_parallel=0"});
  expect_error([] { ht::ParallelDims({1, -1, 1, 1, 3, 1}, 4); },
               {"pipeline_parallel=3 = 3 does not divide the world size 4"});
  expect_error([] { ht::ParallelDims({1, 3, 1, 1, 1, 1}, 4); },
               {"data_parallel=1 x data_parallel_shard=3 x tensor_parallel=1", "does not match the world of 4"});
  expect_error([] { ht::ParallelDims({int64_t{1} << 40, -1, int64_t{1} << 40, 1, 1, 1}, 4); }, {"does not match"});
  expect_error([] { ht::ParallelDims({1, -1, 1, 1, 1, 8}, 4); },
               {"expert_parallel=8 does not divide data_parallel_shard=4"});
  expect_error([] { ht::ParallelDims({1, 2, 2, 1, 1, 8}, 4); },
               {"expert_parallel=8", "data_parallel_shard x context_parallel=4"});
  expect_error([] { ht::ParallelDims({1, -1, 1, 4, 1, 2}, 8); },
               {"expert_parallel=2 with tensor_parallel=4", "must be tensor_parallel x a divisor of data_parallel_shard=2"});
}

// A validated config's dims are the config's: the world resolved, the groups the trainer's.
TEST(ParallelDims, FromAValidatedConfig) {
  ht::TrainConfig c = ht::parse_config("expert_parallel: 4\ndata_parallel: 2\nglobal_batch_size: 16\n", {}, "t.yaml");
  c.validate(16);
  const ht::ParallelDims d = c.parallel_dims();
  EXPECT_EQ(d.dp_shard(), 8);
  EXPECT_EQ(d.world_size(), 16);
  EXPECT_EQ(d.ranks(Group::kEp, 9), (std::vector<int>{8, 9, 10, 11}));
  ht::TrainConfig unvalidated;
  hp::test::expect_error([&] { (void)unvalidated.parallel_dims(); }, {"not validated"});
}
