// Distributed Muon: matrices split over the ranks (fully_shard's dim-0 rows, uneven and
// empty; replicas as HSDP's; tensor parallel's dim 1 then dim 0), both schemes, three steps
// in float64 against the same Muon on whole matrices in one process; the plan's transfers
// and the step's collectives counted against a plan worked out by hand; bad pieces refused
// on every rank.
#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "hp/core/trace.h"
#include "hp/mesh/shard_spec.h"
#include "hp/optim/muon.h"
#include "hp/runtime.h"
#include "test_util.h"

namespace {

namespace ho = hp::optim;

struct Layout {
  std::string name;
  // The box of a [rows, cols] matrix on `rank` of `world`.
  std::function<hp::ShardSpec(int64_t rows, int64_t cols, int rank, int world)> box;
  int min_world = 1, world_divisor = 1;
};

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> l = {
      {"fsdp",
       [](int64_t r, int64_t c, int rank, int world) {
         return hp::make_shard_spec({r, c}, {{{"dp_shard", world, rank}}, {}});
       }},
      // Two replicas, each split over half of the ranks.
      {"hsdp",
       [](int64_t r, int64_t c, int rank, int world) {
         return hp::make_shard_spec({r, c}, {{{"dp_shard", world / 2, rank % (world / 2)}}, {}});
       },
       2, 2},
      // Columns over tp (2, innermost), then rows over dp_shard.
      {"tp_fsdp",
       [](int64_t r, int64_t c, int rank, int world) {
         return hp::make_shard_spec({r, c}, {{{"dp_shard", world / 2, rank / 2}}, {{"tp", 2, rank % 2}}});
       },
       2, 2},
  };
  return l;
}

// The job's matrices: a tall one, two of one shape (one batch), a single row (empty pieces
// beyond the first rank under fully_shard).
const std::vector<std::pair<std::string, std::vector<int64_t>>> kMatrices = {
    {"a", {7, 5}}, {"b", {6, 9}}, {"c", {6, 9}}, {"d", {1, 4}}};

at::Tensor global_value(size_t matrix, int step, int64_t rows, int64_t cols) {
  at::manual_seed(100 * static_cast<uint64_t>(step) + matrix);
  return at::randn({rows, cols}, at::kDouble);
}

at::Tensor piece_of(const at::Tensor& whole, const hp::ShardSpec& b) {
  return whole.narrow(0, b.offsets[0], b.lengths[0]).narrow(1, b.offsets[1], b.lengths[1]);
}

ho::MuonOptions options() {
  ho::MuonOptions o(0.05);
  o.momentum(0.9).weight_decay(0.1).ns_dtype(at::kDouble).ns(ho::ns_steps(ho::NsSchedule::kQuintic));
  return o;
}

}  // namespace

TEST(MuonDist, PiecesMatchWholeMatricesInOneProcess) {
  auto w = hp::world();
  const int world = w->size(), rank = w->rank();
  for (const Layout& layout : layouts()) {
    if (world < layout.min_world || world % layout.world_divisor != 0) continue;
    for (ho::MuonScheme scheme : {ho::MuonScheme::kOwner, ho::MuonScheme::kGatherEverywhere}) {
      const std::string label = layout.name + (scheme == ho::MuonScheme::kOwner ? " owner" : " gather");
      // One process: whole matrices.
      std::vector<at::Tensor> whole;
      for (size_t j = 0; j < kMatrices.size(); ++j) {
        whole.push_back(global_value(j, 0, kMatrices[j].second[0], kMatrices[j].second[1]).set_requires_grad(true));
      }
      std::vector<torch::optim::OptimizerParamGroup> g1;
      g1.emplace_back(whole, std::make_unique<ho::MuonOptions>(options()));
      ho::Muon ref(std::move(g1));
      // This rank's pieces, and a whole matrix of its own beside them (stepped here).
      std::vector<at::Tensor> mine;
      std::vector<ho::MatrixPiece> pieces;
      for (size_t j = 0; j < kMatrices.size(); ++j) {
        const hp::ShardSpec b = layout.box(kMatrices[j].second[0], kMatrices[j].second[1], rank, world);
        mine.push_back(piece_of(whole[j].detach(), b).clone().set_requires_grad(true));
        pieces.push_back({mine.back(), kMatrices[j].first, b});
      }
      at::Tensor own = global_value(9, 0, 3, 3).set_requires_grad(true);
      std::vector<at::Tensor> params = mine;
      params.push_back(own);
      std::vector<torch::optim::OptimizerParamGroup> g2;
      g2.emplace_back(params, std::make_unique<ho::MuonOptions>(options()));
      ho::Muon dist(std::move(g2));
      dist.distribute(w, pieces, scheme);
      at::Tensor own_ref = own.detach().clone().set_requires_grad(true);
      std::vector<torch::optim::OptimizerParamGroup> g3;
      g3.emplace_back(std::vector<at::Tensor>{own_ref}, std::make_unique<ho::MuonOptions>(options()));
      ho::Muon own_opt(std::move(g3));
      for (int step = 1; step <= 3; ++step) {
        for (size_t j = 0; j < kMatrices.size(); ++j) {
          // Matrix c gets no gradient in step 2, on every holder.
          const bool none = j == 2 && step == 2;
          const at::Tensor g = global_value(j, step, kMatrices[j].second[0], kMatrices[j].second[1]);
          whole[j].mutable_grad() = none ? at::Tensor() : g;
          mine[j].mutable_grad() = none ? at::Tensor() : piece_of(g, pieces[j].box).clone();
        }
        own.mutable_grad() = global_value(9, step, 3, 3);
        own_ref.mutable_grad() = own.grad().clone();
        ref.step();
        dist.step();
        own_opt.step();
        for (size_t j = 0; j < kMatrices.size(); ++j) {
          if (mine[j].numel() == 0) continue;  // an empty piece (matrix d beyond rank 0)
          const double diff = (mine[j].detach() - piece_of(whole[j].detach(), pieces[j].box)).abs().max().item<double>();
          EXPECT_LE(diff, 1e-12) << label << " step " << step << " matrix " << kMatrices[j].first << " rank " << rank;
        }
        EXPECT_TRUE(at::equal(own.detach(), own_ref.detach())) << label;
      }
      if (mine[2].numel() > 0) {
        EXPECT_EQ(dist.muon_state(mine[2]).step(), 2) << label;
      }
      // Each matrix computed once in the job under kOwner, by each holder otherwise.
      at::Tensor owned = at::full({1}, dist.plan_stats().owned, at::kLong);
      w->all_reduce(owned).wait();
      EXPECT_EQ(dist.plan_stats().matrices, 4) << label;
      if (scheme == ho::MuonScheme::kOwner) {
        EXPECT_EQ(owned.item<int64_t>(), 4) << label;
      }
    }
  }
}

// The sum over the ranks of their plan_stats() against optim::muon_workload's count for the
// job (what the planner prices), for the owner scheme.
void expect_plan_is_the_workload(const hp::CommPtr& w, const ho::MuonPlanStats& st,
                                 const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t shards,
                                 int64_t replicas) {
  at::Tensor sums = at::tensor({st.owned_cost, static_cast<double>(st.send_elements),
                                static_cast<double>(st.recv_elements)}, at::kDouble);
  w->all_reduce(sums).wait();
  const ho::MuonWorkload want = ho::muon_workload(shapes, shards, replicas);
  EXPECT_EQ(st.matrices, want.matrices);
  EXPECT_EQ(sums[0].item<double>(), want.cost);
  EXPECT_EQ(sums[1].item<double>(), want.gathered + want.given);
  EXPECT_EQ(sums[2].item<double>(), want.gathered + want.given);
}

// Two ranks, a [4, 6] matrix split 2 | 2 and a [2, 2] one split 1 | 1. By hand: costs
// s^2 (2 l + s): 16 x 16 = 256 and 4 x 6 = 24; the costlier goes first, to rank 0 (loads
// equal, the lower rank), the other to rank 1 (load 0 < 256). Each rank sends its 12- or
// 2-element piece to the other owner and gets its box of the other's result back: 14
// elements out and 14 in per rank, in two all-to-alls, after one all-reduce (which matrices
// have gradients). Every holder computing: the same volume, one all-to-all.
TEST(MuonDist, PlanAndCollectivesAsWorkedOutByHand) {
  auto w = hp::world();
  if (w->size() != 2) GTEST_SKIP() << "worked out for 2 ranks";
  const int rank = w->rank();
  for (ho::MuonScheme scheme : {ho::MuonScheme::kOwner, ho::MuonScheme::kGatherEverywhere}) {
    at::Tensor a = at::randn({2, 6}, at::kDouble).set_requires_grad(true);
    at::Tensor b = at::randn({1, 2}, at::kDouble).set_requires_grad(true);
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{a, b}, std::make_unique<ho::MuonOptions>(options()));
    ho::Muon m(std::move(g));
    m.distribute(w,
                 {{a, "a", hp::make_shard_spec({4, 6}, {{{"dp_shard", 2, rank}}, {}})},
                  {b, "b", hp::make_shard_spec({2, 2}, {{{"dp_shard", 2, rank}}, {}})}},
                 scheme);
    const ho::MuonPlanStats st = m.plan_stats();
    EXPECT_EQ(st.matrices, 2);
    if (scheme == ho::MuonScheme::kOwner) {
      EXPECT_EQ(st.owned, 1);
      EXPECT_EQ(st.owned_cost, rank == 0 ? 256.0 : 24.0);
      expect_plan_is_the_workload(w, st, {{4, 6}, {2, 2}}, 2, 1);
    } else {
      EXPECT_EQ(st.owned, 2);
    }
    EXPECT_EQ(st.send_elements, 14);
    EXPECT_EQ(st.recv_elements, 14);
    a.mutable_grad() = at::randn_like(a);
    b.mutable_grad() = at::randn_like(b);
    hp::trace::enable(::testing::TempDir());
    hp::trace::clear();
    m.step();
    std::map<std::string, int> ops;
    for (const auto& e : hp::trace::events()) {
      if (e.cat == "comm") ++ops[e.name];
    }
    hp::trace::disable();
    hp::trace::clear();
    EXPECT_EQ(ops["all_reduce"], 1);
    EXPECT_EQ(ops["all_to_all"], scheme == ho::MuonScheme::kOwner ? 2 : 1);
    EXPECT_EQ(ops.size(), 2u);
  }
}

// Refused on every rank: a piece outside the Muon groups (on one rank only), a parameter
// given twice, ranks giving different schemes, boxes leaving a gap, holders stepping with
// different options, ranks disagreeing on a shape; and at a step, a bad gradient on one rank (before anything moves) and a matrix with
// a gradient on some of its holders only.
TEST(MuonDist, BadPiecesAreRefusedOnEveryRank) {
  auto w = hp::world();
  const int world = w->size(), rank = w->rank();
  at::Tensor m = at::randn({2, 3}, at::kDouble).set_requires_grad(true);
  at::Tensor v = at::randn({2, 3}, at::kDouble).set_requires_grad(true);
  auto make = [&] {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{m}, std::make_unique<ho::MuonOptions>(options()));
    g.emplace_back(std::vector<at::Tensor>{v}, std::make_unique<torch::optim::AdamWOptions>(1e-3));
    return std::make_unique<ho::Muon>(std::move(g));
  };
  auto row_box = [&](int64_t rows) { return hp::make_shard_spec({rows, 3}, {{{"dp_shard", world, rank}}, {}}); };
  {
    auto opt = make();
    hp::test::expect_error(
        [&] { opt->distribute(w, {{rank == world - 1 ? v : m, "x", row_box(2 * world)}}); },
        {rank == world - 1 ? "is not a parameter of a Muon group" : "failed on rank " + std::to_string(world - 1)});
    auto twice = make();
    hp::test::expect_error([&] { twice->distribute(w, {{m, "x", row_box(2 * world)}, {m, "y", row_box(2 * world)}}); },
                           {"the parameter of 'y' is given twice"});
  }
  if (world > 1) {
    auto opt = make();
    // Rank 0's piece is declared as rows [0, 2) of [2 world + 1, 3]: one row is nobody's.
    hp::test::expect_error(
        [&] {
          opt->distribute(w, {{m, "x", hp::make_shard_spec({2 * world + 1, 3}, {{{"dp_shard", world + 1, rank}}, {}})}});
        },
        {"the pieces of 'x' cover", "of its"});
    auto schemes = make();
    hp::test::expect_error(
        [&] {
          schemes->distribute(w, {{m, "x", row_box(2 * world)}},
                              rank == 0 ? ho::MuonScheme::kOwner : ho::MuonScheme::kGatherEverywhere);
        },
        {"the ranks give different schemes"});
    // The last rank's group steps with momentum 0.9, the others' 0.95: one matrix would be
    // stepped by two rules.
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{m},
                   std::make_unique<ho::MuonOptions>(options().momentum(rank == world - 1 ? 0.9 : 0.95)));
    ho::Muon mixed(std::move(g));
    hp::test::expect_error([&] { mixed.distribute(w, {{m, "x", row_box(2 * world)}}); },
                           {"the holders of 'x' step it with different Muon options", "rank 0's and rank " +
                                                                                        std::to_string(world - 1) + "'s"});
    auto opt2 = make();
    hp::test::expect_error(
        [&] {
          // Rank 0 says [2 world + 2, 3] (in world + 1 pieces of 2 rows), the others [2 world, 3].
          const int64_t rows = rank == 0 ? 2 * world + 2 : 2 * world, count = rank == 0 ? world + 1 : world;
          opt2->distribute(w, {{m, "x", hp::make_shard_spec({rows, 3}, {{{"dp_shard", count, rank}}, {}})}});
        },
        {"disagree on the shape of 'x'"});
  }
  {
    // A gradient of the wrong shape on the last rank: every rank raises, nothing moves.
    auto opt = make();
    opt->distribute(w, {{m, "x", row_box(2 * world)}});
    const at::Tensor before = m.detach().clone();
    m.mutable_grad() = rank == world - 1 ? at::randn({3, 2}, at::kDouble) : at::randn_like(m);
    hp::test::expect_error([&] { opt->step(); },
                           {rank == world - 1 ? "a gradient of shape [3, 2]" : "failed on another rank"});
    EXPECT_TRUE(at::equal(m.detach(), before));
  }
  {
    auto opt = make();
    opt->distribute(w, {{m, "x", row_box(2 * world)}});
    m.mutable_grad() = rank == 0 || world == 1 ? at::Tensor() : at::randn_like(m);
    if (world == 1) {
      opt->step();  // no gradient anywhere: skipped
    } else {
      hp::test::expect_error([&] { opt->step(); }, {"'x' has a gradient on", "its pieces must all have one or none"});
    }
  }
}

namespace {

// HSDP at 4 ranks: 4 matrices of [4, 6], rows split in halves over 2 ranks and replicated
// twice (rank r holds half r % 2). Owners, one matrix each (equal costs, by name): m0 on
// rank 0, m1 on 1, m2 on 2, m3 on 3. Each owner needs the half it lacks (12 elements),
// held by two replicas, and gives its result's boxes to the 3 other holders (36). By hand,
// the replica that has sent least sends: m0's half 1 from rank 1, m1's half 0 from rank 2,
// m2's half 1 from rank 3, m3's half 0 from rank 0: every rank sends 48 elements. (The
// lowest-ranked replica always sending gave ranks 0 and 1 60 and ranks 2 and 3 36.)
TEST(MuonDist, ReplicasShareTheSends) {
  auto w = hp::world();
  if (w->size() != 4) GTEST_SKIP() << "worked out for 4 ranks";
  const int rank = w->rank();
  std::vector<at::Tensor> params;
  std::vector<ho::MatrixPiece> pieces;
  for (int i = 0; i < 4; ++i) {
    params.push_back(at::zeros({2, 6}, at::kDouble).set_requires_grad(true));
    pieces.push_back({params.back(), "m" + std::to_string(i),
                      hp::make_shard_spec({4, 6}, {{{"dp_shard", 2, rank % 2}}, {}})});
  }
  std::vector<torch::optim::OptimizerParamGroup> g;
  g.emplace_back(params, std::make_unique<ho::MuonOptions>(options()));
  ho::Muon m(std::move(g));
  m.distribute(w, pieces);
  const ho::MuonPlanStats st = m.plan_stats();
  EXPECT_EQ(st.owned, 1);
  EXPECT_EQ(st.send_elements, 48);
  expect_plan_is_the_workload(w, st, {{4, 6}, {4, 6}, {4, 6}, {4, 6}}, 2, 2);
}

}  // namespace
