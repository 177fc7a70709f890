#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "hp/comm/agree.h"
#include "hp/config.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/models/family.h"
#include "hp/train/checkpoint_manager.h"
#include "hp/tp/dtensor.h"
#include "parallelize.h"
#include "trainer_impl.h"

#if HP_HAVE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace hp::train {

using namespace internal;

namespace {

// ZeRO-1's hold of a step's micro-batches: gradient sync and resharding after backward off
// on every fully_shard unit from the first micro-batch, on again for the last. If the step
// stops between the two (an error), the destructor turns both back on and reshards, so no
// unit is left gathered and unsynchronized; the gradients accumulated so far stay with the
// failed step's.
class MicroBatchHold {
 public:
  explicit MicroBatchHold(const std::vector<FSDPHandle>& handles) : handles_(handles) {}
  ~MicroBatchHold() {
    if (!held_) return;
    try {
      set(true);
      for (const auto& h : handles_) h->reshard();
    } catch (...) {  // unwinding from the step's own error, which is the one to report
    }
  }
  MicroBatchHold(const MicroBatchHold&) = delete;
  MicroBatchHold& operator=(const MicroBatchHold&) = delete;
  void hold() {
    set(false);
    held_ = true;
  }
  void release() {
    set(true);
    held_ = false;
  }

 private:
  void set(bool on) {
    for (const auto& h : handles_) {
      h->set_requires_gradient_sync(on, /*recurse=*/false);
      h->set_reshard_after_backward(on, /*recurse=*/false);
    }
  }
  const std::vector<FSDPHandle>& handles_;
  bool held_ = false;
};

}  // namespace

c10::Device training_device(Device d) {
  if (d == Device::kCpu) return c10::kCPU;
#if HP_HAVE_CUDA
  const int gpus = c10::cuda::device_count();
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  HP_CHECK(gpus > 0, "device=cuda, but this process sees no CUDA device",
           visible ? detail::str_cat(" (CUDA_VISIBLE_DEVICES=", visible, ")") : std::string());
  // hp::init's nccl backend made the local rank's GPU current.
  return c10::Device(c10::kCUDA, c10::cuda::current_device());
#else
  HP_NOT_SUPPORTED("device=cuda: this build has no CUDA (build against a libtorch with CUDA, with NCCL: the "
                   "README's GPU build)");
#endif
}

Trainer::Trainer(const TrainConfig& cfg, CommPtr world, std::shared_ptr<const TokenDataset> data,
                 std::shared_ptr<const TokenDataset> valid)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.c = cfg;
  s.world = std::move(world);
  const TrainConfig& c = s.c;
  HP_CHECK(c.data_parallel_shard > 0 &&
               c.dp_size() * c.context_parallel * c.tensor_parallel * c.pipeline_parallel == s.world->size(),
           "Trainer: the config's layout (", c.data_parallel, " x ", c.data_parallel_shard, " x context_parallel ",
           c.context_parallel, " x tensor_parallel ", c.tensor_parallel,
           " x pipeline_parallel ", c.pipeline_parallel, ") does not cover the world of ", s.world->size(),
           " (validate the config first)");
  s.device = training_device(c.device);
  // Muon's routing overrides, checked against the whole model (a rank holds a part of it).
  if (c.optimizer == OptimizerKind::kMuon) (void)muon_matrix_shapes(c);
  HP_CHECK(s.world->supports_device(s.device), "Trainer: device=", to_string(c.device), " needs a world whose backend ",
           "moves ", s.device.str(), " tensors, but its backend is ", s.world->backend(),
           c.device == Device::kCuda ? " (hp::init with the nccl backend: hp-train picks it for device: cuda unless "
                                       "HP_BACKEND names another)"
                                     : "");
  s.control = control_device(s.world);
  s.build_mesh();
  // Built without storage: each rank materializes only its shards (plus one parameter at a
  // time), so a model larger than a rank's memory can be trained.
  if (c.pipeline_parallel == 1) {
    s.model = make_model(c, /*deferred=*/true);
    parallelize(*s.model, c, *s.mesh, s.context, s.device, /*stage=*/-1, s.sharded);
  } else {
    s.build_pipeline();
  }
  s.build_optimizer();
  s.data = data ? std::move(data) : make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);
  s.sharder = std::make_unique<DataSharder>(s.data->size(), c.global_batch_size, c.micro_batch_num, c.dp_size(),
                                            c.seed, c.data.shuffle);
  s.validation = open_validation(c, std::move(valid));
  if (!c.init_from_hf.empty()) load_hf(c.init_from_hf);
}

void Trainer::Impl::build_mesh() {
  mesh = std::make_unique<ParallelMesh>(c.parallel_dims(), world);
  dp = mesh->group(Group::kData);
  shards = mesh->group(Group::kShard);
  tp = mesh->group(Group::kTp);
  pp = mesh->group(Group::kPp);
  routing = mesh->group(Group::kRouting);
  dp_rank = mesh->rank_in(Group::kBatch);
  if (c.context_parallel > 1) {
    context = std::make_shared<cp::ContextParallel>(mesh->group(Group::kCp),
                                                    cp::ContextParallelOptions{c.context_parallel_method});
  }
}

void Trainer::Impl::build_pipeline() {
  const int npp = static_cast<int>(c.pipeline_parallel), v = static_cast<int>(c.pipeline_parallel_interleave_num);
  const int last_stage = npp * v - 1;
  pp::Schedule schedule = pipeline_schedule(c);
  const auto slices = models::split_layers(c.model->layers(), npp * v, c.pipeline_stage_layers);
  std::vector<pp::PipelineStage> run;
  TrainModel* last = nullptr;  // the last stage's model (under ZBV on rank 0, with the first)
  for (int st : schedule.stages_of(pp->rank())) {
    stages.push_back(make_model(c, /*deferred=*/true, slices[static_cast<size_t>(st)]));
    TrainModel* mdl = stages.back().get();
    parallelize(*mdl, c, *mesh, context, device, st, sharded);
    run.push_back({st, [mdl](const at::Tensor& x) { return mdl->forward(x, /*hooked=*/true); }, &mdl->root(),
                   [mdl](const at::Tensor& y) { mdl->set_targets(y); }});
    if (st == last_stage) last = mdl;
  }
  const std::vector<std::string> tied_names = c.model->tied_parameters();
  HP_CHECK(tied_names.size() <= 1, "model family ", c.model.family().name(), ": ", tied_names.size(),
           " tied parameters under pipeline parallelism is not supported yet (one is)");
  if (!tied_names.empty()) {
    // On two ranks, summed over a group of the two (split off the pp group by every rank);
    // on one (ZBV puts the first and the last stage on rank 0), summed here.
    const int first = schedule.rank_of(0), last_rank = schedule.rank_of(last_stage);
    if (first != last_rank && (pp->rank() == first || pp->rank() == last_rank)) {
      tie_group = pp->new_group({first, last_rank});
    }
    // This rank's copies: on the first stage, and (skipped by the norm) on the last.
    for (size_t i = 0; i < sharded.params.size(); ++i) {
      if (sharded.params[i].name != tied_names.front()) continue;
      tied.push_back(i);
      sharded.params[i].norm_skip = sharded.params[i].stage == last_stage;
    }
  }
  pp::PipelineOptions options;
  options.pairs_take_turns = c.pipeline_pair_overlap;
  pipe = std::make_unique<pp::Pipeline>(
      schedule, std::move(run), pp,
      [last](const at::Tensor& out, const at::Tensor& y) {
        HP_INTERNAL_ASSERT(last != nullptr, "a loss on a rank without the last stage");
        return last->loss_of_logits(out, y);
      },
      options);
}

void Trainer::Impl::build_optimizer() {
  // Over the parameters that require grad (or their fp32 masters, in the same order), each
  // named by the whole model's name, with its box for a distributed Muon.
  std::vector<std::string> opt_names;
  std::vector<ShardSpec> opt_boxes;
  std::vector<at::Tensor> opt_params;
  for (const ShardedParam& r : sharded.params) {
    if (!r.param.requires_grad()) continue;
    opt_names.push_back(r.name);
    opt_boxes.push_back(r.box);
    opt_params.push_back(r.param);
  }
  auto make = [this, opt_names, opt_boxes](const std::vector<at::Tensor>& params) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t j = 0; j < params.size(); ++j) named.emplace_back(opt_names[j], params[j]);
    return make_optimizer(c, named, &opt_boxes, world);
  };
  if (c.fp32_master()) {
    master = std::make_unique<FP32MasterOptimizer>(sharded.handles,
                                                   [&make](std::vector<at::Tensor> masters) { return make(masters); });
  } else {
    opt = make(opt_params);
  }
}

Trainer::~Trainer() = default;

StepStats Trainer::step() {
  Impl& s = *impl_;
  const TrainConfig& c = s.c;
  memory::reset_peak(s.device);
  const auto t0 = Clock::now();
  const CommTraffic sent_start = s.world->traffic();
  double loss_sum = 0;  // of the micro-batches' mean losses (on this data-parallel rank)
  std::vector<at::Tensor> batches;
  // ZeRO-1 (optim): the parameters gathered in the first micro-batch's forward stay so, and
  // the gradients accumulate unsharded, until the last micro-batch's backward reduces them
  // and reshards. (A pipeline's stages do so by themselves.)
  const bool hold = !s.pipe && c.data_parallel_shard_strategy == ShardStrategy::kOptim && c.micro_batch_num > 1;
  MicroBatchHold held(s.sharded.handles);
  for (int64_t j = 0; j < c.micro_batch_num; ++j) {
    try {
      batches.push_back(load_batch(*s.data, s.sharder->samples(s.steps, j, s.dp_rank), c.seq_length).to(s.device));
    } catch (const Error& e) {
      throw Error(detail::str_cat("step ", s.steps + 1, ", micro-batch ", j + 1, ": ", e.what()));
    }
    if (s.pipe) continue;
    if (hold && j == 0) held.hold();
    if (hold && j == c.micro_batch_num - 1) held.release();
    at::Tensor loss = next_token_loss(*s.model, batches.back(), c.seq_length, /*hooked=*/true, s.context.get());
    (loss / static_cast<double>(c.micro_batch_num)).backward();
    loss_sum += loss.item<double>();
    batches.clear();
  }
  // The multi-token prediction losses of the micro-batches (on the ranks of the head).
  double mtp_sum = 0;
  auto take_mtp = [&mtp_sum](TrainModel& m) { mtp_sum += m.take_mtp_loss().sum; };
  if (s.model) take_mtp(*s.model);
  if (s.pipe) {
    // The micro-batches in order, one after the other: the pipeline splits them back.
    at::Tensor all = at::cat(batches);
    auto [x, y] = inputs_and_targets(all, c.seq_length, s.context.get());
    at::Tensor mean = s.pipe->step(x, y);
    for (auto& m : s.stages) take_mtp(*m);
    // The mean (and the MTP losses) on the last stage's ranks: summed over pp (zeros elsewhere).
    at::Tensor l = at::tensor({mean.defined() ? mean.item<double>() : 0.0, mtp_sum}, at::kDouble).to(s.control);
    s.pp->all_reduce(l).wait();
    loss_sum = l[0].item<double>() * static_cast<double>(c.micro_batch_num);
    mtp_sum = l[1].item<double>();
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
  check_finite(c, st.step, "gradient norm", st.grad_norm);
  clip_grads_(grads, c.clip_grad, st.grad_norm);
  st.lr = lr_at(c, s.steps);
  const auto t_opt = Clock::now();
  const CommTraffic sent_opt = s.world->traffic();
  if (s.master) {
    set_lr(s.master->inner(), c, s.steps);
    s.master->step();
    s.master->zero_grad();
  } else {
    set_lr(*s.opt, c, s.steps);
    s.opt->step();
    s.opt->zero_grad();
  }
  const CommTraffic sent_end = s.world->traffic();
  // A device runs the step's kernels after they are queued: wait for them (a scalar read
  // back waits for the stream) so the time is the step's, not its launches'.
  if (!s.device.is_cpu()) (void)at::zeros({1}, at::TensorOptions(at::kFloat).device(s.device)).item<float>();
  const double opt_secs = std::chrono::duration<double>(Clock::now() - t_opt).count();
  if (s.model) s.model->after_step(s.routing);
  for (auto& m : s.stages) m->after_step(s.routing);

  const double mb = static_cast<double>(c.micro_batch_num);
  at::Tensor loss = at::tensor({loss_sum / mb, mtp_sum / mb}, at::kDouble).to(s.control);
  s.dp->all_reduce(loss, {ReduceOp::AVG}).wait();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  // The slowest rank's time, the largest peak and, per MoE block, its experts' load (known
  // on the ranks holding the block, 0 elsewhere): one MAX over the world.
  // MoE blocks by their layer: the model's, then the multi-token prediction modules'.
  const int64_t L = c.model->routed_experts() > 0 ? c.model->layers() + c.model->mtp_layers() : 0;
  constexpr size_t kFigures = 5;  // then 3 per MoE block
  std::vector<double> figures(kFigures + static_cast<size_t>(3 * L), 0.0);
  figures[0] = secs;
  figures[1] = static_cast<double>(memory::peak_bytes(s.device));
  figures[2] = opt_secs;
  figures[3] = static_cast<double>(s.world->traffic().bytes_sent - sent_start.bytes_sent);
  figures[4] = static_cast<double>(sent_end.bytes_sent - sent_opt.bytes_sent);
  auto add_load = [&](const TrainModel& m) {
    for (const models::ExpertLoad& e : m.expert_load()) {
      HP_INTERNAL_ASSERT(e.layer >= 0 && e.layer < L, "expert load of layer ", e.layer, " in a model of ", L);
      const auto first = kFigures + static_cast<size_t>(3 * e.layer);
      figures[first] = e.tokens.max().item<double>();
      figures[first + 1] = e.tokens.mean().item<double>();
      figures[first + 2] = e.dropped / std::max(1.0, e.tokens.sum().item<double>());
    }
  };
  if (s.model) add_load(*s.model);
  for (auto& m : s.stages) add_load(*m);
  at::Tensor worst = at::tensor(figures, at::kDouble).to(s.control);
  s.world->all_reduce(worst, {ReduceOp::MAX}).wait();
  worst = worst.cpu();
  const double* w = worst.data_ptr<double>();
  for (int64_t l = 0; l < L; ++l) {
    const double* e = w + kFigures + 3 * l;
    if (e[1] > 0) st.expert_load.push_back({l, e[0], e[1], e[2]});
  }
  st.loss = loss[0].item<double>();
  if (c.model->mtp_layers() > 0) st.mtp_loss = loss[1].item<double>();
  check_finite(c, st.step, "loss", st.loss);
  st.step_time_s = w[0];
  st.peak_bytes = static_cast<int64_t>(w[1]);
  st.optimizer_time_s = w[2];
  st.comm_bytes = static_cast<int64_t>(w[3]);
  st.optimizer_comm_bytes = static_cast<int64_t>(w[4]);
  st.tokens_per_s = static_cast<double>(c.global_batch_size * c.seq_length) / st.step_time_s;
  ++s.steps;
  return st;
}

EvalStats Trainer::evaluate() {
  Impl& s = *impl_;
  const TrainConfig& c = s.c;
  HP_CHECK(s.validation.data, "Trainer::evaluate: no validation set (eval_interval=0)");
  const auto t0 = Clock::now();
  double sum = 0;  // of this data-parallel rank's micro-batch means
  {
    at::NoGradGuard no_grad;
    for (int64_t b = 0; b < s.validation.batches; ++b) {
      std::vector<at::Tensor> batches;
      for (int64_t j = 0; j < c.micro_batch_num; ++j) {
        try {
          batches.push_back(load_batch(*s.validation.data, s.validation.order->samples(b, j, s.dp_rank), c.seq_length)
                                .to(s.device));
        } catch (const Error& e) {
          throw Error(detail::str_cat("validation after step ", s.steps, ", batch ", b + 1, ", micro-batch ", j + 1,
                                      ": ", e.what()));
        }
        if (s.pipe) continue;
        sum += next_token_loss(*s.model, batches.back(), c.seq_length, /*hooked=*/true, s.context.get()).item<double>();
        batches.clear();
      }
      if (s.pipe) {
        at::Tensor all = at::cat(batches);
        auto [x, y] = inputs_and_targets(all, c.seq_length, s.context.get());
        at::Tensor mean = s.pipe->evaluate(x, y);
        // On the last stage's ranks: summed over pp (zeros elsewhere).
        at::Tensor l = at::full({1}, mean.defined() ? mean.item<double>() : 0.0,
                                at::TensorOptions(at::kDouble).device(s.control));
        s.pp->all_reduce(l).wait();
        sum += l.item<double>() * static_cast<double>(c.micro_batch_num);
      }
    }
  }
  // Nothing stays gathered (a shard strategy that keeps parameters for the backward would).
  for (auto& h : s.sharded.handles) h->reshard();
  at::Tensor loss = at::full({1}, sum / static_cast<double>(s.validation.batches * c.micro_batch_num),
                             at::TensorOptions(at::kDouble).device(s.control));
  s.dp->all_reduce(loss, {ReduceOp::AVG}).wait();
  at::Tensor secs = at::full({1}, std::chrono::duration<double>(Clock::now() - t0).count(),
                             at::TensorOptions(at::kDouble).device(s.control));
  s.world->all_reduce(secs, {ReduceOp::MAX}).wait();
  return eval_stats(c, s.validation, s.steps, loss.item<double>(), secs.item<double>());
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
    out.optimizer_seconds += st.optimizer_time_s;
    out.comm_bytes += st.comm_bytes;
    out.optimizer_comm_bytes += st.optimizer_comm_bytes;
    if (cb.on_step) cb.on_step(st);
    if (eval_due(c, st.step)) {
      out.evals.push_back(evaluate());
      if (cb.on_eval) cb.on_eval(out.evals.back());
    }
    std::string saved;
    const bool due = checkpoints && checkpoints->due(st.step, c.train_steps);
    const bool stopping = cb.stop_requested && stop_agreed(cb.stop_requested(), &out);
    const bool stop_saves = stopping && checkpoints && checkpoints->options().interval > 0;
    if (due || stop_saves) require_finite_weights(st.step);
    if (due) {
      saved = checkpoints->save(*this);
      if (cb.on_save) cb.on_save(saved, checkpoints->options().async);
    }
    if (stopping) {
      if (stop_saves) {
        if (saved.empty()) {
          saved = checkpoints->save(*this, /*background=*/false);
          if (cb.on_save) cb.on_save(saved, false);
        } else if (checkpoints->options().async) {
          checkpoints->wait();  // this step's, begun above: committed before the stop
        }
        out.stop_saved = saved;
      }
      break;
    }
  }
  if (checkpoints && checkpoints->options().async) checkpoints->wait();
  const double tokens = static_cast<double>(c.global_batch_size * c.seq_length);
  if (out.steps > 1) {
    out.tokens_per_s = tokens * static_cast<double>(out.steps - 1) / (out.seconds - first_s);
  } else if (out.steps == 1) {
    out.tokens_per_s = tokens / out.seconds;
  }
  return out;
}


void Trainer::require_finite_weights(int64_t step) const {
  // Counted where the shards live, one read back for all of them (in the all-reduce).
  const auto on = at::TensorOptions(at::kLong).device(control_device(impl_->world));
  at::Tensor v = at::zeros({1}, on);
  {
    at::NoGradGuard g;
    for (const auto& r : impl_->sharded.params) {
      if (r.param.numel() > 0) v += at::logical_not(at::isfinite(r.param)).any().to(on);
    }
  }
  impl_->world->all_reduce(v, {ReduceOp::SUM}).wait();
  const int64_t total = v.cpu().item<int64_t>();
  if (total == 0) return;
  throw TrainingDiverged(detail::str_cat(
      "step ", step, ": ", total, " parameter shard(s) hold values that are not finite after the optimizer's step: ",
      "training diverged; not saved (the last committed checkpoint stays 'latest') ", diverged_hint(impl_->c)));
}

bool Trainer::stop_agreed(int mine, TrainSummary* out) const {
  // One all-reduce of (the signal, -rank where asked): the largest signal and the lowest
  // asking rank, the same on every rank.
  const auto on = at::TensorOptions().dtype(at::kLong).device(control_device(impl_->world));
  at::Tensor v = at::tensor({static_cast<int64_t>(mine), mine != 0 ? -static_cast<int64_t>(impl_->world->rank())
                                                                    : std::numeric_limits<int64_t>::min()},
                            at::kLong)
                     .to(on.device());
  impl_->world->all_reduce(v, {ReduceOp::MAX}).wait();
  v = v.cpu();
  const int64_t signo = v[0].item<int64_t>();
  if (signo == 0) return false;
  out->stopped_by = static_cast<int>(signo);
  out->stop_rank = static_cast<int>(-v[1].item<int64_t>());
  return true;
}

int64_t Trainer::steps_done() const { return impl_->steps; }
std::vector<at::Tensor> Trainer::sharded_params() const {
  std::vector<at::Tensor> out;
  for (const auto& r : impl_->sharded.params) out.push_back(r.param);
  return out;
}
std::vector<at::Tensor> Trainer::sharded_grads() const { return impl_->grads(); }
const std::vector<FSDPHandle>& Trainer::handles() const { return impl_->sharded.handles; }
std::vector<std::string> Trainer::parameter_names() const {
  std::vector<std::string> out;
  for (const auto& r : impl_->sharded.params) out.push_back(r.name);
  return out;
}
std::vector<ShardSpec> Trainer::parameter_specs() const {
  std::vector<ShardSpec> out;
  for (const auto& r : impl_->sharded.params) out.push_back(r.box);
  return out;
}
const CommPtr& Trainer::shard_group() const { return impl_->shards; }
const CommPtr& Trainer::tp_group() const { return impl_->tp; }
const CommPtr& Trainer::pp_group() const { return impl_->pp; }
std::string Trainer::describe_data() const { return impl_->data->describe(); }

}  // namespace hp::train
