// The overlapped exchange (ep::InFlight): the all-to-all dispatcher's rows and outputs moved
// in chunks of local experts, each chunk's experts running while the other chunks move.
// Every rank draws its own tokens and routing (its own seed: counts, values and choices
// differ by rank). Held against:
// - the same layer through dispatch and combine (no overlap): outputs and the gradients of
//   the tokens, the routing weights and every expert bitwise equal, for every chunk count;
// - the mixture written out token by token over every rank's tokens (float64, 1e-12);
// - the order of issue and wait, read from the trace: every chunk's rows issued before the
//   first chunk's experts run, each chunk's outputs issued before the next chunk's experts,
//   and each wait done before the compute that reads it; in backward every chunk's output
//   gradient issued before the first is waited for, and a chunk's rows' gradient issued
//   before the next chunk's experts run backward;
// - the bytes each rank sends, equal to the plain exchange's, in `chunks` times the
//   all-to-alls, as ep::dispatch_traffic counts them for the planner.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/ep/dispatch.h"
#include "hp/runtime.h"

namespace {

constexpr int64_t kDim = 5, kExperts = 16, kTopK = 3;
const auto kF64 = at::TensorOptions().dtype(at::kDouble);

struct Tokens {
  at::Tensor x, ids, w, g;  // tokens, chosen experts (-1: dropped), weights, the output's gradient
};

enum class Routing { kRandom, kFirstRankOnly, kDropped, kNoTokensOnRank1 };

// Rank q's tokens: 4 + 3q of them, routed by `routing`.
Tokens tokens_of(int q, int n, Routing routing) {
  at::manual_seed(500 + q);
  const int64_t T = routing == Routing::kNoTokensOnRank1 && q == 1 ? 0 : 4 + 3 * q;
  Tokens d;
  d.x = at::randn({T, kDim}, kF64);
  const int64_t choosable = routing == Routing::kFirstRankOnly ? kExperts / n : kExperts;
  d.ids = std::get<1>(at::rand({T, choosable}, kF64).topk(std::min(kTopK, choosable), -1));
  if (routing == Routing::kDropped) d.ids.view({-1}).index_fill_(0, at::arange(0, d.ids.numel(), 4, at::kLong), -1);
  d.w = at::rand(d.ids.sizes(), kF64) + 0.1;
  d.g = at::randn({T, kDim}, kF64);
  return d;
}

std::vector<at::Tensor> expert_weights() {
  at::manual_seed(91);
  std::vector<at::Tensor> W;
  for (int64_t e = 0; e < kExperts; ++e) W.push_back(at::randn({kDim, kDim}, kF64).requires_grad_(true));
  return W;
}

// Each local expert i (of `first` + i) on its block of the rows: tanh(rows W_e), so that the
// backward needs the rows (a wrong row order shows).
at::Tensor run_experts(const at::Tensor& rows, const std::vector<int64_t>& counts, int64_t first,
                       const std::vector<at::Tensor>& W) {
  std::vector<at::Tensor> ys;
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    ys.push_back(at::tanh(rows.narrow(0, off, counts[i]).matmul(W[first + static_cast<int64_t>(i)])));
    off += counts[i];
  }
  return at::cat(ys);
}

struct Result {
  at::Tensor out, x_grad, w_grad;
  std::vector<at::Tensor> expert_grads;
};

// One layer forward and backward, plain (chunks 0) or overlapped in `chunks`.
Result run_layer(const hp::CommPtr& group, const Tokens& t, int chunks) {
  auto disp = hp::ep::all_to_all_dispatcher(group, kExperts);
  std::vector<at::Tensor> W = expert_weights();
  at::Tensor x = t.x.clone().requires_grad_(true), w = t.w.clone().requires_grad_(true);
  const int64_t first = disp->first_local_expert();
  Result r;
  if (chunks == 0) {
    hp::ep::Dispatched d = disp->dispatch(x, t.ids, w);
    r.out = disp->combine(run_experts(d.rows, d.counts, first, W), d);
  } else {
    hp::ep::InFlight f = disp->dispatch_overlapped(x, t.ids, w, chunks);
    for (int g = 0; g < f.chunks(); ++g) {
      hp::trace::Span span("experts " + std::to_string(g));
      f.send_back(g, run_experts(f.rows(g), f.counts(g), first + f.chunk_first(g), W));
    }
    r.out = disp->combine_overlapped(f.returned(), f);
  }
  (r.out * t.g).sum().backward();
  r.x_grad = x.grad();
  r.w_grad = w.grad();
  for (int64_t i = 0; i < disp->local_experts(); ++i) r.expert_grads.push_back(W[first + i].grad());
  return r;
}

// The token-by-token mixture of every rank's tokens: this rank's outputs, and its tokens'
// and weights' gradients; the gradients of this rank's experts.
Result token_by_token(int r, int n, Routing routing) {
  std::vector<at::Tensor> W = expert_weights();
  Result mine;
  at::Tensor total = at::zeros({}, kF64), x_mine, w_mine;
  for (int q = 0; q < n; ++q) {
    Tokens t = tokens_of(q, n, routing);
    at::Tensor x = t.x.clone().requires_grad_(true), w = t.w.clone().requires_grad_(true);
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < x.size(0); ++i) {
      at::Tensor acc = at::zeros({kDim}, kF64);
      for (int64_t j = 0; j < t.ids.size(1); ++j) {
        const int64_t e = t.ids[i][j].item<int64_t>();
        if (e >= 0) acc = acc + w[i][j] * at::tanh(x[i].matmul(W[e]));
      }
      rows.push_back(acc);
    }
    at::Tensor out = rows.empty() ? at::zeros({0, kDim}, kF64) : at::stack(rows);
    total = total + (out * t.g).sum();
    if (q == r) mine.out = out.detach(), x_mine = x, w_mine = w;
  }
  total.backward();
  mine.x_grad = x_mine.grad();
  mine.w_grad = w_mine.grad();
  const int64_t L = kExperts / n;
  // An expert no token chose: a zero gradient (the layer runs every expert, on no rows too).
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor& g = W[r * L + i].grad();
    mine.expert_grads.push_back(g.defined() ? g : at::zeros_like(W[r * L + i]));
  }
  return mine;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined() ? 0 : 1e30;
  if (a.numel() == 0 && b.numel() == 0) return 0;
  return (a - b).abs().max().item<double>();
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.sizes() == b.sizes() && at::equal(a, b);
}

class Overlap : public ::testing::TestWithParam<Routing> {};

TEST_P(Overlap, BitwiseThePlainExchangeAndTheTokenByTokenMixture) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  const Tokens t = tokens_of(r, n, GetParam());
  const Result plain = run_layer(world, t, 0);
  const Result want = token_by_token(r, n, GetParam());
  EXPECT_LE(max_diff(plain.out, want.out), 1e-12);
  if (t.x.size(0) > 0) {
    EXPECT_LE(max_diff(plain.x_grad, want.x_grad), 1e-12);
    EXPECT_LE(max_diff(plain.w_grad, want.w_grad), 1e-12);
  }
  const int64_t L = kExperts / n;
  for (int chunks : {1, 2, static_cast<int>(L)}) {
    if (chunks > L) continue;
    const Result got = run_layer(world, t, chunks);
    const std::string label = std::to_string(chunks) + " chunks of " + std::to_string(L) + " experts";
    EXPECT_TRUE(same(got.out, plain.out)) << label;
    EXPECT_TRUE(same(got.x_grad, plain.x_grad)) << label;
    EXPECT_TRUE(same(got.w_grad, plain.w_grad)) << label;
    for (int64_t i = 0; i < L; ++i) {
      EXPECT_TRUE(same(got.expert_grads[i], plain.expert_grads[i])) << label << ", local expert " << i;
      EXPECT_LE(max_diff(got.expert_grads[i], want.expert_grads[i]), 1e-12) << label << ", local expert " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ep, Overlap,
                         ::testing::Values(Routing::kRandom, Routing::kFirstRankOnly, Routing::kDropped,
                                           Routing::kNoTokensOnRank1),
                         [](const ::testing::TestParamInfo<Routing>& i) {
                           switch (i.param) {
                             case Routing::kRandom: return std::string("Random");
                             case Routing::kFirstRankOnly: return std::string("FirstRankOnly");
                             case Routing::kDropped: return std::string("Dropped");
                             case Routing::kNoTokensOnRank1: return std::string("NoTokensOnRank1");
                           }
                           return std::string("?");
                         });

struct Timed {
  int64_t start, end;
};

// The trace's events of one phase, by kind: the all-to-alls in issue order (each from its
// issue to its completion), the experts' spans and the waits by name.
struct Phase {
  std::vector<Timed> exchanges;
  std::map<std::string, Timed> spans;
};
Phase phase_of(const std::vector<hp::trace::Event>& events) {
  Phase p;
  for (const auto& e : events) {
    const Timed t{e.ts_us, e.ts_us + e.dur_us};
    if (e.cat == "comm" && e.name == "all_to_all") p.exchanges.push_back(t);
    if (e.cat != "comm") p.spans[e.name] = t;
  }
  std::sort(p.exchanges.begin(), p.exchanges.end(), [](const Timed& a, const Timed& b) { return a.start < b.start; });
  return p;
}

// Experts that mark the backward of chunk g in the trace: an identity whose backward
// records a span (the chunk's experts' backward runs right after it).
struct MarkBackward : torch::autograd::Function<MarkBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, int64_t g) {
    ctx->saved_data["g"] = g;
    return y.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    hp::trace::Span span("experts backward " + std::to_string(ctx->saved_data["g"].toInt()));
    return {grads[0], at::Tensor()};
  }
};

TEST(OverlapOrder, ExchangesAreIssuedBeforeTheComputeTheyOverlapAndWaitedBeforeTheirReader) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  if (n == 1) GTEST_SKIP() << "one rank: nothing is exchanged";
  const int64_t L = kExperts / n;
  const int C = static_cast<int>(std::min<int64_t>(L, 4));
  if (C < 2) GTEST_SKIP() << "one local expert: one chunk";
  const Tokens t = tokens_of(r, n, Routing::kRandom);
  auto disp = hp::ep::all_to_all_dispatcher(world, kExperts);
  std::vector<at::Tensor> W = expert_weights();
  at::Tensor x = t.x.clone().requires_grad_(true);
  hp::trace::enable(::testing::TempDir() + "hp_ep_overlap_trace");
  hp::trace::clear();
  hp::ep::InFlight f = disp->dispatch_overlapped(x, t.ids, t.w, C);
  for (int g = 0; g < C; ++g) {
    at::Tensor rows = f.rows(g);
    at::Tensor y;
    {
      hp::trace::Span span("experts " + std::to_string(g));
      y = run_experts(rows, f.counts(g), disp->first_local_expert() + f.chunk_first(g), W);
    }
    f.send_back(g, MarkBackward::apply(y, g));
  }
  at::Tensor out = disp->combine_overlapped(f.returned(), f);
  const Phase fwd = phase_of(hp::trace::events());
  hp::trace::clear();
  (out * t.g).sum().backward();
  const Phase bwd = phase_of(hp::trace::events());
  hp::trace::disable();

  // Forward: the counts, the C chunks' rows, then each chunk's outputs.
  ASSERT_EQ(fwd.exchanges.size(), static_cast<size_t>(1 + 2 * C));
  for (int g = 0; g < C; ++g) {
    const Timed experts = fwd.spans.at("experts " + std::to_string(g));
    const Timed waited = fwd.spans.at("ep wait rows " + std::to_string(g));
    EXPECT_LE(fwd.exchanges[1 + g].start, fwd.spans.at("experts 0").start) << "chunk " << g << "'s rows issued late";
    EXPECT_LE(fwd.exchanges[1 + g].end, experts.start) << "chunk " << g << "'s rows read before they arrived";
    EXPECT_LE(waited.end, experts.start) << "chunk " << g;
    EXPECT_GE(fwd.exchanges[1 + C + g].start, experts.end) << "chunk " << g << "'s outputs issued before computed";
    if (g + 1 < C) {
      EXPECT_LE(fwd.exchanges[1 + C + g].start, fwd.spans.at("experts " + std::to_string(g + 1)).start)
          << "chunk " << g << "'s outputs not issued before the next chunk's experts";
      EXPECT_GE(fwd.spans.at("ep wait rows " + std::to_string(g + 1)).start, experts.end)
          << "chunk " << g + 1 << "'s rows waited for before chunk " << g << " ran";
    }
  }
  // Backward: every chunk's output gradient (the last chunk first), then the rows' gradients
  // chunk by chunk, the last first.
  ASSERT_EQ(bwd.exchanges.size(), static_cast<size_t>(2 * C));
  const int64_t first_wait = bwd.spans.at("ep wait output gradients " + std::to_string(C - 1)).start;
  for (int i = 0; i < C; ++i) EXPECT_LE(bwd.exchanges[i].start, first_wait) << "output gradient " << i;
  for (int g = C - 1; g >= 0; --g) {
    const Timed experts = bwd.spans.at("experts backward " + std::to_string(g));
    EXPECT_LE(bwd.spans.at("ep wait output gradients " + std::to_string(g)).end, experts.start) << "chunk " << g;
    const Timed rows_grad = bwd.exchanges[C + (C - 1 - g)];
    EXPECT_GE(rows_grad.start, experts.end) << "chunk " << g << "'s rows' gradient issued before its experts ran";
    if (g > 0) {
      EXPECT_LE(rows_grad.start, bwd.spans.at("experts backward " + std::to_string(g - 1)).start)
          << "chunk " << g << "'s rows' gradient not issued before chunk " << g - 1 << "'s experts' backward";
    }
  }
}

// The same bytes as the plain exchange, in more all-to-alls: forward 1 + 2C (the counts, C
// of rows, C of outputs), backward 2C; the estimator the planner sums says the same for
// routing balanced as it assumes (token t's j-th choice: expert (3t + j + rank) mod E).
TEST(OverlapTraffic, SameBytesInChunksTimesTheAllToAllsAsTheEstimatorCounts) {
  auto world = hp::world();
  const int n = world->size(), q = world->rank();
  if (n == 1) GTEST_SKIP() << "one rank: no exchange";
  const int64_t L = kExperts / n, T = 2 * kExperts;
  at::manual_seed(40 + q);
  at::Tensor ids = at::empty({T, kTopK}, at::kLong);
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < kTopK; ++j) ids[i][j] = (kTopK * i + j + q) % kExperts;
  }
  const Tokens t{at::randn({T, kDim}, kF64), ids, at::rand({T, kTopK}, kF64), at::randn({T, kDim}, kF64)};
  auto traffic = [&](int chunks) {
    const hp::CommTraffic a = world->traffic();
    auto disp = hp::ep::all_to_all_dispatcher(world, kExperts);
    std::vector<at::Tensor> W = expert_weights();
    at::Tensor x = t.x.clone().requires_grad_(true);
    at::Tensor out;
    if (chunks == 0) {
      hp::ep::Dispatched d = disp->dispatch(x, t.ids, t.w);
      out = disp->combine(run_experts(d.rows, d.counts, disp->first_local_expert(), W), d);
    } else {
      hp::ep::InFlight f = disp->dispatch_overlapped(x, t.ids, t.w, chunks);
      for (int g = 0; g < chunks; ++g) {
        f.send_back(g, run_experts(f.rows(g), f.counts(g), disp->first_local_expert() + f.chunk_first(g), W));
      }
      out = disp->combine_overlapped(f.returned(), f);
    }
    const hp::CommTraffic b = world->traffic();
    (out * t.g).sum().backward();
    const hp::CommTraffic c = world->traffic();
    return std::vector<int64_t>{b.bytes_sent - a.bytes_sent, b.ops - a.ops, c.bytes_sent - b.bytes_sent, c.ops - b.ops};
  };
  const std::vector<int64_t> plain = traffic(0);
  for (int chunks : {1, 2, static_cast<int>(L)}) {
    if (chunks > L) continue;
    const std::vector<int64_t> got = traffic(chunks);
    EXPECT_EQ(got[0], plain[0]) << chunks << " chunks: forward bytes";
    EXPECT_EQ(got[2], plain[2]) << chunks << " chunks: backward bytes";
    EXPECT_EQ(got[1], 1 + 2 * chunks) << chunks << " chunks: forward all-to-alls";
    EXPECT_EQ(got[3], 2 * chunks) << chunks << " chunks: backward all-to-alls";
    hp::ep::ExchangeShape shape;
    shape.ep = n;
    shape.experts = kExperts;
    shape.tokens = static_cast<double>(T);
    shape.k = kTopK;
    shape.row_bytes = kDim * 8;
    shape.chunks = chunks;
    const hp::ep::ExchangeCost cost = hp::ep::dispatch_traffic(hp::ep::DispatcherKind::kAllToAll, shape);
    EXPECT_EQ(static_cast<double>(got[0]), hp::bytes_sent(cost.forward)) << chunks << " chunks";
    EXPECT_EQ(static_cast<double>(got[1]), hp::op_count(cost.forward)) << chunks << " chunks";
    EXPECT_EQ(static_cast<double>(got[2]), hp::bytes_sent(cost.backward)) << chunks << " chunks";
    EXPECT_EQ(static_cast<double>(got[3]), hp::op_count(cost.backward)) << chunks << " chunks";
  }
}

TEST(OverlapErrors, ChunkCountsOrderAndShapesAreCheckedByName) {
  auto world = hp::world();
  const int n = world->size(), r = world->rank();
  const int64_t L = kExperts / n;
  const Tokens t = tokens_of(r, n, Routing::kRandom);
  auto disp = hp::ep::all_to_all_dispatcher(world, kExperts);
  auto expect_error = [](const std::function<void()>& f, const std::string& words) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one naming '" << words << "'";
    } catch (const hp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  // Checked before anything is exchanged, alike on every rank.
  expect_error([&] { disp->dispatch_overlapped(t.x, t.ids, t.w, 0); }, "0 overlap chunks for " + std::to_string(L));
  expect_error([&] { disp->dispatch_overlapped(t.x, t.ids, t.w, static_cast<int>(L) + 1); },
               std::to_string(L + 1) + " overlap chunks");
  if (n > 1) {
    auto dedup = hp::ep::dedup_all_to_all_dispatcher(world, kExperts);
    expect_error([&] { dedup->dispatch_overlapped(t.x, t.ids, t.w, 1); }, "not supported yet");
  }
  if (L < 2) return;
  hp::ep::InFlight f = disp->dispatch_overlapped(t.x, t.ids, t.w, 2);
  expect_error([&] { f.rows(1); }, "overlap chunk 1 taken out of order");
  at::Tensor rows = f.rows(0);
  expect_error([&] { f.rows(1); }, "taken before chunk 0's outputs were sent back");
  expect_error([&] { f.returned(); }, "(0 of 2)");
  expect_error([&] { f.send_back(0, rows.narrow(1, 0, 1)); }, "outputs of overlap chunk 0 must be");
  // Completed in order, so that every rank's collectives match.
  f.send_back(0, rows);
  f.send_back(1, f.rows(1));
  f.returned();
}

}  // namespace
