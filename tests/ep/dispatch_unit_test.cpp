// The permutations of token dispatch against hand-worked values, and the local dispatcher
// (EP 1) against a mixture of experts written out token by token in this test.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <vector>

#include "hp/core/error.h"
#include "hp/ep/dispatch.h"

namespace {

at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

std::vector<int64_t> vec(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

TEST(ExpertMajorOrder, Golden) {
  // Rank 0 sent 2 rows for local expert 0 and 3 for expert 1; rank 1 sent 1 and 4.
  EXPECT_EQ(vec(hp::ep::expert_major_order(longs({2, 3, 1, 4}), 2)),
            (std::vector<int64_t>{0, 1, 5, 2, 3, 4, 6, 7, 8, 9}));
}

TEST(ExpertMajorOrder, EdgeCases) {
  EXPECT_EQ(hp::ep::expert_major_order(longs({0, 0, 0, 0}), 2).numel(), 0);  // nothing received
  EXPECT_EQ(vec(hp::ep::expert_major_order(longs({3}), 1)), (std::vector<int64_t>{0, 1, 2}));  // one expert, one rank
  // One rank: already expert-major.
  EXPECT_EQ(vec(hp::ep::expert_major_order(longs({2, 0, 3}), 3)), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // One local expert per rank: rank-major is expert-major.
  EXPECT_EQ(vec(hp::ep::expert_major_order(longs({1, 2, 0, 1}), 1)), (std::vector<int64_t>{0, 1, 2, 3}));
  // Every row for local expert 1, from both ranks.
  EXPECT_EQ(vec(hp::ep::expert_major_order(longs({0, 2, 0, 3}), 2)), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  // Expert 0 from rank 1 only, expert 1 from rank 0 only.
  EXPECT_EQ(vec(hp::ep::expert_major_order(longs({0, 2, 3, 0}), 2)), (std::vector<int64_t>{2, 3, 4, 0, 1}));
  EXPECT_THROW(hp::ep::expert_major_order(longs({1, 2, 3}), 2), hp::Error);
}

TEST(SortByExpert, StableGolden) {
  // Slots (token*k + j): 0:1 1:0 2:1 3:2 4:0 5:1.
  hp::ep::ExpertSort s = hp::ep::sort_by_expert(longs({1, 0, 1, 2, 0, 1}).view({3, 2}), 4);
  EXPECT_EQ(vec(s.order), (std::vector<int64_t>{1, 4, 0, 2, 5, 3}));
  EXPECT_EQ(vec(s.counts), (std::vector<int64_t>{2, 3, 1, 0}));
  EXPECT_EQ(hp::ep::sort_by_expert(at::zeros({0, 2}, at::kLong), 4).order.numel(), 0);
}

TEST(SortByExpert, RejectsIdsOutsideTheExperts) {
  try {
    hp::ep::sort_by_expert(longs({0, 5}).view({1, 2}), 4);
    FAIL() << "expected an error";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert id 5 is outside [0, 4)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(hp::ep::sort_by_expert(longs({0, -2}).view({1, 2}), 4), hp::Error);
}

// Dropped slots (-1) go last and count for no expert.
TEST(SortByExpert, DroppedSlotsLastAndUncounted) {
  // Slots: 0:1 1:-1 2:0 3:-1 4:1 5:0.
  hp::ep::ExpertSort s = hp::ep::sort_by_expert(longs({1, -1, 0, -1, 1, 0}).view({3, 2}), 3);
  EXPECT_EQ(vec(s.order), (std::vector<int64_t>{2, 5, 0, 4, 1, 3}));
  EXPECT_EQ(vec(s.counts), (std::vector<int64_t>{2, 2, 0}));
}

TEST(TokenDispatcher, RejectsExpertsNotDividingTheGroup) {
  EXPECT_THROW(hp::ep::local_dispatcher(0), hp::Error);
}

// Expert e multiplies by its own matrix W[e]; out[t] = sum_j w[t, j] * x[t] @ W[ids[t, j]],
// written token by token (a dropped slot, id -1, adds nothing).
at::Tensor naive_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w, const std::vector<at::Tensor>& W) {
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    at::Tensor acc = at::zeros({W[0].size(1)}, x.options());
    for (int64_t j = 0; j < ids.size(1); ++j) {
      const int64_t e = ids[t][j].item<int64_t>();
      if (e >= 0) acc = acc + w[t][j] * x[t].matmul(W[e]);
    }
    rows.push_back(acc);
  }
  return at::stack(rows);
}

void check_local_dispatcher(bool drop) {
  at::manual_seed(3);
  const int64_t T = 9, D = 5, E = 4, k = 2;
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({T, D}, opts).requires_grad_(true);
  // Distinct choices per token; expert 3 never chosen (it must get no rows, no gradient).
  at::Tensor ids = std::get<1>(at::rand({T, 3}, opts).topk(k, -1));
  if (drop) {
    // Every third slot dropped, and both of token 0's (it gets nothing from the experts).
    ids.view({-1}).index_fill_(0, at::arange(0, T * k, 3, at::kLong), -1);
    ids[0].fill_(-1);
  }
  at::Tensor w = at::rand({T, k}, opts).requires_grad_(true);
  std::vector<at::Tensor> W;
  for (int64_t e = 0; e < E; ++e) W.push_back(at::randn({D, D}, opts).requires_grad_(true));
  at::Tensor g = at::randn({T, D}, opts);

  auto disp = hp::ep::local_dispatcher(E);
  hp::ep::Dispatched d = disp->dispatch(x, ids, w);
  ASSERT_EQ(d.counts.size(), 4u);
  EXPECT_EQ(d.rows.size(0), (ids >= 0).sum().item<int64_t>()) << "a dropped slot was sent";
  EXPECT_EQ(d.counts[3], 0);
  std::vector<at::Tensor> ys;
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (d.counts[e] > 0) ys.push_back(d.rows.narrow(0, off, d.counts[e]).matmul(W[e]));
    off += d.counts[e];
  }
  at::Tensor out = disp->combine(at::cat(ys), d);
  (out * g).sum().backward();
  std::vector<at::Tensor> grads = {x.grad().clone(), w.grad().clone()};
  for (auto& m : W) grads.push_back(m.grad().defined() ? m.grad().clone() : at::Tensor());

  x.mutable_grad() = at::Tensor();
  w.mutable_grad() = at::Tensor();
  for (auto& m : W) m.mutable_grad() = at::Tensor();
  at::Tensor want = naive_moe(x, ids, w, W);
  (want * g).sum().backward();

  EXPECT_LE((out - want).abs().max().item<double>(), 1e-12);
  EXPECT_LE((grads[0] - x.grad()).abs().max().item<double>(), 1e-12);
  EXPECT_LE((grads[1] - w.grad()).abs().max().item<double>(), 1e-12);
  for (int64_t e = 0; e < 3; ++e) EXPECT_LE((grads[2 + e] - W[e].grad()).abs().max().item<double>(), 1e-12) << e;
  EXPECT_FALSE(grads[5].defined());
}

TEST(LocalDispatcher, MatchesTokenByTokenExpertsForwardAndBackward) { check_local_dispatcher(false); }
TEST(LocalDispatcher, DroppedSlotsAreNotSentAndAddNothing) { check_local_dispatcher(true); }

// The overlapped exchange's exposed time, replayed by hand (seconds as plain numbers):
// 2 chunks, each all-to-all 1; the experts 4 forward (2 a chunk) and 8 backward, the shared
// expert 0.5 and 1.
//   forward: rows in at 1 and 2; shared 0-0.5; chunk 0 1-3, its outputs 3-4; chunk 1 3-5,
//   its outputs 5-6: 6 - 4.5 of compute = 1.5 (chunk 0's rows less the shared expert, 0.5,
//   and the last outputs, 1);
//   backward: output gradients in at 1 and 2; chunk 1 1-5, its rows' gradient 5-6; chunk 0
//   5-9, its rows' gradient 9-10 while the shared expert's backward runs 9-10: 10 - 9 = 1.
// Without chunks: dispatch and combine, all exposed. With the exchange slower than the
// experts (4 chunks of 1 against 0.5 of compute each) the exposed time is the exchange's
// less the compute: 8 - 2 forward.
TEST(OverlapExposure, ReplayedByHand) {
  hp::ep::OverlapTimes t;
  t.rows = t.outputs = 1;
  t.experts_forward = 4;
  t.experts_backward = 8;
  t.shared_forward = 0.5;
  t.shared_backward = 1;
  t.chunks = 2;
  hp::ep::Exposure e = hp::ep::overlap_exposure(t);
  EXPECT_DOUBLE_EQ(e.forward, 1.5);
  EXPECT_DOUBLE_EQ(e.backward, 1);
  t.chunks = 1;
  t.rows = 3;
  t.outputs = 2;
  e = hp::ep::overlap_exposure(t);
  EXPECT_DOUBLE_EQ(e.forward, 5);
  EXPECT_DOUBLE_EQ(e.backward, 5);
  hp::ep::OverlapTimes slow;
  slow.rows = slow.outputs = 1;
  slow.experts_forward = 2;
  slow.experts_backward = 2;
  slow.chunks = 4;
  e = hp::ep::overlap_exposure(slow);
  EXPECT_DOUBLE_EQ(e.forward, 6);
  EXPECT_DOUBLE_EQ(e.backward, 6);
  slow.chunks = 0;
  EXPECT_THROW(hp::ep::overlap_exposure(slow), hp::Error);
}

}  // namespace
