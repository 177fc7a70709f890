// hp-train's optimizer: muon (issue 30) against one process written here from the
// formulas, in float64: the hidden matrices by Muon (momentum 0.95, Nesterov, five quintic
// Newton–Schulz steps, the update scaled to 0.2 sqrt(max(rows, cols)), decoupled weight
// decay), the embedding, output head, norms and vectors by libtorch's AdamW. Nothing here
// is shared with the trainer beyond the model, the data and the sample order. Under every
// layout of the world (fully_shard with uneven shards at 3 ranks, HSDP, tensor parallel,
// pipeline stages, expert parallel) the losses of every step and every parameter afterwards,
// by its name and box, are within 1e-10 of it. Muon's momentum is saved and resharded like
// AdamW's moments: a run resumed at the same layout is bitwise a run never stopped, and one
// resumed under another layout continues within 1e-10. The startup line's counts are the
// routing's.
#include <gtest/gtest.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <regex>

#include "hp/core/files.h"
#include "hp/models/deepseek.h"
#include "hp/runtime.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"

namespace ht = hp::train;

namespace {

struct Layout {
  std::string type;
  int64_t data_parallel = 1, tp = 1, pp = 1, ep = 1;
  std::string label() const {
    return type + " dp " + std::to_string(data_parallel) + " tp " + std::to_string(tp) + " pp " + std::to_string(pp) +
           " ep " + std::to_string(ep);
  }
};

ht::TrainConfig muon_config(const Layout& l, int world) {
  ht::TrainConfig c;
  c.model = ht::ModelSpec(l.type);
  if (l.type == "deepseek") {
    c.model.config<hp::models::DeepSeekConfig>().layers = l.pp > 1 ? 4 : 3;
  } else if (l.pp > 1) {
    c.model->set_layers(4);
  }
  c.tensor_parallel = l.tp;
  c.sequence_parallel = l.tp > 1;
  c.pipeline_parallel = l.pp;
  c.expert_parallel = l.ep;
  c.data_parallel = l.data_parallel;
  c.data_parallel_shard = -1;
  c.global_batch_size = world == 3 ? 6 : 8;
  c.micro_batch_num = 2;
  c.seq_length = 16;
  c.lr = 2e-2;
  c.min_lr = 2e-3;
  c.lr_warmup_steps = 1;
  c.weight_decay = 0.1;
  c.clip_grad = 0.3;
  c.train_steps = 4;
  c.data.num_samples = 20;
  c.output_dir = "";
  c.optimizer = ht::OptimizerKind::kMuon;
  c.muon_ns_dtype = at::kDouble;  // the parallel algorithm is what is compared
  c.validate(world);
  c.params_dtype = c.compute_dtype = at::kDouble;
  return c;
}

// Muon's orthogonalization from its definition: the transpose with rows <= columns,
// normalized, five steps of X <- a X + (b X X^T + c (X X^T)^2) X.
at::Tensor naive_newton_schulz(const at::Tensor& d) {
  const bool tall = d.size(0) > d.size(1);
  at::Tensor x = tall ? d.t() : d;
  x = x / (x.norm() + 1e-7);
  for (int k = 0; k < 5; ++k) {
    at::Tensor a = x.mm(x.t());
    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a.mm(a)).mm(x);
  }
  return tall ? x.t() : x;
}

struct Naive {
  std::vector<double> losses;
  std::unique_ptr<ht::TrainModel> model;
  int64_t muon_matrices = 0, muon_elements = 0, adamw_tensors = 0, adamw_elements = 0;
};

// The run in one process on the global batch, `steps` steps: the hidden matrices by Muon
// under optimizer: muon, by AdamW under adamw, and the other way before step `switch_at`
// (a run switched on resume: from then on the matrices' new optimizer starts from nothing,
// while AdamW's state of the rest carries on).
Naive naive_run(const ht::TrainConfig& c, int64_t steps, int64_t switch_at = 0) {
  Naive out;
  out.model = ht::make_model(c);
  auto data = ht::make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);
  ht::DataSharder sharder(data->size(), c.global_batch_size, c.micro_batch_num, c.dp_size(), c.seed, c.data.shuffle);
  std::vector<at::Tensor> all, muon, decay, plain;
  for (const auto& item : out.model->root().named_parameters()) {
    const at::Tensor& p = item.value();
    all.push_back(p);
    const bool table = item.key() == "tok_emb.weight" || item.key() == "output.weight";
    if (p.dim() == 2 && !table) {
      muon.push_back(p);
      ++out.muon_matrices;
      out.muon_elements += p.numel();
      continue;
    }
    (p.dim() >= 2 ? decay : plain).push_back(p);
    ++out.adamw_tensors;
    out.adamw_elements += p.numel();
  }
  auto opts = [&](double wd) {
    return torch::optim::AdamWOptions(c.lr).betas({c.adam_beta1, c.adam_beta2}).eps(c.adam_eps).weight_decay(wd);
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts(c.weight_decay)));
  groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(opts(0.0)));
  torch::optim::AdamW adamw(std::move(groups), opts(0));
  torch::optim::AdamW adamw_matrices(muon, opts(c.weight_decay));  // the matrices under adamw
  std::vector<at::Tensor> momentum(muon.size());
  for (int64_t step = 0; step < steps; ++step) {
    for (auto& p : all) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    double sum = 0;
    for (int64_t j = 0; j < c.micro_batch_num; ++j) {
      at::Tensor b = ht::load_batch(*data, sharder.global_samples(step, j), c.seq_length);
      at::Tensor logits = out.model->forward(b.narrow(1, 0, c.seq_length), false);
      at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, c.model->vocab()}),
                                                             b.narrow(1, 1, c.seq_length).reshape({-1}));
      (loss / static_cast<double>(c.micro_batch_num)).backward();
      sum += loss.item<double>();
    }
    out.losses.push_back(sum / static_cast<double>(c.micro_batch_num));
    torch::nn::utils::clip_grad_norm_(all, c.clip_grad);
    const double progress = static_cast<double>(step - c.lr_warmup_steps + 1) / (c.train_steps - c.lr_warmup_steps);
    const double lr = step < c.lr_warmup_steps ? c.lr * (step + 1) / c.lr_warmup_steps
                                               : c.min_lr + (c.lr - c.min_lr) * 0.5 * (1 + std::cos(M_PI * progress));
    for (auto& g : adamw.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    adamw.step();
    const bool by_muon = (c.optimizer == ht::OptimizerKind::kMuon) == (step >= switch_at);
    if (!by_muon) {
      for (auto& g : adamw_matrices.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
      adamw_matrices.step();
      out.model->after_step(nullptr);
      continue;
    }
    at::NoGradGuard ng;
    for (size_t i = 0; i < muon.size(); ++i) {
      at::Tensor& w = muon[i];
      if (!w.grad().defined()) continue;
      const at::Tensor g = w.grad();
      momentum[i] = momentum[i].defined() ? 0.95 * momentum[i] + g : g.clone();
      const at::Tensor o = naive_newton_schulz(g + 0.95 * momentum[i]);
      const auto rows = static_cast<double>(w.size(0)), cols = static_cast<double>(w.size(1));
      const double scale = c.muon_update_scale == hp::optim::MuonScale::kOriginal
                               ? std::sqrt(std::max(1.0, rows / cols))
                               : c.muon_update_rms * std::sqrt(std::max(rows, cols));
      w.mul_(1 - lr * c.weight_decay).add_(o, -lr * scale);
    }
    out.model->after_step(nullptr);
  }
  return out;
}

// The largest relative difference of any parameter the trainer holds, by its name and box,
// from the naive model's (each rank its own; the worst over the world).
double worst_param_difference(const ht::Trainer& t, ht::TrainModel& naive, const hp::CommPtr& w) {
  auto want = naive.root().named_parameters();
  const auto params = t.sharded_params();
  double worst = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string name = t.parameter_names()[i];
    const hp::ShardSpec box = t.parameter_specs()[i];
    EXPECT_TRUE(want.contains(name)) << name;
    if (!want.contains(name)) continue;
    at::Tensor rows = want[name].detach().reshape(box.global_shape);
    for (size_t d = 0; d < box.offsets.size(); ++d) rows = rows.narrow(static_cast<int64_t>(d), box.offsets[d], box.lengths[d]);
    if (rows.numel() == 0) continue;
    worst = std::max(worst, ((params[i].reshape(box.lengths) - rows).abs().max() / want[name].abs().max()).item<double>());
  }
  at::Tensor x = at::tensor({worst}, at::kDouble);
  w->all_reduce(x, {hp::ReduceOp::MAX}).wait();
  return x.item<double>();
}

std::vector<Layout> layouts(int world) {
  std::vector<Layout> out = {{"llama"}, {"deepseek"}};
  if (world == 2) {
    out.push_back({"llama", 1, 2});        // tensor parallel (sequence parallel), pieces on both dims
    out.push_back({"llama", 1, 1, 2});     // pipeline stages
    out.push_back({"deepseek", 1, 1, 1, 2});  // experts whole on their rank
  }
  if (world == 4) {
    out.push_back({"llama", 2});              // HSDP 2 x 2: replicas compute each matrix once
    out.push_back({"deepseek", 2});
    out.push_back({"llama", 1, 2});           // tp 2 x dp_shard 2
    out.push_back({"deepseek", 1, 1, 2});     // pp 2 x dp_shard 2
    out.push_back({"deepseek", 1, 1, 1, 4});  // ep 4
    out.push_back({"deepseek", 2, 1, 1, 2});  // dp 2 x ep 2
  }
  return out;
}

}  // namespace

TEST(MuonTrainer, EveryLayoutMatchesOneProcess) {
  auto w = hp::world();
  for (const Layout& l : layouts(w->size())) {
    SCOPED_TRACE(l.label());
    const ht::TrainConfig c = muon_config(l, w->size());
    Naive naive = naive_run(c, c.train_steps);
    ht::Trainer t(c, w);
    for (int64_t s = 0; s < c.train_steps; ++s) {
      const double loss = t.step().loss, want = naive.losses[static_cast<size_t>(s)];
      EXPECT_NEAR(loss, want, 1e-10 * want) << "step " << s + 1;
    }
    EXPECT_LT(naive.losses.back(), naive.losses.front()) << "the run does not train";
    EXPECT_LE(worst_param_difference(t, *naive.model, w), 1e-10);
    // The startup line's counts against the routing written above.
    if (w->rank() == 0 && l.pp == 1 && l.ep == 1) {
      const std::string line = ht::describe_optimizer(c);
      const std::string want = "muon " + std::to_string(naive.muon_matrices) + " matrices (" +
                               std::to_string(naive.muon_elements) + " parameters), adamw " +
                               std::to_string(naive.adamw_tensors) + " tensors (" + std::to_string(naive.adamw_elements);
      EXPECT_NE(line.find(want), std::string::npos) << line << "\nwant: " << want;
    }
  }
}

// The bytes the trainer reports against the owner scheme worked out by hand, at fully_shard
// over 2 ranks (rows even, so each rank holds half of every matrix): per matrix, the
// non-owner sends its half to the owner and the owner sends the other half of the result
// back, so every rank sends half of every matrix per step, whoever owns it, in the
// iteration's dtype (float64, 8 bytes); and before them one all-reduce of a count per
// matrix and an error flag (int64; at 2 ranks an all-reduce sends its whole tensor). The
// rest of the step's traffic (fully_shard's gathers and reductions, the norm, the loss) is
// the optimizer's business not at all: the same under AdamW, whose step sends nothing.
// One rank: nothing is sent.
TEST(MuonTrainer, ReportedBytesAreTheOwnerSchemes) {
  auto w = hp::world();
  if (w->size() > 2) GTEST_SKIP() << "worked out for 1 and 2 ranks";
  ht::TrainConfig c = muon_config(Layout{"llama"}, w->size());
  const Naive counts = naive_run(c, 0);
  for (const auto& item : counts.model->root().named_parameters()) {
    if (item.value().dim() == 2) {
      ASSERT_EQ(item.value().size(0) % 2, 0) << item.key() << ": the halves are uneven";
    }
  }
  const int64_t muon_bytes =
      w->size() == 1 ? 0 : 8 * (counts.muon_elements / 2) + 8 * (counts.muon_matrices + 1);
  std::vector<ht::StepStats> muon, adamw;
  {
    ht::Trainer t(c, w);
    for (int s = 0; s < 2; ++s) muon.push_back(t.step());
  }
  c.optimizer = ht::OptimizerKind::kAdamW;
  {
    ht::Trainer t(c, w);
    for (int s = 0; s < 2; ++s) adamw.push_back(t.step());
  }
  for (int s = 0; s < 2; ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1));
    EXPECT_EQ(muon[s].optimizer_comm_bytes, muon_bytes);
    EXPECT_EQ(adamw[s].optimizer_comm_bytes, 0);
    EXPECT_EQ(muon[s].comm_bytes - muon[s].optimizer_comm_bytes, adamw[s].comm_bytes);
    EXPECT_EQ(adamw[s].comm_bytes > 0, w->size() > 1);
    EXPECT_GT(muon[s].optimizer_time_s, 0);
    EXPECT_LT(muon[s].optimizer_time_s, muon[s].step_time_s);
  }
}

// The update scale's keys reach the optimizer: muon_update_scale: original (sqrt(max(1,
// rows / cols))) and the rms scale at another target, each 3 steps under fully_shard over
// the world against one process computing the scale from its own formula.
TEST(MuonTrainer, UpdateScaleKeys) {
  auto w = hp::world();
  for (const std::string& set : {std::string("muon_update_scale=original"), std::string("muon_update_rms=0.35")}) {
    SCOPED_TRACE(set);
    ht::TrainConfig c = muon_config(Layout{"llama"}, w->size());
    if (set == "muon_update_scale=original") {
      c.muon_update_scale = hp::optim::MuonScale::kOriginal;
    } else {
      c.muon_update_rms = 0.35;
    }
    c.train_steps = 3;
    const Naive naive = naive_run(c, 3);
    ht::Trainer t(c, w);
    for (int64_t s = 0; s < 3; ++s) {
      EXPECT_NEAR(t.step().loss, naive.losses[static_cast<size_t>(s)], 1e-10 * naive.losses[static_cast<size_t>(s)]);
    }
    EXPECT_LE(worst_param_difference(t, *naive.model, w), 1e-10);
  }
}

// Saved after 2 steps and resumed: at the same layout bitwise the run never stopped; under
// another layout of the world (FSDP over every rank <-> tensor parallel 2) within 1e-10 of
// one process (the reduction order differs).
TEST(MuonTrainer, MomentumIsSavedAndResharded) {
  auto w = hp::world();
  const std::string dir = ::testing::TempDir() + "hp_muon_resume_" + std::to_string(w->size());
  const Layout first{"llama"};
  ht::TrainConfig c = muon_config(first, w->size());
  std::vector<ht::StepStats> straight;
  std::vector<at::Tensor> want;
  {
    ht::Trainer t(c, w);
    for (int s = 0; s < 4; ++s) {
      straight.push_back(t.step());
      if (s == 1) t.save(dir);
    }
    for (const auto& p : t.sharded_params()) want.push_back(p.detach().clone());
  }
  {
    ht::Trainer r(c, w);
    r.load(dir);
    for (int s = 2; s < 4; ++s) EXPECT_EQ(r.step().loss, straight[static_cast<size_t>(s)].loss) << "step " << s + 1;
    const auto got = r.sharded_params();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << "parameter " << i;
  }
  if (w->size() % 2 == 0) {
    const ht::TrainConfig other = muon_config({"llama", 1, 2}, w->size());
    Naive naive = naive_run(other, 4);
    ht::Trainer r(other, w);
    r.load(dir);
    for (int s = 2; s < 4; ++s) {
      EXPECT_NEAR(r.step().loss, naive.losses[static_cast<size_t>(s)], 1e-10 * naive.losses[static_cast<size_t>(s)]);
    }
    EXPECT_LE(worst_param_difference(r, *naive.model, w), 1e-10);
  }
  if (w->rank() == 0) hp::files::remove_tree(dir);
}

// A run switched between the optimizers on resume, both ways: saved after 2 steps under one,
// resumed under the other (into a trainer that has stepped once already), against the same
// switch in one process (naive_run): every loss and, after 4 steps, every parameter within
// 1e-10. The matrices' new optimizer starts from
// nothing; AdamW's moments of the rest are the saved ones. The report counts the matrices
// (fresh) and the rest (kept) as the test routes them.
TEST(MuonTrainer, ResumeSwitchesTheOptimizer) {
  auto w = hp::world();
  for (const bool to_muon : {true, false}) {
    SCOPED_TRACE(to_muon ? "adamw -> muon" : "muon -> adamw");
    const std::string dir =
        ::testing::TempDir() + "hp_muon_switch_" + std::to_string(w->size()) + (to_muon ? "_to_muon" : "_to_adamw");
    ht::TrainConfig after = muon_config(Layout{"llama"}, w->size());
    if (!to_muon) after.optimizer = ht::OptimizerKind::kAdamW;
    ht::TrainConfig before = after;
    before.optimizer = to_muon ? ht::OptimizerKind::kAdamW : ht::OptimizerKind::kMuon;
    const Naive naive = naive_run(after, 4, /*switch_at=*/2);
    {
      ht::Trainer t(before, w);
      for (int s = 0; s < 2; ++s) {
        EXPECT_NEAR(t.step().loss, naive.losses[static_cast<size_t>(s)], 1e-10 * naive.losses[static_cast<size_t>(s)]);
      }
      t.save(dir);
    }
    ht::Trainer r(after, w);
    r.step();  // a trainer that has state of its own already: the load replaces all of it
    const ht::ResumeReport report = r.load(dir);
    EXPECT_EQ(report.saved_optimizer, before.optimizer);
    EXPECT_EQ(report.fresh_tensors, naive.muon_matrices);
    EXPECT_EQ(report.fresh_elements, naive.muon_elements);
    EXPECT_EQ(report.kept_tensors, naive.adamw_tensors);
    for (int s = 2; s < 4; ++s) {
      EXPECT_NEAR(r.step().loss, naive.losses[static_cast<size_t>(s)], 1e-10 * naive.losses[static_cast<size_t>(s)])
          << "step " << s + 1;
    }
    EXPECT_LE(worst_param_difference(r, *naive.model, w), 1e-10);
    const std::string line = ht::resume_optimizer_line(report, after);
    const std::string want = std::string("optimizer: ") + (to_muon ? "adamw" : "muon") + " in the checkpoint, " +
                             (to_muon ? "muon" : "adamw") + " in this config: " + std::to_string(naive.muon_matrices) +
                             " parameters (" + std::to_string(naive.muon_elements) + " elements)";
    EXPECT_EQ(line.rfind(want, 0), 0u) << line << "\nwant: " << want;
    w->barrier().wait();
    if (w->rank() == 0) hp::files::remove_tree(dir);
  }
  // Nothing changed: no line.
  ht::TrainConfig c = muon_config(Layout{"llama"}, w->size());
  ht::ResumeReport same;
  same.saved_optimizer = c.optimizer;
  EXPECT_EQ(ht::resume_optimizer_line(same, c), "");
}

// muon_* keys under optimizer: adamw are named, not ignored; bad Muon settings are named.
TEST(MuonTrainer, ConfigErrors) {
  auto expect_error = [](const std::string& text, const std::string& part) {
    try {
      ht::TrainConfig c = ht::parse_config(text);
      c.validate(1);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error("muon_lr: 0.01\n", "muon_lr=0.01 is given but optimizer=adamw");
  expect_error("muon_nesterov: false\n", "muon_nesterov=false is given but optimizer=adamw");
  expect_error("optimizer: muon\nmuon_ns_coefficients: per_step\nmuon_ns_steps: 3\n", "muon_ns_steps=3");
  expect_error("optimizer: muon\nmuon_ns_dtype: float16\n", "muon_ns_dtype=Half is not supported yet");
  expect_error("optimizer: muon\nmuon_momentum: 1\n", "muon_momentum");
  expect_error("optimizer: sgd\n", "optimizer=sgd: expected one of: adamw, muon");
  expect_error("muon_update_rms: 0.3\n", "muon_update_rms=0.3 is given but optimizer=adamw");
  expect_error("optimizer: muon\nmuon_update_scale: original\nmuon_update_rms: 0.3\n",
               "muon_update_rms=0.3 is given but muon_update_scale=original");
  expect_error("optimizer: muon\nmuon_update_rms: 0\n", "muon_update_rms");
  ht::TrainConfig c = ht::parse_config("optimizer: muon\nlr: 0.004\nweight_decay: 0.2\n");
  c.validate(1);
  EXPECT_EQ(c.muon_lr, 0.004) << "muon_lr defaults to lr";
  EXPECT_EQ(c.muon_weight_decay, 0.2) << "muon_weight_decay defaults to weight_decay";
  // The optimizer's settings as text parse back to the same settings, before validate() and
  // after, and validate (the fuzzer found muon_lr=-1 in the text before validate()); under
  // adamw, Muon keys equal to what they would be unset are no error.
  for (const std::string text : {"lr: 0.02\n", "optimizer: muon\nlr: 0.02\nmuon_weight_decay: 0.3\n"}) {
    ht::TrainConfig a = ht::parse_config(text);
    for (int validated = 0; validated < 2; ++validated) {
      if (validated) a.validate(1);
      std::vector<std::string> sets;
      for (const auto& [k, v] : ht::resolved_settings(a)) {
        if (k == "optimizer" || k == "lr" || k == "weight_decay" || k.rfind("muon_", 0) == 0) sets.push_back(k + "=" + v);
      }
      ht::TrainConfig b = ht::parse_config("", sets);
      EXPECT_NO_THROW(b.validate(1)) << text;
      ht::TrainConfig v = a;
      if (!validated) v.validate(1);
      EXPECT_EQ(ht::resolved_settings(b), ht::resolved_settings(v)) << text;
    }
  }
}
