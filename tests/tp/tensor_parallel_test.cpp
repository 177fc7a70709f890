// Tensor-parallel placements and layer styles against the unsharded computation done here
// in one process (every rank computes it whole from the same seed), in float64: outputs,
// input gradients and reassembled weight gradients within 1e-10 relative (the pieces sum
// the same products in another order; float64 keeps that far below the bound while a
// missing or doubled reduction is off by O(1)).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>

#include "hp/core/trace.h"
#include "hp/hooks/call.h"
#include "hp/models/llama.h"
#include "hp/runtime.h"
#include "hp/tp/parallelize.h"
#include "test_util.h"

namespace {

using hp::tp::Partial;
using hp::tp::Replicate;
using hp::tp::Shard;

constexpr double kBound = 1e-10;

double rel(const at::Tensor& a, const at::Tensor& b) {
  if (!a.sizes().equals(b.sizes())) return 1e30;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
         (b.to(at::kDouble).abs().max().item<double>() + 1e-300);
}

// The whole tensor from every rank's piece along `dim`, rank r's piece placed at r * len
// (written here, not with the library's gathers).
at::Tensor assemble(const at::Tensor& piece, int64_t dim, const hp::CommPtr& g) {
  if (dim < 0) dim += piece.dim();
  auto shape = piece.sizes().vec();
  shape[dim] *= g->size();
  at::Tensor full = at::zeros(shape, piece.options().dtype(at::kDouble));
  full.narrow(dim, g->rank() * piece.size(dim), piece.size(dim)).copy_(piece.detach());
  g->all_reduce(full).wait();
  return full;
}

// Rank r's piece of `full` along `dim` (the test's own slicing).
at::Tensor piece_of(const at::Tensor& full, int64_t dim, const hp::CommPtr& g) {
  if (dim < 0) dim += full.dim();
  const int64_t len = full.size(dim) / g->size();
  return full.narrow(dim, g->rank() * len, len).clone();
}

// Largest difference of `t` from rank 0's copy, over the group (0: identical everywhere).
double spread(const at::Tensor& t, const hp::CommPtr& g) {
  at::Tensor r0 = t.detach().to(at::kDouble).clone().contiguous();
  g->broadcast(r0, 0).wait();
  at::Tensor d = (t.detach().to(at::kDouble) - r0).abs().max().reshape({1});
  g->all_reduce(d, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
  return d.item<double>();
}

hp::CommPtr tp_group() { return hp::world(); }

at::Tensor rand64(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble));
}

// Counts of tp collectives (by op) recorded in the trace while `fn` runs.
template <typename Fn>
std::map<std::string, int> count_collectives(const std::string& group, Fn&& fn) {
  hp::trace::enable(::testing::TempDir() + "hp_tp_trace");
  hp::trace::clear();
  fn();
  hp::trace::disable();
  std::map<std::string, int> n;
  for (const auto& e : hp::trace::events()) {
    if (e.cat == "comm" && e.args.find("\"group\":\"" + group + "\"") != std::string::npos) n[e.name]++;
  }
  return n;
}

// ---- placements ------------------------------------------------------------------------

TEST(Redistribute, EachTransitionAndItsBackward) {
  auto g = tp_group();
  const int64_t n = g->size(), r = g->rank();
  at::Tensor full = rand64({2, 4 * n, 2 * n}, 1);    // the same on every rank
  at::Tensor grads = rand64({n, 2, 4 * n, 2 * n}, 2);  // rank k's gradient: grads[k]
  at::Tensor mine = grads[r];
  at::Tensor grad_sum = grads.sum(0);
  struct Case {
    const char* what;
    hp::tp::Placement from, to, grad;
    at::Tensor input;              // this rank's local input
    at::Tensor want_out;           // this rank's expected output
    at::Tensor grad_in;            // this rank's gradient of the output
    at::Tensor want_grad;          // expected gradient of the input
  };
  at::Tensor partial = full * (r + 1);  // partials summing to full * n(n+1)/2
  const double tri = n * (n + 1) / 2.0;
  std::vector<Case> cases = {
      {"Shard(1)->Replicate, Partial gradient", Shard(1), Replicate(), Partial(), piece_of(full, 1, g), full, mine,
       piece_of(grad_sum, 1, g)},
      {"Shard(1)->Replicate, Replicate gradient", Shard(1), Replicate(), Replicate(), piece_of(full, 1, g), full,
       grads[0], piece_of(grads[0], 1, g)},
      {"Replicate->Replicate, Partial gradient", Replicate(), Replicate(), Partial(), full, full, mine, grad_sum},
      {"Partial->Replicate", Partial(), Replicate(), Replicate(), partial, full * tri, grads[0], grads[0]},
      {"Partial->Shard(1)", Partial(), Shard(1), Shard(1), partial, piece_of(full * tri, 1, g),
       piece_of(grads[0], 1, g), grads[0]},
      {"Replicate->Shard(-1)", Replicate(), Shard(-1), Shard(-1), full, piece_of(full, -1, g),
       piece_of(grads[0], -1, g), grads[0]},
      {"Partial(avg)->Replicate", Partial(hp::ReduceOp::AVG), Replicate(), Replicate(), partial,
       full * tri / n, grads[0], grads[0] / n},
  };
  for (auto& c : cases) {
    SCOPED_TRACE(c.what);
    at::Tensor x = c.input.clone().requires_grad_(true);
    at::Tensor y = hp::tp::redistribute(x, g, c.from, c.to, c.grad);
    EXPECT_LE(rel(y, c.want_out), kBound);
    y.backward(c.grad_in);
    EXPECT_LE(rel(x.grad(), c.want_grad), kBound);
  }
}

TEST(Redistribute, UnsupportedAndIndivisibleAreClearErrors) {
  auto g = tp_group();
  at::Tensor x = at::ones({4, 4});
  hp::test::expect_error([&] { hp::tp::redistribute(x, g, Shard(0), Shard(1), Shard(1)); },
                         {"Shard(0)", "Shard(1)", "not supported yet"});
  hp::test::expect_error([&] { hp::tp::redistribute(x, g, Replicate(), Partial(), Replicate()); },
                         {"Partial(sum)", "not supported yet"});
  if (g->size() > 1) {
    hp::test::expect_error([&] { hp::tp::redistribute(at::ones({2, 4 * g->size() + 1}), g, Replicate(), Shard(1), Shard(1)); },
                           {"not divisible", std::to_string(4 * g->size() + 1)});
  }
}

TEST(DTensor, DistributeAndFullTensorRoundTrip) {
  auto g = tp_group();
  at::Tensor full = rand64({3, 2 * g->size()}, 3);
  auto d = hp::tp::DTensor::distribute(full, g, Shard(1));
  EXPECT_EQ(d.global_shape(), full.sizes().vec());
  EXPECT_EQ(d.local().size(1), 2);
  EXPECT_TRUE(at::equal(d.full_tensor(), full));
  auto rep = d.redistribute(Replicate(), Replicate());
  EXPECT_TRUE(at::equal(rep.local(), full));
}

// ---- styles ----------------------------------------------------------------------------

struct LinearCase {
  torch::nn::Linear tp{nullptr}, ref{nullptr};
};
LinearCase linear_pair(int64_t in, int64_t out, bool bias) {
  LinearCase c;
  c.ref = torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  c.tp = torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  c.ref->to(at::kDouble);
  c.tp->to(at::kDouble);
  at::NoGradGuard ng;
  c.ref->weight.copy_(rand64({out, in}, 10));
  c.tp->weight.copy_(c.ref->weight);
  if (bias) {
    c.ref->bias.copy_(rand64({out}, 11));
    c.tp->bias.copy_(c.ref->bias);
  }
  return c;
}

TEST(Styles, ColwiseLinear) {
  auto g = tp_group();
  const int64_t n = g->size();
  for (bool seq_input : {false, true}) {
    SCOPED_TRACE(seq_input ? "input Shard(1)" : "input Replicate");
    auto c = linear_pair(6, 4 * n, /*bias=*/true);
    hp::tp::parallelize_module(*c.tp, g, {{"", hp::tp::ColwiseParallel().input(seq_input ? Shard(1) : Replicate())}});
    at::Tensor x = rand64({2, 2 * n, 6}, 20), w = rand64({2, 2 * n, 4 * n}, 21);
    at::Tensor xr = x.clone().requires_grad_(true);
    at::Tensor yr = c.ref->forward(xr);
    (yr * w).sum().backward();
    at::Tensor xt = (seq_input ? piece_of(x, 1, g) : x).requires_grad_(true);
    at::Tensor yt = hp::call(c.tp, xt);  // [.., 4n / n]: split on the last dim
    (yt * piece_of(w, -1, g)).sum().backward();
    EXPECT_LE(rel(assemble(yt, -1, g), yr), kBound);
    EXPECT_LE(rel(xt.grad(), seq_input ? piece_of(xr.grad(), 1, g) : xr.grad()), kBound);
    EXPECT_LE(rel(assemble(c.tp->weight.grad(), 0, g), c.ref->weight.grad()), kBound);
    EXPECT_LE(rel(assemble(c.tp->bias.grad(), 0, g), c.ref->bias.grad()), kBound);
  }
}

TEST(Styles, RowwiseLinearWithBiasAddedOnce) {
  auto g = tp_group();
  const int64_t n = g->size();
  for (auto out : {Replicate(), Shard(1), Partial()}) {
    SCOPED_TRACE(out.to_string());
    auto c = linear_pair(4 * n, 5, /*bias=*/true);
    hp::tp::parallelize_module(*c.tp, g, {{"", hp::tp::RowwiseParallel().output(out)}});
    at::Tensor x = rand64({2, 2 * n, 4 * n}, 30), w = rand64({2, 2 * n, 5}, 31);
    at::Tensor xr = x.clone().requires_grad_(true);
    at::Tensor yr = c.ref->forward(xr);
    (yr * w).sum().backward();
    at::Tensor xt = piece_of(x, -1, g).requires_grad_(true);
    at::Tensor yt = hp::call(c.tp, xt);
    at::Tensor whole;
    if (out.is_replicate()) {
      (yt * w).sum().backward();  // the same loss on every rank
      whole = yt;
    } else if (out.is_shard()) {
      (yt * piece_of(w, 1, g)).sum().backward();
      whole = assemble(yt, 1, g);
    } else {
      (yt * w).sum().backward();
      whole = yt.detach().clone();
      g->all_reduce(whole).wait();
    }
    EXPECT_LE(rel(whole, yr), kBound);
    EXPECT_LE(rel(xt.grad(), piece_of(xr.grad(), -1, g)), kBound);
    EXPECT_LE(rel(assemble(c.tp->weight.grad(), 1, g), c.ref->weight.grad()), kBound);
    EXPECT_LE(rel(c.tp->bias.grad(), c.ref->bias.grad()), kBound);
    EXPECT_EQ(spread(c.tp->bias.grad(), g), 0.0);
  }
}

TEST(Styles, VocabParallelAndColwiseEmbedding) {
  auto g = tp_group();
  const int64_t n = g->size(), V = 5 * n, D = 2 * n;
  at::Tensor ids = at::randint(V, {2, 2 * n}, at::detail::createCPUGenerator(40), at::kLong);
  at::Tensor w = rand64({2, 2 * n, D}, 41);
  for (int variant = 0; variant < 5; ++variant) {
    SCOPED_TRACE(variant);
    auto eo = torch::nn::EmbeddingOptions(V, D);
    // A padding row gets no gradient: in every column piece (3), on the one rank holding it (4).
    if (variant == 3) eo.padding_idx(1);
    if (variant == 4) eo.padding_idx(V - 2);
    torch::nn::Embedding ref(eo), tp(eo);
    ref->to(at::kDouble);
    tp->to(at::kDouble);
    {
      at::NoGradGuard ng;
      ref->weight.copy_(rand64({V, D}, 42));
      tp->weight.copy_(ref->weight);
    }
    (ref->forward(ids) * w).sum().backward();
    at::Tensor y;
    if (variant == 0 || variant == 4) {  // vocabulary-parallel, output whole
      hp::tp::parallelize_module(*tp, g, {{"", hp::tp::RowwiseParallel().input(Replicate())}});
      y = hp::call(tp, ids);
      (y * w).sum().backward();
    } else if (variant == 1) {  // vocabulary-parallel, output in sequence pieces
      hp::tp::parallelize_module(*tp, g, {{"", hp::tp::RowwiseParallel().input(Replicate()).output(Shard(1))}});
      at::Tensor yt = hp::call(tp, ids);
      (yt * piece_of(w, 1, g)).sum().backward();
      y = assemble(yt, 1, g);
    } else {  // colwise: the embedding dim split (with a padding row in variant 3)
      hp::tp::parallelize_module(*tp, g, {{"", hp::tp::ColwiseParallel()}});
      at::Tensor yt = hp::call(tp, ids);
      (yt * piece_of(w, -1, g)).sum().backward();
      y = assemble(yt, -1, g);
    }
    EXPECT_LE(rel(y, ref->forward(ids)), kBound);
    EXPECT_LE(rel(assemble(tp->weight.grad(), variant == 2 || variant == 3 ? 1 : 0, g), ref->weight.grad()), kBound);
    if (eo.padding_idx()) {
      EXPECT_EQ(ref->weight.grad()[*eo.padding_idx()].abs().sum().item<double>(), 0.0);
    }
  }
}

TEST(Styles, SequenceParallelNormGradientIsSummed) {
  auto g = tp_group();
  const int64_t n = g->size();
  hp::models::RMSNorm ref(6, 1e-5), tp(6, 1e-5);
  ref->to(at::kDouble);
  tp->to(at::kDouble);
  {
    at::NoGradGuard ng;
    ref->weight.copy_(rand64({6}, 50));
    tp->weight.copy_(ref->weight);
  }
  hp::tp::parallelize_module(*tp, g, {{"", hp::tp::SequenceParallel()}});
  at::Tensor x = rand64({2, 3 * n, 6}, 51), w = rand64({2, 3 * n, 6}, 52);
  (ref->forward(x) * w).sum().backward();
  at::Tensor yt = hp::call(tp, piece_of(x, 1, g));
  (yt * piece_of(w, 1, g)).sum().backward();
  EXPECT_LE(rel(assemble(yt, 1, g), ref->forward(x)), kBound);
  // Summed over the group (not averaged, not left per rank), and the same on every rank.
  EXPECT_LE(rel(tp->weight.grad(), ref->weight.grad()), kBound);
  EXPECT_EQ(spread(tp->weight.grad(), g), 0.0);
}

// SwiGLU as the Llama plan uses it: one gather at the MLP's input shared by both colwise
// layers, and the collective counts of the sequence-parallel region.
// Dropout on sequence pieces has one process's values (the whole tensor's mask, cut to each
// rank's piece), its gradient too, and leaves the generator where one process leaves it.
TEST(Styles, SequenceParallelDropoutHasOneProcessValues) {
  auto g = tp_group();
  const int64_t n = g->size();
  const at::Tensor x = rand64({2, 4 * n, 6}, 50), w = rand64({2, 4 * n, 6}, 51);
  torch::nn::Dropout ref(0.3);
  at::manual_seed(7);
  at::Tensor xr = x.clone().requires_grad_();
  at::Tensor yr = ref->forward(xr);
  (yr * w).sum().backward();
  const double next_ref = at::rand({1}, at::kDouble).item<double>();
  for (bool sliced_here : {false, true}) {  // input in sequence pieces, or whole and cut by the style
    SCOPED_TRACE(sliced_here);
    torch::nn::Dropout tp(0.3);
    hp::tp::SequenceParallel sp;
    if (sliced_here) sp.input_layout = Replicate();
    hp::tp::parallelize_module(*tp, g, {{"", sp}});
    at::manual_seed(7);
    at::Tensor xt = (sliced_here ? x : piece_of(x, 1, g)).clone().requires_grad_();
    at::Tensor yt = hp::call(tp, xt);
    (yt * piece_of(w, 1, g)).sum().backward();
    EXPECT_TRUE(at::equal(assemble(yt, 1, g), yr));
    at::Tensor gx = sliced_here ? xt.grad() : assemble(xt.grad(), 1, g);
    EXPECT_LE(rel(gx, xr.grad()), kBound);
    EXPECT_EQ(at::rand({1}, at::kDouble).item<double>(), next_ref) << "the generator advanced differently";
    tp->eval();
    EXPECT_TRUE(at::equal(hp::call(tp, xt), sliced_here ? piece_of(xt, 1, g) : xt)) << "eval: no dropout";
  }
  torch::nn::Dropout2d channels(0.3);
  hp::test::expect_error([&] { hp::tp::parallelize_module(*channels, g, {{"", hp::tp::SequenceParallel()}}); },
                         {"SequenceParallel", "Dropout2d", "not supported yet"});
}

TEST(Styles, PreparedInputIsGatheredOnceForItsColwiseLayers) {
  auto g = tp_group();
  const int64_t n = g->size();
  hp::models::SwiGLU ref(4, 4 * n), tp(4, 4 * n);
  ref->to(at::kDouble);
  tp->to(at::kDouble);
  {
    at::NoGradGuard ng;
    uint64_t seed = 62;
    for (auto& item : ref->named_parameters()) item.value().copy_(rand64(item.value().sizes().vec(), seed++));
    auto want = ref->named_parameters();
    for (auto& item : tp->named_parameters()) item.value().copy_(want[item.key()]);
  }
  hp::tp::parallelize_module(*tp, g,
                             {{"", hp::tp::PrepareModuleInput({Shard(1)}, {Replicate()})},
                              {"w1", hp::tp::ColwiseParallel()},
                              {"w3", hp::tp::ColwiseParallel()},
                              {"w2", hp::tp::RowwiseParallel().output(Shard(1))}});
  at::Tensor x = rand64({2, 2 * n, 4}, 60), w = rand64({2, 2 * n, 4}, 61);
  at::Tensor xr = x.clone().requires_grad_(true);
  (ref->forward(xr) * w).sum().backward();
  at::Tensor xt = piece_of(x, 1, g).requires_grad_(true);
  at::Tensor yt;
  auto fwd = count_collectives(g->name(), [&] { yt = hp::call(tp, xt); });
  auto bwd = count_collectives(g->name(), [&] { (yt * piece_of(w, 1, g)).sum().backward(); });
  if (n > 1) {
    EXPECT_EQ(fwd, (std::map<std::string, int>{{"all_gather", 1}, {"reduce_scatter", 1}}));
    EXPECT_EQ(bwd, (std::map<std::string, int>{{"all_gather", 1}, {"reduce_scatter", 1}}));
  }
  EXPECT_LE(rel(assemble(yt, 1, g), ref->forward(x)), kBound);
  EXPECT_LE(rel(xt.grad(), piece_of(xr.grad(), 1, g)), kBound);
  EXPECT_LE(rel(assemble(tp->w1->weight.grad(), 0, g), ref->w1->weight.grad()), kBound);
  EXPECT_LE(rel(assemble(tp->w3->weight.grad(), 0, g), ref->w3->weight.grad()), kBound);
  EXPECT_LE(rel(assemble(tp->w2->weight.grad(), 1, g), ref->w2->weight.grad()), kBound);
}

TEST(LossParallel, MatchesCrossEntropyWithoutBackwardCommunication) {
  auto g = tp_group();
  const int64_t n = g->size(), V = 7 * n;
  at::Tensor logits = rand64({3, 4, V}, 70) * 3;
  at::Tensor targets = at::randint(V, {3, 4}, at::detail::createCPUGenerator(71), at::kLong);
  at::Tensor lr = logits.clone().requires_grad_(true);
  at::Tensor want = torch::nn::functional::cross_entropy(lr.reshape({-1, V}), targets.reshape({-1}));
  want.backward();
  at::Tensor lt = piece_of(logits, -1, g).requires_grad_(true);
  at::Tensor loss;
  auto fwd = count_collectives(g->name(), [&] { loss = hp::tp::vocab_parallel_cross_entropy(lt, targets, g); });
  auto bwd = count_collectives(g->name(), [&] { loss.backward(); });
  EXPECT_LE(rel(loss, want), kBound);
  EXPECT_LE(rel(lt.grad(), piece_of(lr.grad(), -1, g)), kBound);
  // The row maximum, then the sum of exponentials and the target logit in one reduction.
  EXPECT_EQ(fwd, (std::map<std::string, int>{{"all_reduce", 2}}));
  EXPECT_TRUE(bwd.empty());
  hp::test::expect_error([&] { hp::tp::vocab_parallel_cross_entropy(lt, targets.fill_(V), g); },
                         {"target id " + std::to_string(V), "outside the vocabulary"});
}

TEST(Plan, BadPlansAreClearErrors) {
  auto g = tp_group();
  const int64_t n = g->size();
  hp::models::SwiGLU m(4, 4 * n);
  hp::test::expect_error([&] { hp::tp::parallelize_module(*m, g, {{"w9", hp::tp::ColwiseParallel()}}); },
                         {"'w9'", "matches no module"});
  hp::models::RMSNorm norm(4, 1e-5);
  hp::test::expect_error([&] { hp::tp::parallelize_module(*norm, g, {{"", hp::tp::ColwiseParallel()}}); },
                         {"ColwiseParallel", "Linear and Embedding", "RMSNorm"});
  // max_norm renormalizes each row by its whole norm.
  torch::nn::Embedding normed(torch::nn::EmbeddingOptions(4 * n, 2 * n).max_norm(1.0));
  hp::test::expect_error([&] { hp::tp::parallelize_module(*normed, g, {{"", hp::tp::RowwiseParallel()}}); },
                         {"RowwiseParallel", "max_norm=1", "not supported yet"});
  hp::test::expect_error([&] { hp::tp::parallelize_module(*normed, g, {{"", hp::tp::ColwiseParallel()}}); },
                         {"ColwiseParallel", "max_norm=1", "not supported yet"});
  if (n > 1) {
    torch::nn::Linear odd(4, 4 * n + 1);
    hp::test::expect_error([&] { hp::tp::parallelize_module(*odd, g, {{"", hp::tp::ColwiseParallel()}}); },
                           {"'weight'", std::to_string(4 * n + 1), "not divisible", std::to_string(n)});
    hp::tp::parallelize_module(*m, g, {{"w1", hp::tp::ColwiseParallel()}});
    hp::test::expect_error([&] { hp::tp::parallelize_module(*m, g, {{"w1", hp::tp::ColwiseParallel()}}); },
                           {"'w1'", "already split"});
  }
}

TEST(Plan, NamePatterns) {
  EXPECT_TRUE(hp::tp::match_module_name("layers_*.attn.wq", "layers_12.attn.wq"));
  EXPECT_FALSE(hp::tp::match_module_name("layers_*.wq", "layers_1.attn.wq"));  // '*' stops at '.'
  EXPECT_TRUE(hp::tp::match_module_name("*", "output"));
  EXPECT_FALSE(hp::tp::match_module_name("*", "a.b"));
  EXPECT_TRUE(hp::tp::match_module_name("", ""));
  EXPECT_FALSE(hp::tp::match_module_name("attn", "attn_norm"));
  EXPECT_TRUE(hp::tp::match_module_name("*_norm", "attn_norm"));
}

}  // namespace
