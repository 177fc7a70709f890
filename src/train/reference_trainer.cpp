// The same training in one process on the global batch, without fully_shard: what --verify
// compares against.
#include <ATen/ATen.h>

#include "hp/ckpt/consolidated.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "trainer_impl.h"

namespace hp::train {

using namespace internal;

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
  Validation validation;
  at::ScalarType acc_dtype;
  int64_t steps = 0;
};

ReferenceTrainer::ReferenceTrainer(const TrainConfig& cfg, std::shared_ptr<const TokenDataset> data,
                                   std::shared_ptr<const TokenDataset> valid)
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
    add_hf_buffers(s.model->root(), sources, items);
    ckpt::load_consolidated(items, c.init_from_hf);
    for (size_t i = 0; i < named.size(); ++i) s.model_params[i].copy_(stored[i]);
  }
  // The same routing by the whole model's names; every matrix whole here.
  std::vector<std::pair<std::string, at::Tensor>> named;
  const auto model_named = s.model->root().named_parameters();
  for (size_t i = 0; i < s.opt_params.size(); ++i) named.emplace_back(model_named[i].key(), s.opt_params[i]);
  s.opt = make_optimizer(c, named, /*boxes=*/nullptr, nullptr);
  s.data = data ? std::move(data) : make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);
  s.sharder = std::make_unique<DataSharder>(s.data->size(), c.global_batch_size, c.micro_batch_num, c.dp_size(),
                                            c.seed, c.data.shuffle);
  s.validation = open_validation(c, std::move(valid));
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
  check_finite(c, st.step, "gradient norm", st.grad_norm);
  clip_grads_(grads, c.clip_grad, st.grad_norm);
  st.lr = lr_at(c, s.steps);
  set_lr(*s.opt, c, s.steps);
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
  if (c.model->mtp_layers() > 0) st.mtp_loss = s.model->take_mtp_loss().sum / c.micro_batch_num;
  check_finite(c, st.step, "loss", st.loss);
  st.step_time_s = std::chrono::duration<double>(Clock::now() - t0).count();
  st.tokens_per_s = static_cast<double>(c.global_batch_size * c.seq_length) / st.step_time_s;
  st.peak_bytes = memory::peak_bytes();
  ++s.steps;
  return st;
}

EvalStats ReferenceTrainer::evaluate() {
  Impl& s = *impl_;
  const TrainConfig& c = s.c;
  HP_CHECK(s.validation.data, "ReferenceTrainer::evaluate: no validation set (eval_interval=0)");
  const auto t0 = Clock::now();
  torch::NoGradGuard ng;
  double sum = 0;
  for (int64_t b = 0; b < s.validation.batches; ++b) {
    for (int64_t j = 0; j < c.micro_batch_num; ++j) {
      at::Tensor batch = load_batch(*s.validation.data, s.validation.order->global_samples(b, j), c.seq_length);
      sum += next_token_loss(*s.model, batch, c.seq_length, /*hooked=*/false).item<double>();
    }
  }
  return eval_stats(c, s.validation, s.steps, sum / static_cast<double>(s.validation.batches * c.micro_batch_num),
                    std::chrono::duration<double>(Clock::now() - t0).count());
}

}  // namespace hp::train
