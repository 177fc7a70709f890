#include "hp/train/plan.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/fsdp/memory_estimate.h"
#include "hp/optim/muon.h"
#include "hp/pp/schedule.h"
#include "hp/runtime.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"

namespace hp::train {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The config's model with `layers` blocks (DeepSeek: its first dense, the rest MoE when the
// model has MoE blocks), in the compute dtype, whole.
TrainConfig with_layers(const TrainConfig& c, int64_t layers) {
  TrainConfig one = c;
  one.params_dtype = c.compute_dtype;
  one.tensor_parallel = 1;
  one.sequence_parallel = false;
  one.pipeline_parallel = 1;
  one.model->set_layers(layers);
  return one;
}

// Forward (with the loss) and backward seconds of one micro-batch of each model, median of 7
// after two warm-ups. The models take turns, so that what else the machine does in the
// meantime (with several threads single timings scatter by 2x here) falls on both alike.
struct FB {
  double forward = 0, backward = 0;
};

// Random inputs and next-token targets of `samples` sequences.
std::pair<at::Tensor, at::Tensor> random_batch(const TrainConfig& c, int64_t samples) {
  at::Tensor tokens = at::randint(0, c.model->vocab(), {samples, c.seq_length + 1}, at::kLong);
  return {tokens.narrow(1, 0, c.seq_length), tokens.narrow(1, 1, c.seq_length)};
}

std::vector<FB> time_forward_backward_once(const std::vector<TrainConfig>& configs, int64_t samples) {
  std::vector<std::unique_ptr<TrainModel>> models;
  for (const auto& c : configs) models.push_back(make_model(c));
  const auto [x, y] = random_batch(configs.front(), samples);
  std::vector<std::vector<double>> fwd(models.size()), bwd(models.size());
  for (int rep = 0; rep < 9; ++rep) {
    for (size_t k = 0; k < models.size(); ++k) {
      TrainModel& m = *models[k];
      auto t0 = Clock::now();
      m.set_targets(y);
      at::Tensor loss = m.loss_of_logits(m.forward(x, /*hooked=*/false), y);
      const double f = since(t0);
      t0 = Clock::now();
      loss.backward();
      const double b = since(t0);
      for (auto& p : m.root().parameters()) p.mutable_grad() = at::Tensor();
      if (rep < 2) continue;  // warm-up
      fwd[k].push_back(f);
      bwd[k].push_back(b);
    }
  }
  std::vector<FB> out;
  for (size_t k = 0; k < models.size(); ++k) out.push_back({median(fwd[k]), median(bwd[k])});
  return out;
}

// The same in `copies` threads at once, each with its own models (ranks sharing a node's
// cores: their time slices and caches are what this measures); the median over them.
std::vector<FB> time_forward_backward(const std::vector<TrainConfig>& configs, int64_t samples, int copies) {
  if (copies <= 1) return time_forward_backward_once(configs, samples);
  std::vector<std::vector<FB>> each(static_cast<size_t>(copies));
  std::vector<std::string> errors(static_cast<size_t>(copies));
  std::vector<std::thread> threads;
  for (int i = 0; i < copies; ++i) {
    threads.emplace_back([&, i] {
      try {
        each[static_cast<size_t>(i)] = time_forward_backward_once(configs, samples);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) HP_CHECK(e.empty(), "--plan: timing the model: ", e);
  std::vector<FB> out;
  for (size_t k = 0; k < configs.size(); ++k) {
    std::vector<double> f, b;
    for (const auto& e : each) {
      f.push_back(e[k].forward);
      b.push_back(e[k].backward);
    }
    out.push_back({median(f), median(b)});
  }
  return out;
}

// Bytes held at the end of one micro-batch's forward (with the loss) beyond the model, at
// the peak: the counting allocator's figure (0 when it is not installed).
double measure_activations(const TrainConfig& c, int64_t samples) {
  auto m = make_model(c);
  const auto [x, y] = random_batch(c, samples);
  const int64_t base = memory::current_bytes();
  memory::reset_peak();
  m->set_targets(y);
  at::Tensor loss = m->loss_of_logits(m->forward(x, /*hooked=*/false), y);
  return static_cast<double>(std::max<int64_t>(0, memory::peak_bytes() - base));
}

// AdamW's step, the gradient norm and the clipping over 2^20 parameters, per parameter.
double time_optimizer(at::ScalarType dtype) {
  const int64_t n = int64_t{1} << 20;
  at::Tensor p = at::randn({n}, at::kFloat).to(dtype).set_requires_grad(true);
  p.mutable_grad() = at::randn({n}, at::kFloat).to(dtype);
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-3));
  std::vector<double> t;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = Clock::now();
    const double norm = p.grad().to(at::kDouble).norm().item<double>();
    p.grad().mul_(1.0 / (1.0 + norm));
    opt.step();
    if (rep > 0) t.push_back(since(t0));
  }
  return median(t) / static_cast<double>(n);
}

// FLOP/s of this process's matmul at the model's shapes (each side at most 1024), in the
// compute dtype.
double measure_matmul(const TrainConfig& c, int64_t tokens) {
  const int64_t dim = c.model->dim();
  const int64_t hidden = c.model->ffn_hidden();
  const int64_t M = std::min<int64_t>(tokens, 1024), K = std::min<int64_t>(dim, 1024), N = std::min<int64_t>(hidden, 1024);
  at::Tensor a = at::randn({M, K}).to(c.compute_dtype), b = at::randn({K, N}).to(c.compute_dtype);
  std::vector<double> t;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = Clock::now();
    at::Tensor out = at::mm(a, b);
    if (rep > 0) t.push_back(since(t0));
  }
  return 2.0 * static_cast<double>(M * K * N) / std::max(median(t), 1e-9);
}

// A device's optimizer step per parameter, assumed (as its utilization is): AdamW on fp32
// masters reads the parameter, its gradient and two moments and writes three of them back,
// 28 bytes, at 2 TB/s of memory bandwidth. This machine's CPU would say nothing about it.
constexpr double kDeviceOptimizerSecondsPerParam = 28.0 / 2e12;

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

}  // namespace

ComputeModel measured_compute(const TrainConfig& c, double device_tflops, int64_t budget_bytes) {
  auto cache = std::make_shared<std::map<std::tuple<int64_t, int, int>, ComputeProfile>>();
  return [c, device_tflops, budget_bytes, cache](int64_t samples, int threads, int copies) {
    auto key = std::make_tuple(samples, threads, copies);
    auto it = cache->find(key);
    if (it != cache->end()) return it->second;
    const int before = at::get_num_threads();
    set_compute_threads(threads);
    ComputeProfile p;
    try {
      // The second model: the whole depth where it fits the budget (the per-layer figure then
      // comes from the largest difference), at least 2 layers.
      const double tokens = static_cast<double>(samples * c.seq_length);
      auto need = [&](const TrainConfig& k) {
        // Parameters and their gradients in fp32, logits with their softmax and gradient.
        return 8.0 * static_cast<double>(k.model->num_params()) + 3.0 * 4.0 * tokens * static_cast<double>(c.model->vocab());
      };
      const int64_t L = c.model->layers();
      int64_t deep = std::max<int64_t>(2, L);
      while (deep > 2 && copies * need(with_layers(c, deep)) > static_cast<double>(budget_bytes)) deep /= 2;
      const TrainConfig two = with_layers(c, std::max<int64_t>(2, deep));
      p.optimizer_per_param = device_tflops > 0 ? kDeviceOptimizerSecondsPerParam : time_optimizer(c.params_dtype);
      if (device_tflops <= 0 && copies * need(two) <= static_cast<double>(budget_bytes)) {
        p.activations_first = measure_activations(with_layers(c, 1), samples);
        p.activations_layer =
            std::max(0.0, measure_activations(two, samples) - p.activations_first) / static_cast<double>(two.model->layers() - 1);
        const auto t = time_forward_backward({with_layers(c, 1), two}, samples, copies);
        p.contended = copies > 1;
        const double extra = static_cast<double>(two.model->layers() - 1);
        p.forward_first = t[0].forward;
        p.backward_first = t[0].backward;
        p.forward_layer = std::max(0.0, t[1].forward - t[0].forward) / extra;
        p.backward_layer = std::max(0.0, t[1].backward - t[0].backward) / extra;
        p.matmul_forward_layer = c.model->flops_per_token(c.seq_length).block * tokens / measure_matmul(c, static_cast<int64_t>(tokens));
        p.source = "measured here: the model at 1 and " + std::to_string(two.model->layers()) + " layers, " +
                   std::to_string(threads) + " thread(s)" +
                   (copies > 1 ? ", " + std::to_string(copies) + " copies at once (the ranks sharing a node)" : "");
      } else {
        const double rate = device_tflops > 0 ? 0.5 * device_tflops * 1e12
                                              : measure_matmul(c, static_cast<int64_t>(tokens));
        const models::FlopCount f = c.model->flops_per_token(c.seq_length);
        // Of a block's forward, what backward runs again: all of it under full or selective
        // recompute, the marked matmuls under light (the norms and activations uncounted).
        const bool light = c.recompute == Recompute::kLight;
        const double recompute = c.recompute == Recompute::kNone ? 0 : light ? f.light_recompute / f.block : 1;
        p.forward_layer = f.block * tokens / rate;
        p.matmul_forward_layer = p.forward_layer;
        p.forward_first = p.forward_layer + f.head * tokens / rate;
        p.backward_layer = (2.0 + recompute) * p.forward_layer;
        p.backward_first = 2.0 * p.forward_first + recompute * p.forward_layer;
        // Full or selective recompute keeps a block's input alone (one block's whole set
        // while it reruns); light keeps what its family counts, and rebuilds the rest.
        const models::ActivationCount a = c.model->activations_per_token(c.seq_length);
        const double elem = static_cast<double>(c10::elementSize(c.compute_dtype));
        const double dim = static_cast<double>(c.model->dim());
        const double kept = c.recompute == Recompute::kNone ? a.block : light ? a.light : dim;
        p.activations_layer = tokens * elem * kept;
        p.activations_first = p.activations_layer + tokens * (elem + 8.0) * a.head +
                              (c.recompute == Recompute::kNone ? 0 : tokens * elem * (a.block - (light ? a.light : 0))) +
                              static_cast<double>(samples) * a.attention_workspace * 4.0;
        p.source = device_tflops > 0
                       ? "FLOPs at half of " + fmt("%g", device_tflops) +
                             " TFLOP/s (assumed utilization 0.5), the optimizer at 28 bytes per parameter over 2 TB/s"
                       : "FLOPs at this machine's " + fmt("%.3g", rate / 1e9) + " GFLOP/s matmul (" +
                             std::to_string(threads) + " thread(s); the model is too large to time here)";
      }
    } catch (...) {
      set_compute_threads(before);
      throw;
    }
    set_compute_threads(before);
    (*cache)[key] = p;
    return p;
  };
}

SimulatedNetwork measured_local_link() {
  // One rank's bytes reach another's through a shared segment: copied in, then out.
  const int64_t n = int64_t{64} << 20;
  at::Tensor a = at::ones({n}, at::kByte), b = at::empty({n}, at::kByte);
  const int before = at::get_num_threads();
  set_compute_threads(1);
  std::vector<double> t;
  for (int rep = 0; rep < 4; ++rep) {
    const auto t0 = Clock::now();
    b.copy_(a);
    if (rep > 0) t.push_back(since(t0));
  }
  set_compute_threads(before);
  SimulatedNetwork net;
  net.intra = {20.0, static_cast<double>(n) / std::max(median(t), 1e-9) / 2e9};
  net.inter = net.intra;
  return net;
}

std::string PlanRow::layout() const {
  std::string s = "dp_replicate=" + std::to_string(config.data_parallel) + " dp_shard=" +
                  std::to_string(config.data_parallel_shard);
  if (config.context_parallel > 1) s += " cp=" + std::to_string(config.context_parallel);
  if (config.model->routed_experts() > 0) s += " ep=" + std::to_string(config.expert_parallel);
  s += " tp=" + std::to_string(config.tensor_parallel) + " pp=" + std::to_string(config.pipeline_parallel);
  // ZeRO-1, the planner's own variant of each layout without a pipeline (plan_layouts).
  if (config.data_parallel_shard_strategy == ShardStrategy::kOptim && config.pipeline_parallel == 1) s += " optim";
  if (config.pipeline_parallel > 1) {
    s += " (" + to_string(config.pipeline_schedule);
    if (config.pipeline_parallel_interleave_num > 1) s += " x" + std::to_string(config.pipeline_parallel_interleave_num);
    s += ")";
  }
  return s;
}

std::string format_plan(const std::vector<PlanRow>& rows) {
  std::ostringstream out;
  char line[512];
  for (const PlanRow& r : rows) {
    if (!r.feasible) continue;
    out << "per rank: " << (r.threads > 0 ? std::to_string(r.threads) + " compute thread(s)" : std::string("one device"))
        << ", fully_shard overlap " << (r.overlap ? "on" : "off")
        << "; compute " << r.compute_source << "; mem/rank: the sharded state and activations (activ.)\n";
    break;
  }
  std::snprintf(line, sizeof line, "%-4s %-50s %10s %10s %9s %9s %9s %9s %9s %9s %9s %7s %10s\n", "#", "layout",
                "mem/rank", "activ.", "compute", "fsdp", "tp", "pp", "ep", "cp", "exposed", "bubble", "step");
  out << line;
  int k = 0;
  for (const PlanRow& r : rows) {
    if (!r.feasible) continue;
    const auto total = static_cast<int64_t>(static_cast<double>(r.memory.estimate.total()) + r.activations);
    std::snprintf(line, sizeof line,
                  "%-4d %-50s %10s %10s %7.1fms %7.1fms %7.1fms %7.1fms %7.1fms %7.1fms %7.1fms %6.1f%% %8.1fms\n", ++k,
                  r.layout().c_str(), format_bytes(total).c_str(),
                  format_bytes(static_cast<int64_t>(r.activations)).c_str(), r.compute_s * 1e3, r.fsdp_comm_s * 1e3,
                  r.tp_comm_s * 1e3, r.pp_comm_s * 1e3, r.ep_comm_s * 1e3, r.cp_comm_s * 1e3, r.exposed_s * 1e3,
                  r.bubble * 100,
                  r.step_s * 1e3);
    out << line;
  }
  bool header = false;
  for (const PlanRow& r : rows) {
    if (r.feasible) continue;
    if (!header) out << "not feasible:\n";
    header = true;
    out << "  " << r.layout() << ": " << r.reason << "\n";
  }
  return out.str();
}

std::string plan_json(const std::vector<PlanRow>& rows) {
  std::ostringstream out;
  for (const PlanRow& r : rows) {
    out << "{\"dp_replicate\":" << r.config.data_parallel << ",\"dp_shard\":" << r.config.data_parallel_shard
        << ",\"cp\":" << r.config.context_parallel << ",\"ep\":" << r.config.expert_parallel
        << ",\"tp\":" << r.config.tensor_parallel
        << ",\"pp\":" << r.config.pipeline_parallel
        << ",\"interleave\":" << r.config.pipeline_parallel_interleave_num
        << ",\"schedule\":\"" << to_string(r.config.pipeline_schedule) << "\""
        << ",\"strategy\":\"" << to_string(r.config.data_parallel_shard_strategy) << "\""
        << ",\"overlap_chunks\":" << r.config.moe_overlap_chunks
        << ",\"sequence_parallel\":" << (r.config.sequence_parallel ? "true" : "false")
        << ",\"dispatcher\":\"" << to_string(r.config.moe_dispatcher) << "\""
        << ",\"cp_method\":\"" << to_string(r.config.context_parallel_method) << "\""
        << ",\"reshard_group\":" << r.config.reshard_after_forward_group_size << ",\"stage_layers\":[";
    for (size_t i = 0; i < r.config.pipeline_stage_layers.size(); ++i) {
      out << (i ? "," : "") << r.config.pipeline_stage_layers[i];
    }
    out << "]"
        << ",\"feasible\":" << (r.feasible ? "true" : "false");
    if (r.feasible) {
      out << ",\"memory_bytes\":" << r.memory.estimate.total() << ",\"activation_bytes\":" << r.activations
          << ",\"compute_s\":" << r.compute_s
          << ",\"fsdp_comm_s\":" << r.fsdp_comm_s << ",\"tp_comm_s\":" << r.tp_comm_s << ",\"pp_comm_s\":" << r.pp_comm_s << ",\"ep_comm_s\":" << r.ep_comm_s << ",\"cp_comm_s\":" << r.cp_comm_s << ",\"optimizer_comm_s\":" << r.optimizer_comm_s
          << ",\"exposed_s\":" << r.exposed_s << ",\"bubble\":" << r.bubble << ",\"step_s\":" << r.step_s
          << ",\"threads\":" << r.threads << ",\"overlap\":" << (r.overlap ? "true" : "false");
    } else {
      std::string reason;
      for (char ch : r.reason) {
        if (ch == '"' || ch == '\\') reason += '\\';
        reason += ch == '\n' ? ' ' : ch;
      }
      out << ",\"reason\":\"" << reason << "\"";
    }
    out << "}\n";
  }
  return out.str();
}

}  // namespace hp::train
