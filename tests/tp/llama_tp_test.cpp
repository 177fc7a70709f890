// The Llama model under tensor parallelism (with and without sequence and loss
// parallelism), alone and under fully_shard, trains like the same model in one process on
// the global batch. Float64 with AdamW: the parallel runs sum the same products in other
// orders, which float64 keeps far below AdamW's eps, so losses and parameters agree within
// 1e-10 relative, while a missing, doubled or averaged-instead-of-summed reduction moves
// parameters by O(lr).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <map>
#include <memory>
#include <string>

#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/llama.h"
#include "hp/models/tensor_parallel.h"
#include "hp/runtime.h"
#include "hp/tp/parallelize.h"
#include "test_util.h"

namespace {

constexpr double kBound = 1e-10;

hp::models::LlamaConfig config() {
  hp::models::LlamaConfig c;
  c.vocab = 64;
  c.dim = 32;
  c.layers = 2;
  c.heads = 8;
  c.kv_heads = 4;  // grouped-query: two query heads per key/value head
  c.ffn_dim = 48;
  return c;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  if (!a.sizes().equals(b.sizes())) return 1e30;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
         (b.to(at::kDouble).abs().max().item<double>() + 1e-300);
}

// The tensor-parallel dim of a piece, or -1 for a whole parameter.
int64_t split_dim(const at::Tensor& p) {
  auto spec = hp::tp::parameter_spec(p);
  if (!spec) return -1;
  for (size_t d = 0; d < spec->splits.size(); ++d) {
    if (!spec->splits[d].empty()) return static_cast<int64_t>(d);
  }
  return -1;
}

// The whole parameter from every rank's piece (rank r's piece at r * len along `dim`),
// assembled here; a whole parameter must be bitwise the same on every rank.
at::Tensor whole(const at::Tensor& piece, int64_t dim, const hp::CommPtr& g, double* spread) {
  if (dim < 0) {
    at::Tensor r0 = piece.detach().to(at::kDouble).clone().contiguous();
    g->broadcast(r0, 0).wait();
    at::Tensor d = (piece.detach().to(at::kDouble) - r0).abs().max().reshape({1});
    g->all_reduce(d, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
    *spread = std::max(*spread, d.item<double>());
    return r0;
  }
  auto shape = piece.sizes().vec();
  shape[dim] *= g->size();
  at::Tensor full = at::zeros(shape, at::kDouble);
  full.narrow(dim, g->rank() * piece.size(dim), piece.size(dim)).copy_(piece.detach());
  g->all_reduce(full).wait();
  return full;
}

struct Batch {
  at::Tensor x, y;
};
Batch batch(int step, int64_t B, int64_t T, int64_t vocab) {
  at::Tensor all = at::randint(vocab, {B, T + 1}, at::detail::createCPUGenerator(100 + step), at::kLong);
  return {all.narrow(1, 0, T), all.narrow(1, 1, T)};
}

hp::models::Llama reference(const hp::models::LlamaConfig& c) {
  hp::models::Llama ref(c);
  ref->init_weights(7);
  ref->to(at::kDouble);
  return ref;
}

TEST(LlamaTp, MatchesSingleProcessTraining) {
  auto g = hp::world();
  const auto c = config();
  const int64_t B = 2, T = 8;
  for (bool sp : {true, false}) {
    for (bool lp : {true, false}) {
      SCOPED_TRACE(std::string("sequence_parallel=") + (sp ? "on" : "off") + " loss_parallel=" + (lp ? "on" : "off"));
      auto ref = reference(c);
      hp::models::Llama m(c);
      hp::models::TensorParallelOptions o;
      o.sequence_parallel = sp;
      o.loss_parallel = lp;
      hp::models::parallelize_llama(m, g, o);
      m->init_weights(7);  // each piece gets its box of the layout-independent values
      m->to(at::kDouble);
      torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      for (int step = 0; step < 3; ++step) {
        Batch b = batch(step, B, T, c.vocab);
        ref_opt.zero_grad();
        at::Tensor want = ref->loss(b.x, b.y);
        want.backward();
        ref_opt.step();
        opt.zero_grad();
        at::Tensor got = m->loss(b.x, b.y);
        got.backward();
        opt.step();
        EXPECT_LE(rel(got, want), kBound) << "step " << step;
      }
      auto ref_params = ref->named_parameters();
      double worst = 0, spread = 0;
      for (const auto& item : m->named_parameters()) {
        at::Tensor full = whole(item.value(), split_dim(item.value()), g, &spread);
        worst = std::max(worst, rel(full, ref_params[item.key()]));
      }
      EXPECT_LE(worst, kBound);
      EXPECT_EQ(spread, 0.0);  // whole parameters (norms) stay identical on every rank
    }
  }
}

// Per transformer block: with sequence parallelism 2 all-gathers and 2 reduce-scatters
// forward and the same backward (plus the norms' gradient sums); without it 2 all-reduces
// each way. Around the blocks: the embedding's reduction, the output head's gather (or
// its gradient reduction), and loss parallel's 2 all-reduces.
TEST(LlamaTp, CollectivesPerBlockFromTheTrace) {
  auto g = hp::world();
  if (g->size() == 1) GTEST_SKIP() << "no collectives at one rank";
  const auto c = config();
  const int L = static_cast<int>(c.layers);
  for (bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel only");
    hp::models::Llama m(c);
    hp::models::TensorParallelOptions o;
    o.sequence_parallel = sp;
    hp::models::parallelize_llama(m, g, o);
    Batch b = batch(0, 2, 8, c.vocab);
    hp::trace::enable(::testing::TempDir() + "hp_tp_llama_trace");
    hp::trace::clear();
    at::Tensor loss = m->loss(b.x, b.y);
    auto fwd_events = hp::trace::events();
    hp::trace::clear();
    loss.backward();
    auto bwd_events = hp::trace::events();
    hp::trace::disable();
    auto count = [&](const std::vector<hp::trace::Event>& ev) {
      std::map<std::string, int> n;
      for (const auto& e : ev) {
        if (e.cat == "comm" && e.args.find("\"group\":\"" + g->name() + "\"") != std::string::npos) n[e.name]++;
      }
      return n;
    };
    if (sp) {
      // + embedding reduce-scatter, output head gather, loss 2 all-reduces.
      EXPECT_EQ(count(fwd_events),
                (std::map<std::string, int>{{"all_gather", 2 * L + 1}, {"reduce_scatter", 2 * L + 1}, {"all_reduce", 2}}));
      // + the embedding's and the output head's transposes; 2 norm sums per block + the final norm.
      EXPECT_EQ(count(bwd_events),
                (std::map<std::string, int>{{"all_gather", 2 * L + 1}, {"reduce_scatter", 2 * L + 1}, {"all_reduce", 2 * L + 1}}));
    } else {
      EXPECT_EQ(count(fwd_events), (std::map<std::string, int>{{"all_reduce", 2 * L + 1 + 2}}));
      EXPECT_EQ(count(bwd_events), (std::map<std::string, int>{{"all_reduce", 2 * L + 1}}));
    }
  }
}

// Tensor parallel inside, fully_shard over dp_shard outside: mesh (dp_shard, tp), tp
// innermost. Each dp_shard rank trains on its part of the global batch.
TEST(LlamaTp, UnderFullyShardMatchesSingleProcessTraining) {
  auto w = hp::world();
  if (w->size() != 4) GTEST_SKIP() << "needs 4 ranks (dp_shard 2 x tp 2)";
  auto mesh = std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"dp_shard", 2}, {"tp", 2}});
  auto tp = mesh->group("tp"), dp = mesh->group("dp_shard");
  const auto c = config();
  const int64_t B = 4, T = 8, local = B / 2, dp_rank = mesh->coordinate("dp_shard");
  auto ref = reference(c);
  hp::models::Llama m(c);
  hp::models::parallelize_llama(m, tp);
  m->init_weights(7);
  m->to(at::kDouble);
  hp::FullyShardOptions fo;
  fo.mesh = mesh;
  fo.comm_fusion = true;
  std::vector<hp::FSDPHandle> handles;
  for (auto& blk : m->blocks) handles.push_back(hp::fully_shard(*blk, fo));
  handles.push_back(hp::fully_shard(*m, fo));
  std::vector<at::Tensor> params;
  for (auto& h : handles) {
    for (auto& p : h->parameters()) params.push_back(p);
  }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int step = 0; step < 3; ++step) {
    Batch b = batch(step, B, T, c.vocab);
    ref_opt.zero_grad();
    ref->loss(b.x, b.y).backward();
    ref_opt.step();
    opt.zero_grad();
    at::Tensor x = b.x.narrow(0, dp_rank * local, local), y = b.y.narrow(0, dp_rank * local, local);
    m->loss_of_logits(hp::call(m, x), y).backward();
    opt.step();
  }
  // Each sharded parameter: its dp_shard rows put together here, then its tp pieces.
  double worst = 0, spread = 0;
  for (size_t i = 0; i < handles.size(); ++i) {
    auto mine = handles[i]->module().named_parameters();
    auto want = i + 1 < handles.size() ? ref->blocks[i]->named_parameters() : ref->named_parameters();
    for (const auto& st : handles[i]->state_dict()) {
      at::Tensor piece = at::zeros(st.global_shape, at::kDouble);
      if (st.local.dim() > 0 && st.local.size(0) > 0) piece.narrow(0, st.row_offset, st.local.size(0)).copy_(st.local);
      dp->all_reduce(piece).wait();
      at::Tensor full = whole(piece, split_dim(mine[st.name]), tp, &spread);
      worst = std::max(worst, rel(full, want[st.name]));
    }
  }
  EXPECT_LE(worst, kBound);
  EXPECT_EQ(spread, 0.0);
}

TEST(LlamaTp, LayoutErrorsNameTheValue) {
  auto c = config();
  hp::test::expect_error([&] { hp::models::check_tensor_parallel(c, 3); }, {"tensor_parallel=3", "heads=8"});
  c.kv_heads = 2;
  hp::test::expect_error([&] { hp::models::check_tensor_parallel(c, 4); }, {"kv_heads=2", "not divisible"});
  c = config();
  c.tie_embeddings = true;
  hp::test::expect_error([&] { hp::models::check_tensor_parallel(c, 2); }, {"tie_embeddings", "not supported yet"});
  auto g = hp::world();
  if (g->size() > 1) {
    // A sequence that does not split over the group, under sequence parallelism.
    hp::models::Llama m(config());
    hp::models::parallelize_llama(m, g);
    Batch b = batch(0, 1, 2 * g->size() + 1, config().vocab);
    hp::test::expect_error([&] { m->loss(b.x, b.y); }, {"not divisible", std::to_string(2 * g->size() + 1)});
  }
}

}  // namespace
