// Pipeline parallelism trains like one process: every built-in schedule, alone and with
// fully_shard or tensor (and sequence) parallelism inside the stages, against the whole
// model trained in one process on the global batch with the same AdamW steps. Float64, bound
// 1e-10 relative: the point is the algorithm (micro-batch splitting, loss scaling, the
// transfers, the gradient accumulation and its one reduction), and float64 keeps AdamW from
// turning reduction-order noise into lr-sized differences. The parameters are put together
// here from each rank's rows and pieces (not with the library's gathers).
#include <gtest/gtest.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/deepseek.h"
#include "hp/models/llama.h"
#include "hp/models/tensor_parallel.h"
#include "hp/pp/pipeline.h"
#include "hp/runtime.h"
#include "test_util.h"
#include "tp/tp_test_util.h"

namespace {

constexpr double kBound = 1e-10;

hp::models::LlamaConfig llama_config(int64_t layers) {
  hp::models::LlamaConfig c;
  c.vocab = 32;
  c.dim = 16;
  c.layers = layers;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn_dim = 32;
  return c;
}

hp::models::DeepSeekConfig deepseek_config() {
  hp::models::DeepSeekConfig c;
  c.vocab = 32;
  c.dim = 16;
  c.layers = 4;
  c.dense_layers = 1;
  c.heads = 2;
  c.q_lora_rank = 8;
  c.kv_lora_rank = 8;
  c.qk_nope_dim = 4;
  c.qk_rope_dim = 4;
  c.v_head_dim = 4;
  c.dense_hidden = 16;
  c.experts = 4;
  c.experts_per_token = 2;
  c.shared_experts = 1;
  c.expert_hidden = 8;
  return c;
}

enum class Kind { kGpipe, k1F1B, kInterleaved, kZbH1, kZbV };

struct Layout {
  int pp = 1, v = 1, m = 1;
  Kind kind = Kind::k1F1B;
  int64_t dp = 1, tp = 1;
  bool fusion = true;
  int64_t rep = 1;  // dp_replicate (HSDP when > 1)
  std::shared_ptr<const hp::pp::Schedule> custom;  // run instead of the kind's schedule
  std::string name() const {
    const char* k = kind == Kind::kGpipe ? "gpipe" : kind == Kind::k1F1B ? "1f1b" : kind == Kind::kZbH1 ? "zb-h1" : kind == Kind::kZbV ? "zbv" : "interleaved";
    return hp::detail::str_cat(k, " pp=", pp, " v=", v, " m=", m, " dp_replicate=", rep, " dp_shard=", dp, " tp=", tp,
                               fusion ? "" : " unfused");
  }
};

hp::pp::Schedule schedule_of(const Layout& l) {
  if (l.custom) return *l.custom;
  switch (l.kind) {
    case Kind::kGpipe:
      return hp::pp::gpipe(l.pp, l.m);
    case Kind::k1F1B:
      return hp::pp::one_f_one_b(l.pp, l.m);
    case Kind::kZbH1:
      return hp::pp::zero_bubble_h1(l.pp, l.m);
    case Kind::kZbV:
      return hp::pp::zero_bubble_v(l.pp, l.m);
    case Kind::kInterleaved:
      break;
  }
  return hp::pp::interleaved_1f1b(l.pp, l.v, l.m);
}

struct Result {
  double loss = 0, params = 0;
  int64_t compared = 0;  // parameters compared, over the pp ranks
  int all_gathers = 0, reduce_scatters = 0, handles = 0;  // in the traced step, this rank; handles owning parameters
};

// Trains `steps` AdamW steps of the whole model in one process and of the pipelined layout,
// on the same global batches; returns the largest relative differences (max over ranks).
template <typename Model, typename Config>
Result train(const Config& c, const Layout& l, int steps = 2, bool trace_last = false) {
  auto world = hp::world();
  std::vector<hp::MeshDim> dims = {{"pp", l.pp}, {"dp_shard", l.dp}, {"tp", l.tp}};
  if (l.rep > 1) dims.insert(dims.begin() + 1, hp::MeshDim{"dp_replicate", l.rep});
  auto mesh = std::make_shared<hp::DeviceMesh>(world, dims);
  auto pp = mesh->group("pp"), shard = mesh->group("dp_shard"), tp = mesh->group("tp");
  // The data-parallel ranks (replicas x shards) each see their rows of the batch.
  auto dp = l.rep > 1 ? mesh->group({"dp_replicate", "dp_shard"}) : shard;
  const int stages = l.pp * l.v;
  const auto slices = hp::models::split_layers(c.layers, stages);
  const int64_t rows = l.m, T = 8, B = rows * l.dp * l.rep;  // one row per micro-batch on each dp rank

  Model ref(c);
  ref->init_weights(7);
  ref->to(at::kDouble);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));

  std::vector<Model> chunks;
  std::vector<std::vector<hp::FSDPHandle>> handles;
  std::vector<hp::pp::PipelineStage> pstages;
  std::vector<at::Tensor> params;
  const hp::pp::Schedule sched = schedule_of(l);
  const std::vector<int> mine = sched.stages_of(static_cast<int>(pp->rank()));
  for (int s : mine) {
    Model m(c, slices[static_cast<size_t>(s)]);
    if (l.tp > 1) hp::models::parallelize(m, tp, {});
    m->init_weights(7);
    m->to(at::kDouble);
    std::vector<hp::FSDPHandle> hs;
    if (l.dp * l.rep > 1) {
      hp::FullyShardOptions fo;
      fo.mesh = mesh;
      fo.comm_fusion = l.fusion;
      for (auto& b : m->blocks) hs.push_back(hp::fully_shard(*b, fo));
      hs.push_back(hp::fully_shard(*m, fo));
      for (auto& h : hs) {
        for (auto& p : h->parameters()) params.push_back(p);
      }
    } else {
      for (auto& p : m->parameters()) params.push_back(p);
    }
    chunks.push_back(m);
    handles.push_back(hs);
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    Model m = chunks[i];
    pstages.push_back({mine[i], [m](const at::Tensor& x) mutable { return hp::call(m, x); }, m.ptr().get()});
  }
  Model last = chunks.back();  // the last stage's where this rank holds it (the loss runs only there)
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (mine[i] == stages - 1) last = chunks[i];
  }
  hp::pp::Pipeline pipe(sched, pstages, pp,
                        [last](const at::Tensor& out, const at::Tensor& y) { return last->loss_of_logits(out, y); });
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));

  Result r;
  for (int step = 0; step < steps; ++step) {
    hp::test::Batch b = hp::test::batch(step, B, T, c.vocab);
    ref_opt.zero_grad();
    at::Tensor want = ref->loss_of_logits(ref->forward(b.x), b.y);
    want.backward();
    ref_opt.step();
    opt.zero_grad();
    const int64_t d = dp->rank();
    const bool traced = trace_last && step + 1 == steps;
    if (traced) {
      hp::trace::enable(::testing::TempDir() + "hp_pp_trace");
      hp::trace::clear();
    }
    at::Tensor got = pipe.step(b.x.narrow(0, d * rows, rows), b.y.narrow(0, d * rows, rows));
    if (traced) {
      for (const auto& e : hp::trace::events()) {
        if (e.cat != "comm") continue;
        r.all_gathers += e.name == "all_gather";
        r.reduce_scatters += e.name == "reduce_scatter";
      }
      hp::trace::disable();
      for (auto& hs : handles) {
        for (auto& h : hs) r.handles += h->parameters().empty() ? 0 : 1;  // a stage's root may own none
      }
    }
    opt.step();
    if (got.defined()) {
      at::Tensor mean = got.reshape({1}).clone();
      dp->all_reduce(mean, hp::ReduceOptions{hp::ReduceOp::AVG}).wait();
      r.loss = std::max(r.loss, hp::test::rel(mean, want.detach().reshape({1})));
    }
  }
  // Every parameter put together: dp_shard rows from each handle's state dict, then the tp
  // pieces; named as in the whole model.
  auto want = ref->named_parameters();
  double spread = 0;
  int64_t names = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    auto mine = chunks[i]->named_parameters();
    if (handles[i].empty()) {
      for (const auto& item : mine) {
        at::Tensor full = hp::test::whole(item.value(), hp::test::split_dim(item.value()), tp, &spread);
        r.params = std::max(r.params, hp::test::rel(full, want[item.key()]));
        ++names;
      }
      continue;
    }
    for (size_t h = 0; h < handles[i].size(); ++h) {
      const bool block = h + 1 < handles[i].size();
      std::string at_prefix;
      if (block) {
        // The block's name in the model: find it by identity.
        for (const auto& item : chunks[i]->named_children()) {
          if (item.value().get() == &handles[i][h]->module()) at_prefix = item.key() + ".";
        }
      }
      for (const auto& st : handles[i][h]->state_dict()) {
        const std::string name = at_prefix + st.name;
        at::Tensor piece = at::zeros(st.global_shape, at::kDouble);
        if (st.local.dim() > 0 && st.local.size(0) > 0) piece.narrow(0, st.row_offset, st.local.size(0)).copy_(st.local);
        shard->all_reduce(piece).wait();
        at::Tensor full = hp::test::whole(piece, hp::test::split_dim(mine[name]), tp, &spread);
        r.params = std::max(r.params, hp::test::rel(full, want[name]));
        ++names;
      }
    }
  }
  EXPECT_EQ(spread, 0.0);
  at::Tensor n = at::full({1}, names, at::kLong);
  pp->all_reduce(n).wait();
  r.compared = n.item<int64_t>();
  EXPECT_EQ(r.compared, static_cast<int64_t>(want.size())) << "every parameter of the model on exactly one stage";
  at::Tensor worst = at::tensor({r.loss, r.params}, at::kDouble);
  world->all_reduce(worst, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
  r.loss = worst[0].item<double>();
  r.params = worst[1].item<double>();
  return r;
}

void expect_matches(const Result& r) {
  EXPECT_LE(r.loss, kBound);
  EXPECT_LE(r.params, kBound);
}

std::vector<Layout> pure_pipelines(int p) {
  std::vector<Layout> out;
  for (int m : {p, 2 * p, 2 * p + 1}) {
    out.push_back({p, 1, m, Kind::kGpipe});
    out.push_back({p, 1, m, Kind::k1F1B});
    out.push_back({p, 1, m, Kind::kZbH1});
    out.push_back({p, 2, m, Kind::kZbV});
    // Interleaved runs in rounds of m / max(1, m / p) where that divides (2p + 1 at p = 1, 2).
    if (m % std::max(1, m / p) == 0) out.push_back({p, 2, m, Kind::kInterleaved});
  }
  if (p > 1) out.push_back({p, 2, p + 1, Kind::kInterleaved});  // one round of p + 1
  return out;
}

TEST(Pipeline, EverySchedulematchesOneProcess) {
  const int p = hp::world()->size();
  for (const auto& l : pure_pipelines(p)) {
    SCOPED_TRACE(l.name());
    expect_matches(train<hp::models::Llama>(llama_config(2 * p), l));
  }
}

TEST(Pipeline, FullyShardInsideStagesMatchesOneProcess) {
  const int w = hp::world()->size();
  if (w % 2 != 0 || w < 4) GTEST_SKIP() << "needs pp 2 x dp_shard 2";
  for (bool fusion : {true, false}) {
    for (Layout l : {Layout{2, 1, 2, Kind::k1F1B}, Layout{2, 2, 4, Kind::kInterleaved}, Layout{2, 1, 3, Kind::kGpipe},
                     Layout{2, 1, 3, Kind::kZbH1}, Layout{2, 2, 3, Kind::kZbV}}) {
      l.dp = w / 2;
      l.fusion = fusion;
      SCOPED_TRACE(l.name());
      auto r = train<hp::models::Llama>(llama_config(4), l, 2, /*trace_last=*/fusion);
      expect_matches(r);
      if (fusion) {
        // One all-gather per module per step (at UNSHARD, not per micro-batch) and one
        // reduce-scatter (at REDUCE_GRAD).
        EXPECT_EQ(r.all_gathers, r.handles);
        EXPECT_EQ(r.reduce_scatters, r.handles);
      }
    }
  }
}

TEST(Pipeline, TensorParallelInsideStagesMatchesOneProcess) {
  const int w = hp::world()->size();
  if (w % 2 != 0 || w < 4) GTEST_SKIP() << "needs pp 2 x tp 2";
  for (Layout l : {Layout{2, 1, 2, Kind::k1F1B}, Layout{2, 2, 2, Kind::kInterleaved}, Layout{2, 1, 3, Kind::kZbH1},
                   Layout{2, 2, 3, Kind::kZbV}}) {
    l.tp = w / 2;
    SCOPED_TRACE(l.name());
    expect_matches(train<hp::models::DeepSeek>(deepseek_config(), l));
  }
}

// HSDP inside the stages: pp 2 x dp_replicate 2 x dp_shard 2 (8 ranks).
TEST(Pipeline, HsdpInsideStagesMatchesOneProcess) {
  if (hp::world()->size() != 8) GTEST_SKIP() << "needs pp 2 x dp_replicate 2 x dp_shard 2";
  for (Layout l : {Layout{2, 1, 2, Kind::k1F1B}, Layout{2, 2, 2, Kind::kInterleaved}}) {
    l.dp = 2;
    l.rep = 2;
    SCOPED_TRACE(l.name());
    expect_matches(train<hp::models::Llama>(llama_config(4), l));
  }
}

// The split backward (I then W) leaves bitwise the gradients of the full backward: the same
// model and batch through 1F1B and through ZB-H1, fp32, every parameter's gradient equal.
TEST(Pipeline, SplitBackwardIsBitwiseTheFullBackward) {
  auto world = hp::world();
  const int p = world->size(), m = 2 * p + 1;
  auto c = llama_config(2 * p);
  const auto slices = hp::models::split_layers(c.layers, p);
  hp::test::Batch b = hp::test::batch(0, m, 8, c.vocab);
  std::vector<at::Tensor> grads[2];
  for (int split = 0; split < 2; ++split) {
    hp::models::Llama mdl(c, slices[static_cast<size_t>(world->rank())]);
    mdl->init_weights(7);
    hp::pp::Pipeline pipe(split ? hp::pp::zero_bubble_h1(p, m) : hp::pp::one_f_one_b(p, m),
                          {{world->rank(), [mdl](const at::Tensor& x) mutable { return hp::call(mdl, x); }, mdl.ptr().get()}},
                          world, [mdl](const at::Tensor& o, const at::Tensor& y) { return mdl->loss_of_logits(o, y); });
    pipe.step(b.x, b.y);
    for (const auto& q : mdl->parameters()) {
      ASSERT_TRUE(q.grad().defined());
      grads[split].push_back(q.grad().clone());
    }
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << "parameter " << i;
}

// Whatever schedule a user writes either is rejected before anything runs, or trains as one
// process: the built-in schedules with their compute actions moved at random (the same moves
// on every rank) are given to the pipeline; validation must reject a reordering that cannot
// run (never an internal error, never a hang), and every one it accepts must match one
// process.
TEST(Pipeline, ReorderedSchedulesRunAsOneProcessOrAreRejected) {
  const int p = hp::world()->size();
  const std::vector<Layout> bases = pure_pipelines(p);
  std::mt19937 rng(2026);
  int ran = 0, rejected = 0;
  for (int trial = 0; trial < 60; ++trial) {
    Layout l = bases[rng() % bases.size()];
    hp::pp::Schedule s = schedule_of(l);
    const int moves = 1 + static_cast<int>(rng() % 2);
    for (int k = 0; k < moves; ++k) {
      auto& list = s.actions[rng() % s.actions.size()];
      const size_t from = rng() % list.size(), to = rng() % list.size();
      const hp::pp::Action a = list[from];
      list.erase(list.begin() + static_cast<long>(from));
      list.insert(list.begin() + static_cast<long>(to), a);
    }
    l.custom = std::make_shared<const hp::pp::Schedule>(s);
    SCOPED_TRACE(l.name() + " reordered:\n" + s.to_string());
    try {
      expect_matches(train<hp::models::Llama>(llama_config(2 * p), l, /*steps=*/1));
      ++ran;
    } catch (const hp::Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find("internal error"), std::string::npos) << what;
      EXPECT_NE(what.find("pipeline schedule"), std::string::npos) << what;
      ++rejected;
    }
  }
  std::printf("reordered schedules: %d ran, %d rejected\n", ran, rejected);
  EXPECT_GT(ran, 0);
}

// A stage that does not fit the stage before it, on another rank: every rank raises before
// the first step's transfers (none is left waiting for a transfer that never comes), the
// failing rank naming the shapes.
TEST(Pipeline, StageShapeMismatchAcrossRanksRaisesOnEveryRank) {
  auto world = hp::world();
  const int p = world->size();
  if (p < 2) GTEST_SKIP() << "needs two ranks";
  const auto c = llama_config(2 * p);
  const auto slices = hp::models::split_layers(c.layers, p);
  hp::models::Llama mdl(c, slices[static_cast<size_t>(world->rank())]);
  const bool narrow = world->rank() == 0;  // stage 0 hands on one feature too few
  auto fwd = [mdl, narrow, c](const at::Tensor& x) mutable {
    at::Tensor h = hp::call(mdl, x);
    return narrow ? h.narrow(-1, 0, c.dim - 1) : h;
  };
  hp::pp::Pipeline pipe(hp::pp::one_f_one_b(p, 2), {{world->rank(), fwd, mdl.ptr().get()}}, world,
                        [mdl](const at::Tensor& o, const at::Tensor& y) { return mdl->loss_of_logits(o, y); });
  hp::test::Batch b = hp::test::batch(0, 2, 8, c.vocab);
  if (world->rank() == 1) {
    hp::test::expect_error([&] { pipe.step(b.x, b.y); },
                           {"stage 1's forward of micro-batch 0 failed on its input of shape [1, 8, " +
                                std::to_string(c.dim - 1) + "]",
                            "stage 0's output", "before the first step"});
  } else {
    hp::test::expect_error([&] { pipe.step(b.x, b.y); },
                           {"stage 1 (pp rank 1) failed in the shape check before the first step"});
  }
  // An output the header cannot describe (more than 8 dims) fails on its sender, and the
  // receiver hears of it too.
  auto many_dims = [mdl](const at::Tensor& x) mutable { return hp::call(mdl, x).reshape({1, 1, 1, 1, 1, 1, 1, 1, 1, -1}); };
  hp::pp::Pipeline nine(hp::pp::one_f_one_b(p, 2), {{world->rank(), many_dims, mdl.ptr().get()}}, world,
                        [mdl](const at::Tensor& o, const at::Tensor& y) { return mdl->loss_of_logits(o, y); });
  if (world->rank() == 0) {
    hp::test::expect_error([&] { nine.step(b.x, b.y); }, {"stage 0's output has 10 dims (at most 8 supported)"});
  } else {
    hp::test::expect_error([&] { nine.step(b.x, b.y); }, {"stage 0 (pp rank 0) failed in the shape check"});
  }
}

// The shape check before the first step leaves nothing behind: a stage module's buffers (a
// count of its forwards here, as MoE load counts or running statistics) and the generator (a
// dropout) are as after the step's own forwards alone.
struct CountingStageImpl : torch::nn::Module {
  CountingStageImpl() {
    calls = register_buffer("calls", at::zeros({1}, at::kDouble));
    lin = register_module("lin", torch::nn::Linear(4, 4));
    lin->to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    calls += 1;
    return torch::nn::functional::dropout(lin->forward(x), torch::nn::functional::DropoutFuncOptions().p(0.5));
  }
  at::Tensor calls;
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(CountingStage);

TEST(Pipeline, ShapeCheckLeavesNoTrace) {
  auto self = hp::make_local_communicator();
  CountingStage m;
  const at::Tensor x = at::randn({2, 3, 4}, at::kDouble), y = at::randn({2, 3, 4}, at::kDouble);
  at::manual_seed(5);
  for (int mb = 0; mb < 2; ++mb) m->forward(x.narrow(0, mb, 1));
  const double next = at::rand({1}, at::kDouble).item<double>();
  m->calls.zero_();
  hp::pp::Pipeline pipe(hp::pp::gpipe(1, 2), {{0, [m](const at::Tensor& in) mutable { return hp::call(m, in); }, m.ptr().get()}},
                        self, [](const at::Tensor& o, const at::Tensor& t) { return (o - t).pow(2).mean(); });
  at::manual_seed(5);
  pipe.step(x, y);
  EXPECT_EQ(m->calls.item<double>(), 2.0) << "the shape check's forward was counted";
  EXPECT_EQ(at::rand({1}, at::kDouble).item<double>(), next) << "the shape check's dropout drew from the generator";
}

TEST(Pipeline, BadInputIsNamed) {
  hp::test::expect_error([] { hp::models::split_layers(2, 3); }, {"3 stages over 2 layers", "more stages than layers"});
  hp::test::expect_error([] { hp::models::split_layers(4, 2, {3, 2}); }, {"sum to 5", "4 layers"});
  hp::test::expect_error([] { hp::models::split_layers(4, 2, {4, 0}); }, {"stage 1 has 0 layers"});
  auto self = hp::make_local_communicator();
  hp::models::Llama m(llama_config(2));
  auto fwd = [m](const at::Tensor& x) mutable { return hp::call(m, x); };
  auto loss = [m](const at::Tensor& o, const at::Tensor& y) { return m->loss_of_logits(o, y); };
  hp::test::expect_error([&] { hp::pp::Pipeline(hp::pp::one_f_one_b(2, 2), {{0, fwd, nullptr}}, self, loss); },
                         {"schedule is for 2 ranks", "has 1"});
  hp::test::expect_error([&] { hp::pp::Pipeline(hp::pp::gpipe(1, 2), {{0, fwd, nullptr}}, self, nullptr); },
                         {"holds the last stage but no loss"});
  hp::test::expect_error([&] { hp::pp::Pipeline(hp::pp::interleaved_1f1b(1, 2, 2), {{0, fwd, nullptr}}, self, loss); },
                         {"runs stage 1 on pp rank 0, which was not given"});
  hp::pp::Pipeline pipe(hp::pp::gpipe(1, 2), {{0, fwd, m.ptr().get()}}, self, loss);
  hp::test::Batch b = hp::test::batch(0, 3, 4, 32);
  hp::test::expect_error([&] { pipe.step(b.x, b.y); }, {"inputs of 3 rows does not split into 2 equal micro-batches"});
  // A stage whose input does not fit: named with the shape it got.
  hp::models::Llama head(llama_config(2), hp::models::PipelineSlice{1, 2, false, true});
  auto mismatch = [head](const at::Tensor& x) mutable { return hp::call(head, x); };
  hp::pp::Pipeline two(hp::pp::interleaved_1f1b(1, 2, 2),
                       {{0, [](const at::Tensor& x) { return at::randn({x.size(0), 8, 5}, at::kDouble); }, nullptr},
                        {1, mismatch, nullptr}},
                       self, loss);
  hp::test::expect_error([&] { two.step(b.x.narrow(0, 0, 2), b.y.narrow(0, 0, 2)); },
                         {"stage 1's forward of micro-batch 0 failed on its input of shape [1, 8, 5]", "stage 0's output"});
  hp::test::expect_error([&] { hp::pp::Pipeline(hp::pp::zero_bubble_h1(1, 2), {{0, fwd, nullptr}}, self, loss); },
                         {"stage 0 has no module", "split backwards"});
}

}  // namespace
