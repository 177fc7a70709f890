#include "hp/train/plan.h"

#include <ATen/ATen.h>
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
        const double recompute = c.recompute == Recompute::kNone ? 0 : 1;  // forward again in backward
        p.forward_layer = f.block * tokens / rate;
        p.matmul_forward_layer = p.forward_layer;
        p.forward_first = p.forward_layer + f.head * tokens / rate;
        p.backward_layer = (2.0 + recompute) * p.forward_layer;
        p.backward_first = 2.0 * p.forward_first + recompute * p.forward_layer;
        // Recompute keeps a block's input alone (one block's whole set while it reruns).
        const models::ActivationCount a = c.model->activations_per_token(c.seq_length);
        const double elem = static_cast<double>(c10::elementSize(c.compute_dtype));
        const double dim = static_cast<double>(c.model->dim());
        p.activations_layer = tokens * elem * (recompute > 0 ? dim : a.block);
        p.activations_first = p.activations_layer + tokens * (elem + 8.0) * a.head +
                              (recompute > 0 ? tokens * elem * a.block : 0);
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
  if (config.pipeline_parallel > 1) {
    s += " (" + to_string(config.pipeline_schedule);
    if (config.pipeline_parallel_interleave_num > 1) s += " x" + std::to_string(config.pipeline_parallel_interleave_num);
    s += ")";
  }
  return s;
}

std::vector<PlanRow> plan_layouts(const TrainConfig& base, const PlanOptions& o, const ComputeModel& compute) {
  HP_CHECK(o.world >= 1, "--plan: --world must be at least 1, got ", o.world);
  const int N = o.world;
  const int cores = o.cores_per_node > 0 ? o.cores_per_node : usable_cores();
  const int per_node = o.network.ranks_per_node > 0 ? std::min(o.network.ranks_per_node, N) : N;
  const int threads = o.threads_per_rank > 0 ? o.threads_per_rank : std::max(1, cores / per_node);
  // A node running more compute threads than cores: every rank waits for the slowest.
  const double oversubscribed =
      o.device ? 1.0 : std::max(1.0, static_cast<double>(per_node) * threads / static_cast<double>(cores));
  const bool overlap = fsdp_overlap_auto(o.device, cores, per_node, threads);
  int64_t memory = o.memory_per_rank;
  HP_CHECK(memory > 0 || !o.device, "plan_layouts: a plan for devices (PlanOptions::device) needs memory_per_rank: "
           "this machine's memory says nothing about a device's");
  if (memory == 0) memory = memory::available_bytes() / per_node;

  const SimulatedNetwork& net = o.network;
  // The link of a group: the inter-node one when its ranks span nodes. The groups are the
  // trainer's own (ParallelDims), so their placement is the run's.
  auto link_of = [&](const std::vector<int>& ranks) { return net.spans_nodes(ranks) ? net.inter : net.intra; };
  // `ops` equal ops of `bytes` in all.
  auto comm = [](CommOp op, double bytes, int n, const LinkModel& link, double ops) {
    if (ops <= 0) return 0.0;
    return ops * SimulatedNetwork::seconds(op, static_cast<int64_t>(bytes / ops), n, link);
  };

  // Every layout: pp x dp_replicate x dp_shard x cp x tp = N (context_parallel for a
  // family with it), and for a model with routed experts every expert_parallel dividing both
  // dp_shard x cp and the experts (tensor_parallel 1: expert parallelism beside tensor
  // parallelism trains, but is not modelled here yet).
  struct Layout {
    int p, t, cpd, r, s, e;
  };
  const int64_t experts = base.model->routed_experts();
  const models::AttentionWidths widths = base.model->attention_widths();
  // optimizer: muon. Its Newton-Schulz iteration: per step, s^2 (2 l + s) multiply-adds for
  // a matrix of sides s <= l; the owner scheme spreads the matrices over the world (each
  // computed once): a rank's share is the total over the world, at least the largest one.
  double muon_flops_total = 0, muon_flops_largest = 0, muon_params = 0;
  for (const auto& [rows, cols] : muon_matrix_shapes(base)) {
    const double s = static_cast<double>(std::min(rows, cols)), l = static_cast<double>(std::max(rows, cols));
    const double flops = 2.0 * s * s * (2.0 * l + s) * static_cast<double>(optim::ns_steps(base.muon_ns_coefficients,
                                                                                            base.muon_ns_steps).size());
    muon_flops_total += flops;
    muon_flops_largest = std::max(muon_flops_largest, flops);
    muon_params += s * l;
  }
  std::vector<Layout> layouts;
  for (int p = 1; p <= N; ++p) {
    if (N % p) continue;
    for (int t = 1; t <= N / p; ++t) {
      if ((N / p) % t) continue;
      for (int cpd = 1; cpd <= N / p / t; ++cpd) {
        if ((N / p / t) % cpd || (cpd > 1 && widths.kv <= 0)) continue;
        for (int r = 1; r <= N / p / t / cpd; ++r) {
          if ((N / p / t / cpd) % r) continue;
          const int s = N / p / t / cpd / r;
          for (int e = 1; e <= s * cpd; ++e) {
            if ((s * cpd) % e == 0 && (e == 1 || (t == 1 && experts > 0 && experts % e == 0))) {
              layouts.push_back({p, t, cpd, r, s, e});
            }
          }
        }
      }
    }
  }

  std::vector<PlanRow> rows;
  for (const Layout& lay : layouts) {
    const int p = lay.p, t = lay.t, cpd = lay.cpd, r = lay.r, s = lay.s, e = lay.e;
    PlanRow row;
    TrainConfig& c = row.config;
    c = base;
    c.data_parallel = r;
    c.data_parallel_shard = s;
    c.context_parallel = cpd;
    if (cpd == 1) c.context_parallel_method = cp::Method::kRing;
    c.tensor_parallel = t;
    c.pipeline_parallel = p;
    c.expert_parallel = e;
    if (e == 1) c.moe_dispatcher = ep::DispatcherKind::kAllToAll;
    if (t == 1) c.sequence_parallel = false;
    if (p != base.pipeline_parallel) c.pipeline_stage_layers.clear();
    if (p == 1) {
      c.pipeline_parallel_interleave_num = 1;
      c.pipeline_schedule = PipelineScheduleKind::kAuto;
    }
    row.threads = o.device ? 0 : threads;
    row.overlap = overlap;
    try {
      c.validate(N);
      row.memory = estimate_rank_memory(c);
    } catch (const std::exception& e) {
      row.reason = e.what();
      const std::string src = base.source + ": ";
      if (row.reason.rfind(src, 0) == 0) row.reason = row.reason.substr(src.size());
      rows.push_back(row);
      continue;
    }
    const double need = std::max(row.memory.construction, static_cast<double>(row.memory.estimate.total()));
    if (memory > 0 && need > static_cast<double>(memory)) {
      row.reason = "needs " + format_bytes(static_cast<int64_t>(std::min(need, 9e18))) +
                   " per rank without activations; " + format_bytes(memory) + " available";
      rows.push_back(row);
      continue;
    }
    row.feasible = true;
    const ParallelDims dims = c.parallel_dims();
    // Rank 0's group of kind `g` (every group of a kind has the same shape).
    auto link_over = [&](Group g) { return link_of(dims.ranks(g, 0)); };
    const LinkModel replicate_link = r > 1 ? link_over(Group::kDpReplicate) : net.intra;

    const int64_t m = c.micro_batch_num, L = c.model->layers();
    // Timed with the node's other ranks running beside (sharing caches and memory
    // bandwidth, and the cores when they outnumber them), when ranks share this node.
    const ComputeProfile prof = compute(c.micro_batch_size(), threads, o.device ? 1 : per_node);
    // Oversubscription slows every rank, unless the profile was timed under it.
    const double slower = prof.contended ? 1.0 : oversubscribed;
    row.compute_source = prof.source;
    const double rank_params = static_cast<double>(row.memory.rank_params);
    // The rank's shards: the experts' over dp_shard x cp / ep, the rest over dp_shard x cp.
    double optimizer = prof.optimizer_per_param *
                       (rank_params + static_cast<double>(row.memory.expert_params) * (e - 1)) /
                       static_cast<double>(s * cpd);
    // Muon: the rank's share of the iterations at the block's matmul rate (the profile's:
    // its matrix products' FLOPs over their time), and the owner scheme's two all-to-alls
    // over the world (a rank's pieces, fp32, to their owners and back), on the critical
    // path between backward and the next forward.
    if (muon_params > 0) {
      const double tokens = static_cast<double>(c.micro_batch_size() * c.seq_length);
      const double rate = prof.matmul_forward_layer > 0
                              ? c.model->flops_per_token(c.seq_length).block * tokens / prof.matmul_forward_layer
                              : 0;
      if (rate > 0) optimizer += std::max(muon_flops_total / N, muon_flops_largest) / rate;
      const double pieces = muon_params / static_cast<double>(s * cpd * t * p);
      const LinkModel world_link = N > per_node ? net.inter : net.intra;
      row.optimizer_comm_s = 2 * SimulatedNetwork::seconds(CommOp::kAllToAll, static_cast<int64_t>(pieces * 4.0), N, world_link);
    }
    const double act_elem = static_cast<double>(c10::elementSize(c.compute_dtype));
    const double dim = static_cast<double>(c.model->dim());
    const double act_bytes = static_cast<double>(c.micro_batch_size() * c.seq_length) * dim * act_elem;
    // Activations a rank keeps under tensor parallelism: the head's logits split; of a
    // block, the inputs of the norms (without sequence parallel) and of the column-parallel
    // products (gathered whole) on every rank, the rest split (shares from the shapes).
    const double whole = t == 1 ? 0.0 : (c.sequence_parallel ? 2.0 : 4.0) * dim / c.model->activations_per_token(c.seq_length).block;
    // Its compute: the matrix products divide by the degree; of the rest (norms, residual
    // adds, elementwise), the work on whole activations stays whole on every rank, in the
    // activations' shares (BENCHMARKS.md, "The planner after tensor parallel's compute
    // share", has what dividing everything predicted).
    double tp_scale = 1;
    if (t > 1) {
      const double alone = prof.forward_layer / (prof.contended ? oversubscribed : 1.0);
      const double mm = prof.matmul_forward_layer > 0 && alone > 0 ? std::min(1.0, prof.matmul_forward_layer / alone) : 1.0;
      tp_scale = mm / t + (1.0 - mm) * (whole + (1.0 - whole) / t);
    }
    // Tensor parallelism, per block and direction of one micro-batch: 2 all-gathers and 2
    // reduce-scatters of the activations with sequence parallel, else 2 all-reduces.
    const LinkModel tp_link = link_over(Group::kTp);
    const double tp_block = t == 1 ? 0
                            : c.sequence_parallel
                                ? comm(CommOp::kAllGather, 2 * act_bytes, t, tp_link, 2) +
                                      comm(CommOp::kReduceScatter, 2 * act_bytes, t, tp_link, 2)
                                : comm(CommOp::kAllReduce, 2 * act_bytes, t, tp_link, 2);
    // Expert parallelism, per MoE block and micro-batch: the dispatcher's all-to-alls over
    // the EP group as the ep layer states them (ep::dispatch_traffic), on the critical path;
    // under recompute backward runs forward's again. Routing is taken as balanced, and for
    // the de-duplicating dispatcher uniform (ep::expected_copies).
    double ep_forward = 0, ep_backward = 0;
    if (e > 1) {
      ep::ExchangeShape shape;
      shape.ep = e;
      shape.experts = experts;
      shape.tokens = static_cast<double>(c.micro_batch_size() * c.seq_length);
      shape.k = c.model->experts_per_token();
      shape.row_bytes = dim * act_elem;
      shape.weight_bytes = 4.0;  // the router's fp32 weights
      shape.copies = ep::expected_copies(shape.tokens, experts, e, shape.k);
      const ep::ExchangeCost x = ep::dispatch_traffic(c.moe_dispatcher, shape);
      const LinkModel ep_link = link_over(Group::kEp);
      ep_forward = seconds(x.forward, ep_link);
      ep_backward = seconds(x.backward, ep_link);
      if (c.recompute != Recompute::kNone) ep_backward += ep_forward;
    }
    // MoE blocks of a pipeline slice.
    auto moe_blocks = [&](const models::PipelineSlice& sl) {
      const int64_t per = c.model->block_expert_params();
      return per > 0 ? c.model->stage_expert_params(sl) / per : 0;
    };
    // Context parallelism: each rank computes 1/cp of every block's work (head-tail balances
    // attention's) and keeps 1/cp of its activations, less attention's probabilities, which
    // the block-wise attention does not keep (a log-sum-exp per head instead; under
    // recompute, those of the block rerun), plus one (query chunk, key chunk) block's fp32
    // scores while computing (3 copies: the scores, their exponentials, the product's
    // workspace; chunks of seq / 2cp, Ulysses over heads / cp). Its exchanges, per block
    // and micro-batch, are the cp layer's own count (cp::attention_traffic).
    const double cp_scale = 1.0 / cpd;
    const bool recomputed = c.recompute != Recompute::kNone;
    double cp_act = 1.0, cp_probs = 0, cp_scores = 0;
    double cp_forward = 0, cp_backward = 0, cp_exposed_forward = 0, cp_exposed_backward = 0;
    if (cpd > 1) {
      const models::ActivationCount a = c.model->activations_per_token(c.seq_length);
      const double mb = static_cast<double>(c.micro_batch_size()), seq = static_cast<double>(c.seq_length);
      cp_act = (recomputed ? 1.0 : 1.0 - a.attention / a.block) / cpd;
      cp_probs = recomputed ? mb * seq * act_elem * a.attention : 0;
      const double chunk = seq / (2.0 * cpd);
      const double heads = a.attention / seq / t / (c.context_parallel_method == cp::Method::kUlysses ? cpd : 1);
      cp_scores = mb * heads * chunk * chunk * 4.0 * 3.0;
      const LinkModel cp_link = link_over(Group::kCp);
      cp::AttentionShape shape;
      shape.cp = cpd;
      shape.tokens = static_cast<double>(c.micro_batch_size() * (c.seq_length / cpd));
      shape.kv_width = widths.kv;
      shape.q_out_width = widths.q_out;
      shape.elem_bytes = act_elem;
      shape.grad_bytes = 4.0;  // float32 accumulation
      const cp::AttentionCost x = cp::attention_traffic(c.context_parallel_method, shape);
      cp_forward = seconds(x.forward, cp_link);
      cp_backward = seconds(x.backward, cp_link);
      // The ring's exchanges overlap the block's compute (what exceeds it is exposed); the
      // others' are all exposed.
      if (c.context_parallel_method == cp::Method::kRing) {
        const double fwd_block = prof.forward_layer * tp_scale * cp_scale, bwd_block = prof.backward_layer * tp_scale * cp_scale;
        cp_exposed_forward = std::max(0.0, cp_forward - fwd_block);
        cp_exposed_backward = std::max(0.0, cp_backward - bwd_block);
      } else {
        cp_exposed_forward = cp_forward, cp_exposed_backward = cp_backward;
      }
      if (recomputed) {  // the forward's exchanges again in backward
        cp_backward += cp_forward;
        cp_exposed_backward += cp_exposed_forward;
      }
    }
    const double act_layer = prof.activations_layer * (whole + (1.0 - whole) / t) * cp_act;
    const double act_head =
        std::max(0.0, prof.activations_first - prof.activations_layer - cp_probs) / t / cpd + cp_scores;
    int64_t rank_layers = L, rank_moe = moe_blocks(models::PipelineSlice{});
    if (p == 1) {
      const double fb = prof.forward_first + prof.backward_first +
                        static_cast<double>(L - 1) * (prof.forward_layer + prof.backward_layer);
      row.compute_s = static_cast<double>(m) * fb * tp_scale * cp_scale + optimizer;
      // One micro-batch at a time: its backward frees what its forward kept.
      row.activations = act_head + static_cast<double>(L) * act_layer;
      // Blocks, and the embedding and head (one more of each direction).
      row.tp_comm_s = static_cast<double>(m) * 2.0 * tp_block * static_cast<double>(L + 1);
      row.ep_comm_s = static_cast<double>(m) * (ep_forward + ep_backward) *
                      static_cast<double>(moe_blocks(models::PipelineSlice{}));
      row.cp_comm_s = static_cast<double>(m * L) * (cp_forward + cp_backward);
      row.exposed_s += static_cast<double>(m * L) * (cp_exposed_forward + cp_exposed_backward);
      row.compute_s *= slower;
    } else {
      const int v = static_cast<int>(c.pipeline_parallel_interleave_num), S = p * v;
      const auto slices = models::split_layers(L, S, c.pipeline_stage_layers);
      const pp::Schedule sched = pipeline_schedule(c);
      // Each stage's costs: its blocks, and on the last stage the embedding, head and loss
      // (the first block's extra); tensor parallel's transfers of its blocks beside.
      std::vector<double> f(static_cast<size_t>(S)), b(static_cast<size_t>(S)), tpc(static_cast<size_t>(S));
      std::vector<double> epf(static_cast<size_t>(S)), epb(static_cast<size_t>(S));
      std::vector<double> cpf(static_cast<size_t>(S)), cpb(static_cast<size_t>(S));
      std::vector<int64_t> layers_of_rank(static_cast<size_t>(p), 0), moe_of_rank(static_cast<size_t>(p), 0);
      for (int k = 0; k < S; ++k) {
        const auto& sl = slices[static_cast<size_t>(k)];
        const int64_t n = (sl.end_layer < 0 ? L : sl.end_layer) - sl.first_layer;
        layers_of_rank[static_cast<size_t>(sched.rank_of(k))] += n;
        const double extra = k == S - 1 ? 1 : 0;
        const auto K = static_cast<size_t>(k);
        f[K] = (static_cast<double>(n) * prof.forward_layer + extra * (prof.forward_first - prof.forward_layer)) * tp_scale *
               cp_scale;
        b[K] = (static_cast<double>(n) * prof.backward_layer + extra * (prof.backward_first - prof.backward_layer)) *
               tp_scale * cp_scale;
        tpc[K] = tp_block * static_cast<double>(n + extra);
        cpf[K] = cp_exposed_forward * static_cast<double>(n);
        cpb[K] = cp_exposed_backward * static_cast<double>(n);
        const int64_t moe = moe_blocks(sl);
        moe_of_rank[static_cast<size_t>(sched.rank_of(k))] += moe;
        epf[K] = ep_forward * static_cast<double>(moe);
        epb[K] = ep_backward * static_cast<double>(moe);
      }
      rank_layers = *std::max_element(layers_of_rank.begin(), layers_of_rank.end());
      rank_moe = *std::max_element(moe_of_rank.begin(), moe_of_rank.end());
      // Each stage's output (and its gradient back) crosses to the next stage's rank.
      // The first hop, stage 0's rank to stage 1's (as a stage's send to the next).
      std::vector<int> first_hop = dims.ranks(Group::kPp, 0);
      first_hop.resize(std::min<size_t>(first_hop.size(), 2));
      const double hop = SimulatedNetwork::seconds(CommOp::kSend, static_cast<int64_t>(act_bytes), 2,
                                                   link_of(first_hop));
      // On oversubscribed cores a rank waiting in the bubble leaves its core to the others:
      // the step is the schedule's with a core each, or the node's work over its cores,
      // whichever is longer.
      const double free = slower / oversubscribed;  // scales the profile to a core each
      auto makespan = [&](bool with_comm) {
        pp::Costs all;
        for (size_t k = 0; k < f.size(); ++k) {
          const double extra = with_comm ? tpc[k] + hop : 0;
          // The experts' all-to-alls belong to the input's gradient (the weights' own
          // gradients need none).
          const double ep_f = with_comm ? epf[k] + cpf[k] : 0, ep_b = with_comm ? epb[k] + cpb[k] : 0;
          pp::Costs one;
          one.forward = f[k] * free + extra + ep_f;
          one.backward = b[k] * free + extra + ep_b;
          one.backward_input = b[k] * free / 2 + extra + ep_b;
          one.backward_weight = b[k] * free / 2;
          all.per_stage.push_back(one);
        }
        return pp::simulate(sched, all);
      };
      const pp::SimResult alone = makespan(false);
      const pp::SimResult with_comm = makespan(true);
      double bubble = 0, busy = 0;
      for (double b : alone.bubble) bubble += b / static_cast<double>(alone.bubble.size());
      for (double b : alone.busy) busy += b / static_cast<double>(alone.busy.size());
      row.bubble = bubble;
      row.compute_s = std::max(alone.makespan, busy * oversubscribed) + optimizer * slower;
      // Per rank: its largest stage's activations times the micro-batches it holds at
      // once; the largest over the ranks.
      std::vector<double> stage_act(static_cast<size_t>(p), 0.0);
      for (int k = 0; k < S; ++k) {
        const auto& sl = slices[static_cast<size_t>(k)];
        const int64_t n = (sl.end_layer < 0 ? L : sl.end_layer) - sl.first_layer;
        const double extra = k == S - 1 ? 1 : 0;
        double& a = stage_act[static_cast<size_t>(sched.rank_of(k))];
        a = std::max(a, static_cast<double>(n) * act_layer + extra * act_head);
      }
      for (int q = 0; q < p; ++q) {
        row.activations = std::max(row.activations, stage_act[static_cast<size_t>(q)] *
                                                        static_cast<double>(alone.peak_in_flight[static_cast<size_t>(q)]));
      }
      row.tp_comm_s = 2.0 * tp_block * static_cast<double>(m) * static_cast<double>(rank_layers + 1);
      row.pp_comm_s = 2.0 * hop * static_cast<double>(m);
      row.ep_comm_s = (ep_forward + ep_backward) * static_cast<double>(m) * static_cast<double>(rank_moe);
      row.cp_comm_s = (cp_forward + cp_backward) * static_cast<double>(m) * static_cast<double>(rank_layers);
      row.exposed_s += with_comm.makespan - alone.makespan;
    }
    if (p == 1) row.exposed_s += row.tp_comm_s + row.ep_comm_s;
    if (s * cpd > 1) {
      // fully_shard's collectives (fsdp's own count: once per micro-batch, or once a step
      // where a pipeline keeps its stages' parameters), one per group: every block and the
      // root, and with expert parallelism each MoE's experts over the dp_shard / ep ranks
      // holding them. Each op moves the group's share of the rank's parameters.
      const auto mp = resolve_dtypes(mixed_precision(c), c.params_dtype);
      const bool reshard = c.data_parallel_shard_strategy != ShardStrategy::kOptimGrads && p == 1;
      const int64_t rounds = p == 1 ? m : 1;
      // One kind of unit: `n` groups of `params` in all over `shards` ranks; the time of
      // one group's gather, reduce-scatter and all-reduce across replicas, and of all.
      struct Units {
        double gather = 0, reduce = 0, across = 0, all = 0;
      };
      auto units = [&](double params, int64_t n, int shards, const LinkModel& link) {
        Units u;
        if (n <= 0 || shards <= 1) return u;
        const double ops = static_cast<double>(n);
        u.gather = comm(CommOp::kAllGather, params * static_cast<double>(c10::elementSize(mp.all_gather)), shards,
                        link, ops) / ops;
        const double reduce_bytes = params * static_cast<double>(c10::elementSize(mp.reduce));
        u.reduce = comm(CommOp::kReduceScatter, reduce_bytes, shards, link, ops) / ops;
        u.across = comm(CommOp::kAllReduce, reduce_bytes / shards, r, replicate_link, ops) / ops;
        // Before each reduction, the flags of which parameters got a gradient (a few
        // bytes, latency alone) over the same group.
        const double shard_flags = SimulatedNetwork::seconds(CommOp::kAllReduce, 64, shards, link);
        const double replicate_flags = SimulatedNetwork::seconds(CommOp::kAllReduce, 64, r, replicate_link);
        const CollectiveCounts k = estimate_collectives(n, rounds, reshard, r);
        u.all = static_cast<double>(k.all_gathers) * u.gather +
                static_cast<double>(k.reduce_scatters) * (u.reduce + shard_flags) +
                static_cast<double>(k.all_reduces) * (u.across + replicate_flags);
        return u;
      };
      const double rank_experts = static_cast<double>(row.memory.expert_params);
      // Over dp_shard x cp (fully_shard's group under context parallelism).
      const Units dense = units(rank_params - rank_experts, rank_layers + 1, s * cpd, link_over(Group::kShard));
      const Units expert =
          e > 1 ? units(rank_experts, rank_moe, s * cpd / e, link_over(Group::kExpertShard)) : Units{};
      row.fsdp_comm_s = dense.all + expert.all;
      // Overlapped, one group's collectives stay exposed (the first gather, the last
      // reduction), and whatever exceeds the compute.
      const double one = dense.gather + dense.reduce + dense.across + expert.gather + expert.reduce + expert.across;
      row.exposed_s += overlap ? one + std::max(0.0, row.fsdp_comm_s - row.compute_s) : row.fsdp_comm_s;
    } else if (r > 1) {
      row.fsdp_comm_s = comm(CommOp::kAllReduce, rank_params * 4.0, r, replicate_link, 1) *
                        (p == 1 ? static_cast<double>(m) : 1.0);
      row.exposed_s += row.fsdp_comm_s;
    }
    row.exposed_s += row.optimizer_comm_s;
    // The gradient norm, the loss and the step time: three small all-reduces over the world.
    row.exposed_s += 3 * SimulatedNetwork::seconds(CommOp::kAllReduce, 16, N, N > per_node ? net.inter : net.intra);
    row.step_s = row.compute_s + row.exposed_s;
    const double state = static_cast<double>(row.memory.estimate.total());
    if (memory > 0 && state + row.activations > static_cast<double>(memory)) {
      row.feasible = false;
      row.reason = "needs " + format_bytes(static_cast<int64_t>(std::min(state + row.activations, 9e18))) +
                   " per rank (" + format_bytes(static_cast<int64_t>(state)) + " state, " +
                   format_bytes(static_cast<int64_t>(std::min(row.activations, 9e18))) + " activations); " +
                   format_bytes(memory) + " available";
    }
    rows.push_back(row);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const PlanRow& a, const PlanRow& b) {
    if (a.feasible != b.feasible) return a.feasible;
    return a.feasible && a.step_s < b.step_s;
  });
  return rows;
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
