// Token dispatch over an expert-parallel group (the plain all-to-all dispatcher and the
// de-duplicating one) against the mixture of experts written out token by token on the
// whole batch. Every rank draws every rank's tokens (each from its
// own seed, so ranks differ: token counts, routing and values), runs its own through the
// all-to-all dispatcher with its local experts, and compares outputs and gradients with
// the token-by-token sum over all ranks' tokens computed locally. float64: the two differ
// only in summation order (<= 1e-12).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <set>
#include <string>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/ep/dispatch.h"
#include "hp/runtime.h"

namespace {

constexpr int64_t kDim = 6, kExperts = 8, kTopK = 2;
const auto kF64 = at::TensorOptions().dtype(at::kDouble);

enum class Routing {
  kRandom,        // each token picks 2 distinct experts at random
  kFirstRankOnly, // only EP rank 0's experts are chosen: the other ranks receive nothing
  kOneExpert,     // every token's first choice is the last expert
  kDropped,       // random, with every third slot and all of the first token's dropped (-1)
};

struct RankData {
  at::Tensor x, ids, w, g;  // tokens, chosen experts, their weights, the output's gradient
};

// Rank q's tokens (3 + 2q of them; none for rank 1 when `empty_rank1`).
RankData data_of(int q, int n, Routing routing, bool empty_rank1) {
  at::manual_seed(1000 + q);
  const int64_t T = (empty_rank1 && q == 1) ? 0 : 3 + 2 * q;
  const int64_t local = kExperts / n;
  RankData d;
  d.x = at::randn({T, kDim}, kF64);
  switch (routing) {
    case Routing::kRandom:
      d.ids = std::get<1>(at::rand({T, kExperts}, kF64).topk(kTopK, -1));
      break;
    case Routing::kDropped:
      d.ids = std::get<1>(at::rand({T, kExperts}, kF64).topk(kTopK, -1));
      d.ids.view({-1}).index_fill_(0, at::arange(0, T * kTopK, 3, at::kLong), -1);
      if (T > 0) d.ids[0].fill_(-1);
      break;
    case Routing::kFirstRankOnly:
      d.ids = std::get<1>(at::rand({T, local}, kF64).topk(kTopK, -1));
      break;
    case Routing::kOneExpert: {
      at::Tensor second = std::get<1>(at::rand({T, kExperts - 1}, kF64).topk(1, -1));
      d.ids = at::cat({at::full({T, 1}, kExperts - 1, at::kLong), second}, 1);
      break;
    }
  }
  d.w = at::rand({T, kTopK}, kF64) + 0.1;
  d.g = at::randn({T, kDim}, kF64);
  return d;
}

std::vector<at::Tensor> expert_weights() {
  at::manual_seed(77);
  std::vector<at::Tensor> W;
  for (int64_t e = 0; e < kExperts; ++e) W.push_back(at::randn({kDim, kDim}, kF64).requires_grad_(true));
  return W;
}

at::Tensor naive_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w, const std::vector<at::Tensor>& W) {
  if (x.size(0) == 0) return at::zeros({0, kDim}, kF64);
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    at::Tensor acc = at::zeros({kDim}, kF64);
    for (int64_t j = 0; j < ids.size(1); ++j) {
      const int64_t e = ids[t][j].item<int64_t>();  // -1: dropped, adds nothing
      if (e >= 0) acc = acc + w[t][j] * x[t].matmul(W[e]);
    }
    rows.push_back(acc);
  }
  return at::stack(rows);
}

enum class Kind { kPlain, kDedup };

std::shared_ptr<hp::ep::TokenDispatcher> make(Kind kind, const hp::CommPtr& group) {
  return kind == Kind::kPlain ? hp::ep::all_to_all_dispatcher(group, kExperts)
                              : hp::ep::dedup_all_to_all_dispatcher(group, kExperts);
}

class Dispatchers : public ::testing::TestWithParam<Kind> {};

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 && b.numel() == 0) return 0;
  return (a - b).abs().max().item<double>();
}

void check_against_token_by_token(Kind kind, Routing routing, bool empty_rank1) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  auto disp = make(kind, world);
  ASSERT_EQ(disp->first_local_expert(), r * kExperts / n);

  // This rank: its tokens through the dispatcher and its local experts.
  RankData mine = data_of(r, n, routing, empty_rank1);
  at::Tensor x = mine.x.clone().requires_grad_(true), w = mine.w.clone().requires_grad_(true);
  std::vector<at::Tensor> W = expert_weights();
  hp::ep::Dispatched d = disp->dispatch(x, mine.ids, w);
  ASSERT_EQ(static_cast<int64_t>(d.counts.size()), disp->local_experts());
  std::vector<at::Tensor> ys;
  int64_t off = 0;
  for (int64_t i = 0; i < disp->local_experts(); ++i) {
    if (d.counts[i] > 0) ys.push_back(d.rows.narrow(0, off, d.counts[i]).matmul(W[disp->first_local_expert() + i]));
    off += d.counts[i];
  }
  at::Tensor out = disp->combine(ys.empty() ? d.rows : at::cat(ys), d);
  (out * mine.g).sum().backward();

  // The whole batch, token by token, here.
  std::vector<at::Tensor> W_ref = expert_weights();
  at::Tensor x_ref, w_ref, out_ref;
  at::Tensor total = at::zeros({}, kF64);
  for (int q = 0; q < n; ++q) {
    RankData other = data_of(q, n, routing, empty_rank1);
    at::Tensor xq = other.x.clone().requires_grad_(true), wq = other.w.clone().requires_grad_(true);
    at::Tensor oq = naive_moe(xq, other.ids, wq, W_ref);
    total = total + (oq * other.g).sum();
    if (q == r) x_ref = xq, w_ref = wq, out_ref = oq;
  }
  total.backward();

  EXPECT_LE(max_diff(out, out_ref), 1e-12);
  if (x.size(0) > 0) {
    EXPECT_LE(max_diff(x.grad(), x_ref.grad()), 1e-12);
    EXPECT_LE(max_diff(w.grad(), w_ref.grad()), 1e-12);
  }
  for (int64_t i = 0; i < disp->local_experts(); ++i) {
    const int64_t e = disp->first_local_expert() + i;
    ASSERT_EQ(W[e].grad().defined(), W_ref[e].grad().defined()) << "expert " << e;
    if (W[e].grad().defined()) {
      EXPECT_LE(max_diff(W[e].grad(), W_ref[e].grad()), 1e-12) << "expert " << e;
    }
  }
}

TEST_P(Dispatchers, RandomRoutingMatchesTokenByToken) { check_against_token_by_token(GetParam(), Routing::kRandom, false); }

TEST_P(Dispatchers, RanksThatReceiveNothing) { check_against_token_by_token(GetParam(), Routing::kFirstRankOnly, false); }

TEST_P(Dispatchers, RankWithoutTokens) { check_against_token_by_token(GetParam(), Routing::kRandom, true); }

TEST_P(Dispatchers, DroppedSlotsAreNotSentAndAddNothing) {
  check_against_token_by_token(GetParam(), Routing::kDropped, false);
}

TEST_P(Dispatchers, EveryTokenToOneExpert) { check_against_token_by_token(GetParam(), Routing::kOneExpert, true); }

// Identity experts and weights 1/k: dispatch then combine gives back the tokens, and the
// gradient back unchanged.
TEST_P(Dispatchers, DispatchThenCombineIsTheIdentity) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  auto disp = make(GetParam(), world);
  RankData mine = data_of(r, n, Routing::kRandom, true);
  at::Tensor x = mine.x.clone().requires_grad_(true);
  at::Tensor w = at::full(mine.ids.sizes(), 1.0 / kTopK, kF64);
  hp::ep::Dispatched d = disp->dispatch(x, mine.ids, w);
  at::Tensor out = disp->combine(d.rows, d);
  EXPECT_EQ(max_diff(out, mine.x), 0.0);
  (out * mine.g).sum().backward();
  if (x.size(0) > 0) {
    EXPECT_EQ(max_diff(x.grad(), mine.g), 0.0);
  }
}

// Plain: forward one all-to-all of counts and one of rows to dispatch, one of rows to
// combine; backward one of rows each way. De-duplicating: two more in forward (the copies'
// expert ids and weights) and one more in backward (the weights' gradient). Nothing else.
TEST_P(Dispatchers, CollectivesPerLayer) {
  auto world = hp::world();
  if (world->size() == 1) GTEST_SKIP() << "one rank";
  auto disp = make(GetParam(), world);
  RankData mine = data_of(world->rank(), world->size(), Routing::kRandom, false);
  at::Tensor x = mine.x.clone().requires_grad_(true), w = mine.w.clone().requires_grad_(true);
  auto count = [](const std::vector<hp::trace::Event>& events) {
    int all_to_all = 0, other = 0;
    for (const auto& e : events) {
      if (e.cat != "comm") continue;
      (e.name == "all_to_all" ? all_to_all : other) += 1;
    }
    return std::make_pair(all_to_all, other);
  };
  hp::trace::enable(::testing::TempDir() + "hp_ep_dispatch_trace");
  hp::trace::clear();
  hp::ep::Dispatched d = disp->dispatch(x, mine.ids, w);
  at::Tensor out = disp->combine(d.rows * 2, d);
  auto forward = count(hp::trace::events());
  hp::trace::clear();
  (out * mine.g).sum().backward();
  auto backward = count(hp::trace::events());
  hp::trace::disable();
  const bool dedup = GetParam() == Kind::kDedup;
  EXPECT_EQ(forward, std::make_pair(dedup ? 5 : 3, 0));
  EXPECT_EQ(backward, std::make_pair(dedup ? 3 : 2, 0));
}

// The bytes each dispatcher says it sends to other ranks, against a count by hand: plain,
// a float64 row of kDim per (token, chosen expert) held elsewhere plus the counts; de-
// duplicating, per (token, other rank holding one of its experts) a row, k int64 ids and k
// float64 weights, plus the counts. Combine sends back a row per row received from others.
TEST_P(Dispatchers, BytesSentMatchACountByHand) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  const int64_t L = kExperts / n;
  auto disp = make(GetParam(), world);
  RankData mine = data_of(r, n, Routing::kRandom, false);
  hp::ep::Dispatched d = disp->dispatch(mine.x, mine.ids, mine.w);
  int64_t rows = 0, copies = 0;
  for (int64_t t = 0; t < mine.ids.size(0); ++t) {
    std::set<int64_t> ranks;
    for (int64_t j = 0; j < kTopK; ++j) {
      const int64_t owner = mine.ids[t][j].item<int64_t>() / L;
      if (owner != r) ++rows, ranks.insert(owner);
    }
    copies += static_cast<int64_t>(ranks.size());
  }
  if (GetParam() == Kind::kPlain) {
    EXPECT_EQ(d.dispatch_bytes, rows * kDim * 8 + (n - 1) * L * 8);
  } else {
    EXPECT_EQ(d.dispatch_bytes, copies * (kDim * 8 + kTopK * 16) + (n - 1) * 8);
  }
  // What comes back is what the others sent here, one row each.
  at::Tensor received = at::tensor({GetParam() == Kind::kPlain ? rows : copies}, at::kLong);
  at::Tensor back = at::tensor({d.combine_bytes / (kDim * 8)}, at::kLong);
  world->all_reduce(received).wait();
  world->all_reduce(back).wait();
  EXPECT_EQ(back.item<int64_t>(), received.item<int64_t>());
}

// The exchange's estimator (ep::dispatch_traffic, which the planner sums) against what the
// communicator counts (Communicator::traffic: ops and the bytes a rank sends to the others),
// forward and backward, with routing balanced over the ranks as the estimator takes it:
// 4n tokens on every rank (their values and routing differ between ranks). Plain: token t's
// j-th choice is expert (2t + j + rank) mod 8, so every expert gets n rows of each rank.
// De-duplicating: the 2 choices sit on ranks (t + rank + j) mod n, 2 copies a token, n x 2
// copies to each rank. Seen failing with dedup's counts estimated as the plain dispatcher's
// (8 x experts bytes, where it exchanges a count per rank).
TEST_P(Dispatchers, TrafficIsTheEstimators) {
  auto world = hp::world();
  const int n = world->size(), q = world->rank();
  const bool dedup = GetParam() == Kind::kDedup;
  if (n == 1) GTEST_SKIP() << "one rank: no exchange";
  if (dedup && n < kTopK) GTEST_SKIP() << "a token's " << kTopK << " experts on distinct ranks needs " << kTopK;
  auto disp = make(GetParam(), world);
  const int64_t T = 4 * n, L = kExperts / n;
  at::manual_seed(2000 + q);
  at::Tensor ids = at::empty({T, kTopK}, at::kLong);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < kTopK; ++j) {
      ids[t][j] = dedup ? ((t + q + j) % n) * L + t % L : (kTopK * t + j + q) % kExperts;
    }
  }
  at::Tensor x = at::randn({T, kDim}, kF64).requires_grad_(true);
  at::Tensor w = at::rand({T, kTopK}, kF64).requires_grad_(true);
  const hp::CommTraffic start = world->traffic();
  hp::ep::Dispatched d = disp->dispatch(x, ids, w);
  at::Tensor out = disp->combine(d.rows * 2, d);
  const hp::CommTraffic mid = world->traffic();
  (out * at::randn({T, kDim}, kF64)).sum().backward();
  const hp::CommTraffic end = world->traffic();

  hp::ep::ExchangeShape shape;
  shape.ep = n;
  shape.experts = kExperts;
  shape.tokens = static_cast<double>(T);
  shape.k = kTopK;
  shape.row_bytes = kDim * 8;
  shape.weight_bytes = 8;
  shape.copies = static_cast<double>(T * kTopK);  // every token on kTopK distinct ranks
  const hp::ep::ExchangeCost cost =
      hp::ep::dispatch_traffic(dedup ? hp::ep::DispatcherKind::kDedup : hp::ep::DispatcherKind::kAllToAll, shape);
  EXPECT_EQ(static_cast<double>(mid.bytes_sent - start.bytes_sent), hp::bytes_sent(cost.forward));
  EXPECT_EQ(static_cast<double>(mid.ops - start.ops), hp::op_count(cost.forward));
  EXPECT_EQ(static_cast<double>(end.bytes_sent - mid.bytes_sent), hp::bytes_sent(cost.backward));
  EXPECT_EQ(static_cast<double>(end.ops - mid.ops), hp::op_count(cost.backward));
}

INSTANTIATE_TEST_SUITE_P(Ep, Dispatchers, ::testing::Values(Kind::kPlain, Kind::kDedup),
                         [](const ::testing::TestParamInfo<Kind>& i) {
                           return std::string(i.param == Kind::kPlain ? "Plain" : "Dedup");
                         });

TEST(AllToAllDispatcher, ExpertsMustDivideOverTheGroup) {
  auto world = hp::world();
  if (world->size() == 1) GTEST_SKIP() << "any count divides over one rank";
  try {
    hp::ep::all_to_all_dispatcher(world, world->size() + 1);
    FAIL() << "expected an error";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be split evenly over " + std::to_string(world->size())),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
