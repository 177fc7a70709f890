#include "hp/train/trainer.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>
#include <set>
#include <thread>

#include "hp/ckpt/checkpoint.h"
#include "hp/ckpt/safetensors.h"
#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/master_weights.h"
#include "hp/models/family.h"
#include "hp/optim/foreach_adamw.h"
#include "hp/pp/pipeline.h"
#include "hp/train/checkpoint_manager.h"
#include "hp/tp/dtensor.h"

namespace hp::train {

double lr_at(const TrainConfig& c, int64_t step) {
  if (step < c.lr_warmup_steps) return c.lr * static_cast<double>(step + 1) / c.lr_warmup_steps;
  const int64_t decay_steps = std::max<int64_t>(1, c.train_steps - c.lr_warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - c.lr_warmup_steps + 1) / decay_steps);
  switch (c.lr_decay_style) {
    case LrDecay::kConstant:
      return c.lr;
    case LrDecay::kLinear:
      return c.lr - (c.lr - c.min_lr) * progress;
    case LrDecay::kCosine:
      break;
  }
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

double global_grad_norm(const std::vector<at::Tensor>& grads, const CommPtr& shards) {
  return global_grad_norm(grads, std::vector<bool>(grads.size(), false), shards, nullptr);
}

double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& split, const CommPtr& shards,
                        const CommPtr& tp) {
  return global_grad_norm(grads, split, shards, tp, nullptr);
}

double global_grad_norm(const std::vector<at::Tensor>& grads, const std::vector<bool>& split, const CommPtr& shards,
                        const CommPtr& tp, const CommPtr& pp) {
  HP_CHECK(split.size() == grads.size(), "global_grad_norm: ", grads.size(), " gradients but ", split.size(),
           " split flags");
  at::Tensor sums = at::zeros({2}, at::kDouble);  // [whole on every tp rank, tp pieces]
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (g.defined() && g.numel() > 0) sums[split[i] ? 1 : 0] += g.to(at::kDouble).square().sum();
  }
  if (shards && shards->size() > 1) shards->all_reduce(sums).wait();
  if (tp && tp->size() > 1) {
    at::Tensor pieces = sums.narrow(0, 1, 1).clone();
    tp->all_reduce(pieces).wait();
    sums[1] = pieces[0];
  }
  if (pp && pp->size() > 1) pp->all_reduce(sums).wait();
  return std::sqrt(sums.sum().item<double>());
}

double clip_grads_(const std::vector<at::Tensor>& grads, double max_norm, double norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  const double scale = max_norm / (norm + 1e-6);
  for (const at::Tensor& g : grads) {
    if (g.defined()) g.mul_(scale);
  }
  return scale;
}

namespace {

using Clock = std::chrono::steady_clock;

void cast_params(torch::nn::Module& m, at::ScalarType dtype) {
  // Parameters only: buffers such as the MoE balancing bias and load stay fp32.
  torch::NoGradGuard ng;
  for (auto& p : m.parameters()) {
    if (p.scalar_type() != dtype) p.set_data(p.to(dtype));
  }
}

// AdamW (multi-tensor, same results as libtorch's) with weight decay on matrices
// (dim >= 2) and none on norm scales and vectors.
std::unique_ptr<torch::optim::Optimizer> make_adamw(const TrainConfig& c, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> decay, plain;
  for (const at::Tensor& p : params) {
    if (!p.requires_grad()) continue;
    (p.dim() >= 2 ? decay : plain).push_back(p);
  }
  auto opts = [&](double wd) {
    return torch::optim::AdamWOptions(c.lr).betas({c.adam_beta1, c.adam_beta2}).eps(c.adam_eps).weight_decay(wd);
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts(c.weight_decay)));
  if (!plain.empty()) groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(opts(0.0)));
  return std::make_unique<optim::ForeachAdamW>(std::move(groups), opts(c.weight_decay));
}

void check_finite(int64_t step, const char* what, double x) {
  if (!std::isfinite(x)) {
    throw TrainingDiverged(detail::str_cat("step ", step, ": the ", what, " is ", x,
                                           ": training diverged (try a lower lr, or clip_grad > 0)"));
  }
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

at::Tensor next_token_loss(TrainModel& m, const at::Tensor& batch, int64_t seq, bool hooked) {
  at::Tensor x = batch.narrow(1, 0, seq), y = batch.narrow(1, 1, seq);
  return m.loss_of_logits(m.forward(x, hooked), y);
}

}  // namespace

std::unique_ptr<TrainModel> make_model(const TrainConfig& c, bool deferred, const models::PipelineSlice& slice) {
  std::unique_ptr<memory::DeferredAllocation> scope;
  if (deferred) scope = std::make_unique<memory::DeferredAllocation>();
  std::unique_ptr<TrainModel> out = c.model->build(slice, recompute_policy(c.recompute));
  if (!deferred) out->init_weights(c.seed);
  cast_params(out->root(), c.params_dtype);
  return out;
}

std::vector<int64_t> stage_params(const TrainConfig& c) {
  const int stages = static_cast<int>(c.pipeline_parallel * c.pipeline_parallel_interleave_num);
  std::vector<int64_t> out;
  for (const auto& slice : models::split_layers(c.model->layers(), stages, c.pipeline_stage_layers)) {
    out.push_back(c.model->stage_params(slice));
  }
  return out;
}

pp::Schedule pipeline_schedule(const TrainConfig& c) {
  const int pp = static_cast<int>(c.pipeline_parallel), v = static_cast<int>(c.pipeline_parallel_interleave_num);
  const int m = static_cast<int>(c.micro_batch_num);
  switch (c.pipeline_schedule) {
    case PipelineScheduleKind::kGPipe:
      return pp::gpipe(pp, m);
    case PipelineScheduleKind::k1F1B:
      return pp::one_f_one_b(pp, m);
    case PipelineScheduleKind::kZBH1:
      return pp::zero_bubble_h1(pp, m);
    case PipelineScheduleKind::kZBV:
      return pp::zero_bubble_v(pp, m);
    case PipelineScheduleKind::kInterleaved:
      return pp::interleaved_1f1b(pp, v, m);
    case PipelineScheduleKind::kAuto:
      break;
  }
  throw Error("pipeline_schedule: the config is not validated (auto is not resolved)");
}

// ---------------------------------------------------------------------------------------

struct Trainer::Impl {
  TrainConfig c;
  CommPtr world, dp, shards, tp, pp;
  std::shared_ptr<DeviceMesh> mesh;
  std::unique_ptr<TrainModel> model;  // without pipeline parallelism
  // With it: this rank's stages (each a part of the model), run by `pipe`.
  std::vector<std::unique_ptr<TrainModel>> stages;
  std::unique_ptr<pp::Pipeline> pipe;
  std::vector<FSDPHandle> handles;
  std::shared_ptr<const TokenDataset> data;
  std::unique_ptr<DataSharder> sharder;
  int64_t dp_rank = 0;
  std::vector<at::Tensor> params;
  // Per params[i]: its name in the whole model and its box of the global tensor.
  std::vector<std::string> names;
  std::vector<ShardSpec> specs;
  std::vector<torch::nn::Module*> roots;  // the model, or this rank's stages
  // save_async: the thread writing the copied state, over its own communicator (split from
  // the world when first needed, so its collectives never interleave with training's).
  CommPtr ckpt_comm;
  std::thread saver;
  std::exception_ptr save_error;
  // The sharded parameters that are shards of tensor-parallel pieces.
  std::set<const c10::TensorImpl*> tp_pieces;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<FP32MasterOptimizer> master;
  int64_t steps = 0;

  // Tied embeddings under pipeline parallelism: the first and the last stage each hold a copy
  // of the embedding; their gradients are summed over `tie_group` (the pp ranks of the two
  // stages with this rank's dp/tp coordinates) after each backward, and the last stage's copy
  // is left out of the gradient norm (counted once).
  std::vector<size_t> tied;       // indices into params of this rank's copies
  std::vector<bool> norm_skip;    // per params[i]: the duplicate copy
  CommPtr tie_group;
  std::vector<at::Tensor> main_grads_of;  // per params[i]: its fp32 main gradient (with masters)

  // The gradient the optimizer steps params[i] with (its main gradient with fp32 masters).
  at::Tensor grad_of(size_t i) const { return master ? main_grads_of[i] : params[i].grad(); }

  // The gradients to clip and step with; `split` (when given) says which are
  // tensor-parallel pieces, `skip` which are the duplicate copy of a tied parameter.
  std::vector<at::Tensor> grads(std::vector<bool>* split = nullptr, std::vector<bool>* skip = nullptr) const {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) continue;
      at::Tensor g = grad_of(i);
      if (!g.defined()) continue;
      out.push_back(g);
      if (split) split->push_back(tp_pieces.count(params[i].unsafeGetTensorImpl()) > 0);
      if (skip) skip->push_back(!norm_skip.empty() && norm_skip[i]);
    }
    return out;
  }
};

Trainer::Trainer(const TrainConfig& cfg, CommPtr world, std::shared_ptr<const TokenDataset> data)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.c = cfg;
  s.world = std::move(world);
  const TrainConfig& c = s.c;
  HP_CHECK(c.dp_size() * c.tensor_parallel * c.pipeline_parallel == s.world->size(), "Trainer: the config's layout (",
           c.data_parallel, " x ", c.data_parallel_shard, " x tensor_parallel ", c.tensor_parallel,
           " x pipeline_parallel ", c.pipeline_parallel, ") does not cover the world of ", s.world->size(),
           " (validate the config first)");
  // (pp, dp_replicate, dp_shard, tp): tensor parallel innermost, on consecutive ranks;
  // pipeline stages outermost.
  std::vector<MeshDim> dims;
  dims.push_back({"pp", c.pipeline_parallel});
  if (c.data_parallel > 1) dims.push_back({"dp_replicate", c.data_parallel});
  dims.push_back({"dp_shard", c.data_parallel_shard});
  dims.push_back({"tp", c.tensor_parallel});
  s.mesh = std::make_shared<DeviceMesh>(s.world, dims);
  s.dp = c.data_parallel > 1 ? s.mesh->group({"dp_replicate", "dp_shard"}) : s.mesh->group("dp_shard");
  s.shards = s.mesh->group("dp_shard");
  s.tp = s.mesh->group("tp");
  s.pp = s.mesh->group("pp");
  s.dp_rank = s.dp->rank();

  // Built without storage: each rank materializes only its shards (plus one parameter at a
  // time), so a model larger than a rank's memory can be trained.
  auto shard_model = [&](TrainModel& m) {
    if (c.tensor_parallel > 1) {
      // Before fully_shard, which then shards each rank's pieces; the initializer reads each
      // piece's box of the global tensor.
      m.parallelize(s.tp, c.sequence_parallel, mixed_precision(c).reduce_dtype);
    }
    FullyShardOptions o;
    o.param_init = models::parameter_initializer(m.root(), c.seed);
    o.mesh = s.mesh;
    o.reshard_after_forward = c.data_parallel_shard_strategy == ShardStrategy::kOptimGradsParams;
    o.reshard_after_forward_group_size = static_cast<int>(c.reshard_after_forward_group_size);
    o.comm_fusion = c.comm_fusion;
    o.mp_policy = mixed_precision(c);
    const size_t first = s.handles.size();
    FullyShardOptions block_o = o;
    // The blocks only: the root's gather is small, and a tied head on a pipeline's last
    // stage reads the embedding's weight without the embedding's call (safe today only
    // because the schedule gathers each stage's root before its micro-batches).
    block_o.wait_per_submodule = c.wait_per_submodule;
    for (torch::nn::Module* b : m.blocks()) s.handles.push_back(fully_shard(*b, block_o));
    s.handles.push_back(fully_shard(m.root(), o));
    materialize_deferred_buffers(m.root());
    s.roots.push_back(&m.root());
    for (size_t k = first; k < s.handles.size(); ++k) {
      auto& h = s.handles[k];
      // The module's name in the model ("layers_3."), for the whole model's parameter names.
      std::string prefix;
      for (const auto& item : m.root().named_modules("", /*include_self=*/false)) {
        if (item.value().get() == &h->module()) prefix = item.key() + ".";
      }
      std::vector<at::Tensor> sharded = h->parameters();
      std::vector<ShardedTensor> entries = h->state_dict();
      auto module_params = h->module().named_parameters();
      HP_INTERNAL_ASSERT(sharded.size() == entries.size(), "fully_shard handle: parameters and state_dict differ");
      for (size_t i = 0; i < sharded.size(); ++i) {
        if (tp::parameter_spec(module_params[entries[i].name])) s.tp_pieces.insert(sharded[i].unsafeGetTensorImpl());
        s.params.push_back(sharded[i]);
        s.names.push_back(prefix + entries[i].name);
        s.specs.push_back(entries[i].spec);
        s.main_grads_of.push_back(h->main_grads()[i]);
        s.norm_skip.push_back(false);
      }
    }
  };
  if (c.pipeline_parallel == 1) {
    s.model = make_model(c, /*deferred=*/true);
    shard_model(*s.model);
  } else {
    const int pp = static_cast<int>(c.pipeline_parallel), v = static_cast<int>(c.pipeline_parallel_interleave_num);
    pp::Schedule schedule = pipeline_schedule(c);
    const auto slices = models::split_layers(c.model->layers(), pp * v, c.pipeline_stage_layers);
    std::vector<pp::PipelineStage> stages;
    std::vector<int> stage_of;  // per params[i]: the stage holding it
    for (int st : schedule.stages_of(s.pp->rank())) {
      s.stages.push_back(make_model(c, /*deferred=*/true, slices[static_cast<size_t>(st)]));
      TrainModel* mdl = s.stages.back().get();
      shard_model(*mdl);
      stage_of.resize(s.params.size(), st);
      stages.push_back({st, [mdl](const at::Tensor& x) { return mdl->forward(x, /*hooked=*/true); }, &mdl->root()});
    }
    // The last stage's model (under ZBV on rank 0, with the first).
    TrainModel* last = nullptr;
    for (size_t k = 0; k < stages.size(); ++k) {
      if (stages[k].stage == pp * v - 1) last = s.stages[k].get();
    }
    const std::vector<std::string> tied_names = c.model->tied_parameters();
    HP_CHECK(tied_names.size() <= 1, "model family ", c.model.family().name(), ": ", tied_names.size(),
             " tied parameters under pipeline parallelism is not supported yet (one is)");
    if (!tied_names.empty()) {
      // On two ranks, summed over a group of the two (split off the pp group by every rank);
      // on one (ZBV puts the first and the last stage on rank 0), summed here.
      const int first = schedule.rank_of(0), last_rank = schedule.rank_of(pp * v - 1);
      if (first != last_rank && (s.pp->rank() == first || s.pp->rank() == last_rank)) {
        s.tie_group = s.pp->new_group({first, last_rank});
      }
      // This rank's copies: on the first stage, and (skipped by the norm) on the last.
      for (size_t i = 0; i < s.params.size(); ++i) {
        if (s.names[i] != tied_names.front()) continue;
        s.tied.push_back(i);
        s.norm_skip[i] = stage_of[i] == pp * v - 1;
      }
    }
    s.pipe = std::make_unique<pp::Pipeline>(schedule, std::move(stages), s.pp,
                                            [last](const at::Tensor& out, const at::Tensor& y) {
                                              HP_INTERNAL_ASSERT(last != nullptr, "a loss on a rank without the last stage");
                                              return last->loss_of_logits(out, y);
                                            });
  }
  if (c.fp32_master()) {
    s.master = std::make_unique<FP32MasterOptimizer>(
        s.handles, [&c](std::vector<at::Tensor> masters) { return make_adamw(c, masters); });
  } else {
    s.opt = make_adamw(c, s.params);
  }

  s.data = data ? std::move(data) : make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);
  s.sharder = std::make_unique<DataSharder>(s.data->size(), c.global_batch_size, c.micro_batch_num, c.dp_size(),
                                            c.seed, c.data.shuffle);
  if (!c.init_from_hf.empty()) load_hf(c.init_from_hf);
}

Trainer::~Trainer() {
  if (impl_ && impl_->saver.joinable()) impl_->saver.join();  // a save in flight completes
}

StepStats Trainer::step() {
  Impl& s = *impl_;
  const TrainConfig& c = s.c;
  memory::reset_peak();
  const auto t0 = Clock::now();
  double loss_sum = 0;  // of the micro-batches' mean losses (on this data-parallel rank)
  std::vector<at::Tensor> batches;
  for (int64_t j = 0; j < c.micro_batch_num; ++j) {
    try {
      batches.push_back(load_batch(*s.data, s.sharder->samples(s.steps, j, s.dp_rank), c.seq_length));
    } catch (const Error& e) {
      throw Error(detail::str_cat("step ", s.steps + 1, ", micro-batch ", j + 1, ": ", e.what()));
    }
    if (s.pipe) continue;
    at::Tensor loss = next_token_loss(*s.model, batches.back(), c.seq_length, /*hooked=*/true);
    (loss / static_cast<double>(c.micro_batch_num)).backward();
    loss_sum += loss.item<double>();
    batches.clear();
  }
  if (s.pipe) {
    // The micro-batches in order, one after the other: the pipeline splits them back.
    at::Tensor all = at::cat(batches);
    at::Tensor mean = s.pipe->step(all.narrow(1, 0, c.seq_length), all.narrow(1, 1, c.seq_length));
    // The mean is on the last stage's ranks: summed over pp (zeros elsewhere).
    at::Tensor l = at::full({1}, mean.defined() ? mean.item<double>() : 0.0, at::kDouble);
    s.pp->all_reduce(l).wait();
    loss_sum = l.item<double>() * static_cast<double>(c.micro_batch_num);
  }
  if (s.tied.size() == 2) {  // both copies on this rank: each becomes their sum
    at::Tensor a = s.grad_of(s.tied[0]), b = s.grad_of(s.tied[1]);
    HP_INTERNAL_ASSERT(a.defined() && b.defined(), "a tied embedding without a gradient");
    a.add_(b);
    b.copy_(a);
  } else if (s.tie_group) {
    for (size_t i : s.tied) {
      at::Tensor g = s.grad_of(i);
      HP_INTERNAL_ASSERT(g.defined(), "a tied embedding without a gradient");
      s.tie_group->all_reduce(g).wait();  // both copies: the sum of their stages' parts
    }
  }
  StepStats st;
  st.step = s.steps + 1;
  std::vector<bool> split, skip;
  std::vector<at::Tensor> grads = s.grads(&split, &skip);
  std::vector<at::Tensor> counted;
  std::vector<bool> counted_split;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (skip[i]) continue;
    counted.push_back(grads[i]);
    counted_split.push_back(split[i]);
  }
  st.grad_norm = global_grad_norm(counted, counted_split, s.shards, s.tp, s.pp);  // the same on every rank
  check_finite(st.step, "gradient norm", st.grad_norm);
  clip_grads_(grads, c.clip_grad, st.grad_norm);
  st.lr = lr_at(c, s.steps);
  if (s.master) {
    set_lr(s.master->inner(), st.lr);
    s.master->step();
    s.master->zero_grad();
  } else {
    set_lr(*s.opt, st.lr);
    s.opt->step();
    s.opt->zero_grad();
  }
  if (s.model) s.model->after_step(s.dp);
  for (auto& m : s.stages) m->after_step(s.dp);

  at::Tensor loss = at::full({1}, loss_sum / c.micro_batch_num, at::kDouble);
  s.dp->all_reduce(loss, {ReduceOp::AVG}).wait();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  at::Tensor worst = at::tensor({secs, static_cast<double>(memory::peak_bytes())}, at::kDouble);
  s.world->all_reduce(worst, {ReduceOp::MAX}).wait();
  st.loss = loss.item<double>();
  check_finite(st.step, "loss", st.loss);
  st.step_time_s = worst[0].item<double>();
  st.peak_bytes = static_cast<int64_t>(worst[1].item<double>());
  st.tokens_per_s = static_cast<double>(c.global_batch_size * c.seq_length) / st.step_time_s;
  ++s.steps;
  return st;
}

TrainSummary Trainer::train(CheckpointManager* checkpoints, const TrainCallbacks& cb) {
  const TrainConfig& c = impl_->c;
  TrainSummary out;
  out.first_step = steps_done();
  double first_s = 0;
  while (steps_done() < c.train_steps) {
    const StepStats st = step();
    out.losses.push_back(st.loss);
    out.seconds += st.step_time_s;
    if (out.steps++ == 0) first_s = st.step_time_s;
    out.peak_bytes = std::max(out.peak_bytes, st.peak_bytes);
    if (cb.on_step) cb.on_step(st);
    if (checkpoints && checkpoints->due(st.step, c.train_steps)) {
      const std::string dir = checkpoints->save(*this);
      if (cb.on_save) cb.on_save(dir, checkpoints->options().async);
    }
  }
  if (checkpoints && checkpoints->options().async) checkpoints->wait(*this);
  const double tokens = static_cast<double>(c.global_batch_size * c.seq_length);
  if (out.steps > 1) {
    out.tokens_per_s = tokens * static_cast<double>(out.steps - 1) / (out.seconds - first_s);
  } else if (out.steps == 1) {
    out.tokens_per_s = tokens / out.seconds;
  }
  return out;
}

namespace {

// The settings a checkpoint cannot be resumed under a change of: the model's.
std::vector<std::pair<std::string, std::string>> fixed_settings(const TrainConfig& c) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [k, v] : resolved_settings(c)) {
    if (k.rfind("model.", 0) == 0) out.emplace_back(k, v);
  }
  return out;
}

// The optimizer's AdamW state of `p`, created (zeros, step 0: what the first step would
// create) when it has none yet.
torch::optim::AdamWParamState& adamw_state(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto& states = opt.state();
  auto key = optim::state_key(states, p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(0);
    st->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    st->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    it = states.emplace(key, std::move(st)).first;
  }
  return static_cast<torch::optim::AdamWParamState&>(*it->second);
}

}  // namespace

// Every tensor of the training state as checkpoint items (see save()), the optimizer's
// largest step count through `step`, and each parameter's own (AdamW skips a parameter
// without a gradient, as an MoE expert no token reached: the counts can differ) through
// `steps` when given.
static std::vector<ckpt::Item> state_items(Trainer::Impl& s, int64_t* step,
                                           std::map<std::string, int64_t>* steps = nullptr) {
  std::vector<ckpt::Item> items;
  torch::optim::Optimizer& opt = s.master ? s.master->inner() : *s.opt;
  size_t j = 0;  // index into the masters: the parameters that require grad
  *step = 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    items.push_back({s.names[i], s.params[i].detach(), s.specs[i]});
    if (!s.params[i].requires_grad()) continue;
    at::Tensor stepped = s.params[i];
    if (s.master) {
      stepped = s.master->masters()[j++];
      items.push_back({s.names[i] + ".master", stepped.detach(), s.specs[i]});
    }
    auto& st = adamw_state(opt, stepped);
    *step = std::max<int64_t>(*step, st.step());
    if (steps) (*steps)[s.names[i]] = st.step();
    items.push_back({s.names[i] + ".exp_avg", st.exp_avg(), s.specs[i]});
    items.push_back({s.names[i] + ".exp_avg_sq", st.exp_avg_sq(), s.specs[i]});
  }
  for (torch::nn::Module* root : s.roots) {
    for (const auto& b : root->named_buffers()) {
      std::vector<int64_t> shape = b.value().sizes().vec();
      if (shape.empty()) shape = {1};
      items.push_back({b.key(), b.value().view(shape), make_shard_spec(shape, {})});
    }
  }
  return items;
}

// The small values of a checkpoint: the steps done, AdamW's step, the model settings.
static std::map<std::string, std::string> saved_values(const Trainer::Impl& s, int64_t opt_step,
                                                       const std::map<std::string, int64_t>& steps) {
  std::map<std::string, std::string> values = {{"steps", std::to_string(s.steps)},
                                               {"optimizer_step", std::to_string(opt_step)}};
  for (const auto& [name, n] : steps) values["optimizer_step." + name] = std::to_string(n);
  // Which parameters hold a (zeroed) gradient between steps: libtorch 1.x's zero_grad() keeps
  // one, and AdamW then steps the parameter even when it gets no gradient (an MoE expert no
  // token reached), where one that never had a gradient is skipped. Restored on load.
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (!s.master && s.params[i].requires_grad() && s.params[i].grad().defined()) values["grad_held." + s.names[i]] = "1";
  }
  for (const auto& [k, v] : fixed_settings(s.c)) values["config." + k] = v;
  return values;
}

void Trainer::save(const std::string& dir) const {
  Impl& s = *impl_;
  HP_CHECK(!s.saver.joinable(), "Trainer::save while a save_async is running: call wait_for_save() first");
  int64_t opt_step = 0;
  std::map<std::string, int64_t> steps;
  auto items = state_items(s, &opt_step, &steps);
  std::map<std::string, std::string> values = saved_values(s, opt_step, steps);
  ckpt::save(items, dir, s.world, values);
}

void Trainer::wait_for_save() {
  Impl& s = *impl_;
  if (s.saver.joinable()) s.saver.join();
  if (s.save_error) {
    std::exception_ptr e = s.save_error;
    s.save_error = nullptr;
    std::rethrow_exception(e);
  }
}

void Trainer::save_async(const std::string& dir, std::function<void()> then) {
  Impl& s = *impl_;
  wait_for_save();
  if (!s.ckpt_comm) {
    CommOptions o;
    o.name = "checkpoint";
    s.ckpt_comm = s.world->split(0, s.world->rank(), o);
  }
  int64_t opt_step = 0;
  std::map<std::string, int64_t> steps;
  auto items = state_items(s, &opt_step, &steps);
  for (auto& it : items) it.local = it.local.clone();  // the state as it is now
  std::map<std::string, std::string> values = saved_values(s, opt_step, steps);
  s.saver = std::thread([&s, items = std::move(items), values = std::move(values), dir, then = std::move(then)] {
    try {
      ckpt::save(items, dir, s.ckpt_comm, values);
      if (then) then();
    } catch (...) {
      s.save_error = std::current_exception();
    }
  });
}

void Trainer::load(const std::string& dir) {
  Impl& s = *impl_;
  // The saved settings first (the metadata alone): a changed model is named by its key,
  // not by the first tensor whose shape it changed.
  const std::map<std::string, std::string> values = ckpt::load({}, dir);
  // Compared as values (the saved text is parsed as the config's would be), not as text.
  std::vector<std::pair<std::string, std::string>> saved;
  for (const auto& [k, v] : values) {
    if (k.rfind("config.model.", 0) == 0) saved.emplace_back(k.substr(7), v);
  }
  TrainConfig then;
  then.model = model_from_settings(saved, "resume from " + dir + ": the checkpoint's config");
  const auto theirs = fixed_settings(then);
  for (const auto& [k, v] : fixed_settings(s.c)) {
    auto it = values.find("config." + k);
    auto parsed = std::find_if(theirs.begin(), theirs.end(), [&k = k](const auto& e) { return e.first == k; });
    HP_CHECK(it != values.end() && parsed != theirs.end() && parsed->second == v, "resume from ", dir, ": ", k, "=",
             it == values.end() ? std::string("(not saved)") : it->second, " in the checkpoint but ", k, "=", v,
             " in this config (the model cannot change on resume)");
  }
  int64_t unused = 0;
  auto items = state_items(s, &unused);
  {
    at::NoGradGuard ng;
    ckpt::load(items, dir);
  }
  auto number = [&](const char* key) {
    auto it = values.find(key);
    HP_CHECK(it != values.end(), "resume from ", dir, ": the checkpoint has no '", key, "' (not written by hp-train)");
    return std::stoll(it->second);
  };
  s.steps = number("steps");
  const int64_t opt_step = number("optimizer_step");
  torch::optim::Optimizer& opt = s.master ? s.master->inner() : *s.opt;
  size_t j = 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (!s.params[i].requires_grad()) continue;
    // Each parameter's own count (the largest for a checkpoint that has none per parameter).
    auto it = values.find("optimizer_step." + s.names[i]);
    const int64_t n = it == values.end() ? opt_step : std::stoll(it->second);
    adamw_state(opt, s.master ? s.master->masters()[j++] : s.params[i]).step(n);
    if (!s.master && values.count("grad_held." + s.names[i])) s.params[i].mutable_grad() = at::zeros_like(s.params[i]);
  }
}

namespace {

// The Hugging Face name of each parameter of the config's model, after checking the
// folder's config.json against it.
std::map<std::string, std::string> hf_sources(const TrainConfig& c, const std::string& dir) {
  HP_CHECK(c.model->supports_hf(), "init_from_hf: model.type=", c.model.family().name(),
           " is not supported yet (the family has no Hugging Face names)");
  const std::string path = dir + "/config.json";
  std::ifstream f(path);
  HP_CHECK(f.good(), "init_from_hf: '", dir, "' has no config.json (not a Hugging Face model folder)");
  std::stringstream text;
  text << f.rdbuf();
  c.model->check_hf_config(text.str(), path);
  const auto names = c.model->hf_names();
  return {names.begin(), names.end()};
}

const std::string& hf_source(const std::map<std::string, std::string>& sources, const std::string& name) {
  auto it = sources.find(name);
  HP_INTERNAL_ASSERT(it != sources.end(), "no Hugging Face name for the parameter ", name);
  return it->second;
}

}  // namespace

void Trainer::load_hf(const std::string& dir) {
  Impl& s = *impl_;
  std::string error;
  try {
    const auto sources = hf_sources(s.c, dir);
    std::vector<ckpt::Item> items;
    size_t j = 0;
    for (size_t i = 0; i < s.params.size(); ++i) {
      const std::string& hf = hf_source(sources, s.names[i]);
      items.push_back({s.names[i], s.params[i].detach(), s.specs[i], hf});
      if (s.master && s.params[i].requires_grad()) {
        items.push_back({s.names[i] + ".master", s.master->masters()[j++].detach(), s.specs[i], hf});
      }
    }
    at::NoGradGuard ng;
    ckpt::load_consolidated(items, dir);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Each rank reads other bytes: a failure on one raises on all.
  raise_if_any_failed(s.world, error, "loading '" + dir + "'");
}

void export_hf(const std::string& ckpt_dir, const std::string& out_dir, const CommPtr& world,
               ckpt::ExportOptions o) {
  const auto values = ckpt::load({}, ckpt_dir);
  std::vector<std::pair<std::string, std::string>> settings;
  for (const auto& [k, v] : values) {
    if (k.rfind("config.model.", 0) == 0) settings.emplace_back(k.substr(7), v);
  }
  HP_CHECK(!settings.empty(), "export of '", ckpt_dir, "': the checkpoint has no config.model.* settings (not saved by ",
           "hp-train)");
  const ModelSpec model = model_from_settings(settings, "export of '" + ckpt_dir + "'");
  HP_CHECK(model->supports_hf(), "export of '", ckpt_dir, "': model.type=", model.family().name(),
           " is not supported yet (the family has no Hugging Face names)");
  model->validate();
  const auto saved = ckpt::saved_tensors(ckpt_dir);
  std::vector<std::pair<std::string, std::string>> tensors;
  for (const auto& [ours, theirs] : model->hf_names()) {
    auto it = saved.find(ours);
    HP_CHECK(it != saved.end(), "export of '", ckpt_dir, "': the checkpoint lacks the parameter '", ours, "'");
    // Written in the parameters' dtype unless asked otherwise (fp32 masters are the source
    // where kept, so a bf16 run's export rounds once, from the masters).
    if (!o.dtype) o.dtype = ckpt::dtype_from_string(it->second.dtype);
    tensors.emplace_back(saved.count(ours + ".master") ? ours + ".master" : ours, theirs);
  }
  ckpt::export_consolidated(ckpt_dir, tensors, out_dir, world, o, {{"config.json", model->hf_config(*o.dtype)}});
}

int64_t Trainer::steps_done() const { return impl_->steps; }
std::vector<at::Tensor> Trainer::sharded_params() const { return impl_->params; }
std::vector<at::Tensor> Trainer::sharded_grads() const { return impl_->grads(); }
const std::vector<FSDPHandle>& Trainer::handles() const { return impl_->handles; }
const CommPtr& Trainer::shard_group() const { return impl_->shards; }
const CommPtr& Trainer::tp_group() const { return impl_->tp; }
const CommPtr& Trainer::pp_group() const { return impl_->pp; }
std::string Trainer::describe_data() const { return impl_->data->describe(); }

// ---------------------------------------------------------------------------------------
// The reference: the model in compute dtype, gradients accumulated in the dtype fully_shard
// reduces in, the optimizer on fp32 masters (or on the parameters' dtype), parameters
// rounded to params_dtype after each step, as the sharded run does.

struct ReferenceTrainer::Impl {
  TrainConfig c;
  std::unique_ptr<TrainModel> model;
  std::vector<at::Tensor> model_params, opt_params, acc;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::shared_ptr<const TokenDataset> data;
  std::unique_ptr<DataSharder> sharder;
  at::ScalarType acc_dtype;
  int64_t steps = 0;
};

ReferenceTrainer::ReferenceTrainer(const TrainConfig& cfg, std::shared_ptr<const TokenDataset> data)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.c = cfg;
  const TrainConfig& c = s.c;
  s.model = make_model(c);  // parameters in params_dtype
  const at::ScalarType opt_dtype = c.fp32_master() ? at::kFloat : c.params_dtype;
  s.acc_dtype = c.accumulate_allreduce_grads_in_fp32 ? at::kFloat : c.compute_dtype;
  torch::NoGradGuard ng;
  for (auto& p : s.model->root().parameters()) {
    s.opt_params.push_back(p.detach().to(opt_dtype, /*non_blocking=*/false, /*copy=*/true).set_requires_grad(true));
    p.set_data(p.to(c.compute_dtype));
    s.model_params.push_back(p);
    s.acc.push_back(at::zeros_like(p, p.options().dtype(s.acc_dtype)));
  }
  if (!c.init_from_hf.empty()) {
    // The same values as the sharded run: the parameters cast from the file to
    // params_dtype (then to compute_dtype), the optimizer's copies cast to its dtype.
    const auto sources = hf_sources(c, c.init_from_hf);
    std::vector<ckpt::Item> items;
    std::vector<at::Tensor> stored;
    auto named = s.model->root().named_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      const at::Tensor& p = named[i].value();
      stored.push_back(at::empty(p.sizes(), p.options().dtype(c.params_dtype)));
      const std::string& hf = hf_source(sources, named[i].key());
      const ShardSpec whole = make_shard_spec(p.sizes().vec(), {});
      items.push_back({named[i].key(), stored.back(), whole, hf});
      items.push_back({named[i].key() + ".opt", s.opt_params[i], whole, hf});
    }
    ckpt::load_consolidated(items, c.init_from_hf);
    for (size_t i = 0; i < named.size(); ++i) s.model_params[i].copy_(stored[i]);
  }
  s.opt = make_adamw(c, s.opt_params);
  s.data = data ? std::move(data) : make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);
  s.sharder = std::make_unique<DataSharder>(s.data->size(), c.global_batch_size, c.micro_batch_num, c.dp_size(),
                                            c.seed, c.data.shuffle);
}

ReferenceTrainer::~ReferenceTrainer() = default;
TrainModel& ReferenceTrainer::model() { return *impl_->model; }

StepStats ReferenceTrainer::step() {
  Impl& s = *impl_;
  const TrainConfig& c = s.c;
  const auto t0 = Clock::now();
  double loss_sum = 0;
  for (int64_t j = 0; j < c.micro_batch_num; ++j) {
    at::Tensor batch = load_batch(*s.data, s.sharder->global_samples(s.steps, j), c.seq_length);
    at::Tensor loss = next_token_loss(*s.model, batch, c.seq_length, /*hooked=*/false);
    (loss / static_cast<double>(c.micro_batch_num)).backward();
    loss_sum += loss.item<double>();
    torch::NoGradGuard ng;
    for (size_t i = 0; i < s.model_params.size(); ++i) {
      at::Tensor& g = s.model_params[i].mutable_grad();
      if (g.defined()) s.acc[i] += g.to(s.acc_dtype);
      g = at::Tensor();
    }
  }
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < s.opt_params.size(); ++i) {
    s.opt_params[i].mutable_grad() = s.acc[i].to(s.opt_params[i].scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    grads.push_back(s.opt_params[i].grad());
  }
  StepStats st;
  st.step = s.steps + 1;
  st.grad_norm = global_grad_norm(grads, nullptr);
  check_finite(st.step, "gradient norm", st.grad_norm);
  clip_grads_(grads, c.clip_grad, st.grad_norm);
  st.lr = lr_at(c, s.steps);
  set_lr(*s.opt, st.lr);
  s.opt->step();
  s.opt->zero_grad();
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < s.opt_params.size(); ++i) {
      s.model_params[i].copy_(s.opt_params[i].to(c.params_dtype));
      s.acc[i].zero_();
    }
  }
  s.model->after_step(nullptr);
  st.loss = loss_sum / c.micro_batch_num;
  check_finite(st.step, "loss", st.loss);
  st.step_time_s = std::chrono::duration<double>(Clock::now() - t0).count();
  st.tokens_per_s = static_cast<double>(c.global_batch_size * c.seq_length) / st.step_time_s;
  st.peak_bytes = memory::peak_bytes();
  ++s.steps;
  return st;
}

}  // namespace hp::train
