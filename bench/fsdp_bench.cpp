// fsdp_bench: fully_shard's cost, overlap and memory, each against a baseline in the same run.
//
//   build/fsdp_bench overhead                 world size 1: step time under fully_shard vs
//                                             the same loop without it (interleaved rounds)
//   mpirun -np 2 build/fsdp_bench overlap [SEQSxTOKENS ...]
//                                             fraction of the step a rank waits on
//                                             communication (trace "wait" spans) with overlap
//                                             on and off, alternating step by step, at
//                                             compute-heavy to communication-bound batches,
//                                             each block prefetching the next, with
//                                             wait_per_submodule (HP_BENCH_WAIT_PER_SUBMODULE=0:
//                                             without)
//                                             (HP_BENCH_WAITS=1: where the last overlapped
//                                             step waited; with HP_BENCH_DUMP=1 too, every
//                                             span of it from 0.3 ms, comm ops with their
//                                             modelled and real durations; HP_BENCH_RANK=r:
//                                             rank r's instead of rank 0's)
//   mpirun -np N build/fsdp_bench peer BxT [steps]
//                                             median step and peak memory, one JSON line
//                                             (bench/peers.sh sets it beside PyTorch's)
//   mpirun -np N build/fsdp_bench memory      peak tensor bytes of one step vs the analytic
//                                             (params + grads + AdamW state) / N + two
//                                             unsharded blocks
//   mpirun -np N build/fsdp_bench profile BxT [steps]
//                                             where rank 0's step time goes: libtorch's
//                                             profiler, time per op the training thread
//                                             called directly (libtorch 1.x builds)
//
// The model is the tests' small transformer (tests/fsdp/fsdp_model.h) at larger dims.
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR < 2
#include <torch/csrc/autograd/profiler_legacy.h>
#endif

#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "bench_util.h"
#include "fsdp/fsdp_model.h"
#include "hp/core/memory.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"

using hp::test::TinyConfig;
using hp::test::TinyModel;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

TinyConfig model_config() {
  TinyConfig c;
  c.vocab = 512;
  c.dim = 256;
  c.heads = 4;
  c.ffn = 1024;
  c.layers = 4;
  c.seq = 64;
  return c;
}

struct Trainer {
  TinyConfig cfg;
  TinyModel model{nullptr};
  std::vector<hp::FSDPHandle> handles;
  std::unique_ptr<torch::optim::AdamW> opt;
  // prefetch: each block prefetches the next in forward; per_submodule: wait_per_submodule.
  Trainer(const TinyConfig& c, bool sharded, bool prefetch, bool per_submodule = false) : cfg(c) {
    torch::manual_seed(0);
    model = TinyModel(c);
    std::vector<at::Tensor> params;
    if (sharded) {
      hp::FullyShardOptions o;
      o.wait_per_submodule = per_submodule;
      for (auto& b : model->blocks) handles.push_back(hp::fully_shard(*b, o));
      handles.push_back(hp::fully_shard(*model, o));
      if (prefetch) {
        for (size_t i = 0; i + 1 < model->blocks.size(); ++i) handles[i]->set_modules_to_forward_prefetch({handles[i + 1]});
      }
      for (auto& h : handles) {
        for (auto& p : h->parameters()) params.push_back(p);
      }
    } else {
      params = model->parameters();
    }
    opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
  }
  void step(const at::Tensor& x, const at::Tensor& y) {
    opt->zero_grad();
    hp::call(model, x, y).backward();
    opt->step();
  }
};

std::pair<at::Tensor, at::Tensor> data(const TinyConfig& c, int64_t batch) {
  at::Tensor all = at::randint(c.vocab, {batch, c.seq + 1}, at::kLong);
  return {all.narrow(1, 0, c.seq), all.narrow(1, 1, c.seq)};
}

int overhead() {
  TinyConfig c = model_config();
  Trainer plain(c, false, false), fsdp(c, true, false);
  auto [x, y] = data(c, 8);
  for (int i = 0; i < 2; ++i) {
    plain.step(x, y);
    fsdp.step(x, y);
  }
  // One step of each, alternating, many times: the minimum is the least disturbed step
  // (this machine is shared), the median shows the spread.
  std::vector<double> tp, tf, pair;
  for (int round = 0; round < 15; ++round) {
    double t0 = now_s();
    plain.step(x, y);
    double t1 = now_s();
    fsdp.step(x, y);
    double t2 = now_s();
    tp.push_back(t1 - t0);
    tf.push_back(t2 - t1);
    pair.push_back((t2 - t1) / (t1 - t0));  // two steps a few ms apart see the same machine
  }
  using hp::bench::median;
  double p = *std::min_element(tp.begin(), tp.end()), f = *std::min_element(tf.begin(), tf.end());
  double pm = median(tp), fm = median(tf);
  std::printf("overhead (world size 1, %lld layers d=%lld, batch 8 x %lld): fastest step plain %.2f ms, "
              "fully_shard %.2f ms, ratio %.3f (%+.1f%%); median ratio %.3f; median of paired ratios %.3f\n",
              (long long)c.layers, (long long)c.dim, (long long)c.seq, p * 1e3, f * 1e3, f / p, (f / p - 1) * 100,
              fm / pm, median(pair));
  return 0;
}

// `steps` steps of one loop only (for instruction counts under callgrind, which are
// repeatable on a shared machine where wall time is not).
int steps_only(bool sharded, int steps) {
  TinyConfig c = model_config();
  Trainer t(c, sharded, false);
  auto [x, y] = data(c, 8);
  for (int i = 0; i < steps; ++i) t.step(x, y);
  return 0;
}

// Overlap on and off in the same process, step by step in alternation (this machine is
// shared: a baseline taken minutes apart differs by more than what is measured). Per step,
// the fraction of it the training thread spent in the trace's "wait" spans; the median
// over rounds, the worst rank's.
int overlap(const std::vector<std::pair<int64_t, int64_t>>& batches, int rounds) {
  auto w = hp::world();
  hp::reset_fsdp_overlap();
  if (w->rank() == 0) {
    std::printf("HP_FSDP_OVERLAP=%s: overlap %s by default here (%d rank(s) on this node, %d compute thread(s) each, "
                "spare core per rank: %s, simulated network: %s)\n",
                std::getenv("HP_FSDP_OVERLAP") ? std::getenv("HP_FSDP_OVERLAP") : "auto",
                hp::fsdp_overlap() ? "on" : "off", hp::local_world_size(), at::get_num_threads(),
                hp::spare_core_per_rank() ? "yes" : "no", std::getenv("HP_SIM_NET") && *std::getenv("HP_SIM_NET") ? std::getenv("HP_SIM_NET") : "none");
  }
  TinyConfig c = model_config();
  const bool per_submodule = hp::bench::env_int("HP_BENCH_WAIT_PER_SUBMODULE", 1) != 0;
  if (w->rank() == 0) std::printf("wait_per_submodule: %s\n", per_submodule ? "on" : "off");
  for (auto [batch, tokens] : batches) {
    Trainer t(c, true, /*prefetch=*/true, per_submodule);
    auto [xf, yf] = data(c, batch);
    at::Tensor x = xf.narrow(1, 0, tokens), y = yf.narrow(1, 0, tokens);
    hp::trace::enable("/tmp/hp_fsdp_bench_trace");
    std::vector<double> frac[2], step[2], model[2];  // [0]: off, [1]: on
    for (int r = -1; r < rounds; ++r) {
      for (int k = 0; k < 2; ++k) {
        const bool on = (r + k) % 2 == 0;  // alternate which goes first
        hp::set_fsdp_overlap(on);
        hp::trace::clear();
        w->barrier().wait();
        double t0 = now_s();
        t.step(x, y);
        double dt = now_s() - t0;
        double wait = 0, modelled = 0;
        for (const auto& e : hp::trace::events()) {
          if (e.cat == "wait") wait += e.dur_us * 1e-6;
          // Under HP_SIM_NET each comm span carries the link model's time.
          auto k = e.args.find("\"model_us\":");
          if (e.cat == "comm" && k != std::string::npos) modelled += std::stod(e.args.substr(k + 11)) * 1e-6;
        }
        if (r < 0) continue;  // warm-up round
        if (on && r == rounds - 1 && w->rank() == hp::bench::env_int("HP_BENCH_RANK", 0) && std::getenv("HP_BENCH_WAITS")) {
          // Where the last overlapped step waited (one rank), in order: what is exposed.
          int64_t t0_us = INT64_MAX;
          for (const auto& e : hp::trace::events()) t0_us = std::min(t0_us, e.ts_us);
          for (const auto& e : hp::trace::events()) {
            if ((e.cat == "wait" && e.dur_us >= 500) || (std::getenv("HP_BENCH_DUMP") && e.dur_us >= 300)) {
              std::printf("    at %6.1f ms %s %5.1f ms: %s [%s] %s\n", (e.ts_us - t0_us) * 1e-3,
                          e.cat == "wait" ? "waited" : "took", e.dur_us * 1e-3, e.name.c_str(), e.cat.c_str(),
                          e.args.c_str());
            }
          }
        }
        frac[on].push_back(wait / dt);
        step[on].push_back(dt);
        model[on].push_back(modelled);
      }
    }
    hp::trace::disable();
    hp::reset_fsdp_overlap();
    using hp::bench::median;
    at::Tensor m = at::tensor({median(frac[1]), median(frac[0]), median(step[1]), median(step[0]), median(model[0])},
                              at::kDouble);
    w->all_reduce(m, {hp::ReduceOp::MAX}).wait();
    if (w->rank() == 0) {
      auto v = m.accessor<double, 1>();
      std::printf("batch %lld x %lld tokens: step %.1f ms overlap on, %.1f ms off; waiting on communication "
                  "%.1f%% on, %.1f%% off (exposed on/off %.2f)\n",
                  (long long)batch, (long long)tokens, v[2] * 1e3, v[3] * 1e3, v[0] * 100, v[1] * 100,
                  v[1] > 0 ? v[0] / v[1] : 0.0);
      if (v[4] > 0) {
        // Compute: the step with overlap off less the time it waited.
        const double compute = v[3] * (1 - v[1]);
        std::printf("  simulated network %s: modelled communication %.1f ms per step = %.0f%% of compute (%.1f ms); "
                    "exposed %.1f ms on, %.1f ms off\n",
                    std::getenv("HP_SIM_NET"), v[4] * 1e3, 100 * v[4] / compute, compute * 1e3, v[0] * v[2] * 1e3,
                    v[1] * v[3] * 1e3);
      }
    }
  }
  return 0;
}

int memory() {
  auto w = hp::world();
  const int n = w->size();
  TinyConfig c = model_config();
  c.layers = 16;  // the blocks dominate the model
  // One token: what backward keeps of the activations (about 16 KB per block here; 64 KB
  // at 4 tokens, which at 8 ranks was 4% of the bound) negligible next to the model state,
  // as the bound assumes.
  c.seq = 1;
  int64_t base = hp::memory::current_bytes();
  Trainer t(c, true, false);
  auto [x, y] = data(c, 1);
  t.step(x, y);  // AdamW state exists after the first step
  // Measure a steady-state step: model built and sharded, optimizer state allocated.
  hp::memory::reset_peak();
  t.step(x, y);
  int64_t peak = hp::memory::peak_bytes() - base;
  int64_t steady = hp::memory::current_bytes() - base;
  // The analytic bound, fp32: (P + G + O) / N with AdamW's O = 2P, plus two unsharded
  // blocks, plus the largest single gradient autograd holds beside its parameter, plus the
  // root's unsharded parameters (kept from forward to its backward).
  int64_t total_params = 0, block_params = 0, root_params = 0, largest = 0;
  for (size_t i = 0; i < t.handles.size(); ++i) {
    for (const auto& st : t.handles[i]->state_dict()) {
      int64_t numel = 1;
      for (int64_t d : st.global_shape) numel *= d;
      total_params += numel;
      largest = std::max(largest, numel);
      if (i == 0) block_params += numel;
      if (i + 1 == t.handles.size()) root_params += numel;
    }
  }
  const double state = 16.0 * total_params / n;
  const double bound = state + 4.0 * (2.0 * block_params + largest + root_params);
  at::Tensor p = at::tensor({static_cast<double>(peak), static_cast<double>(steady)}, at::kDouble);
  w->all_reduce(p, {hp::ReduceOp::MAX}).wait();
  if (w->rank() == 0) {
    double pk = p[0].item<double>(), st = p[1].item<double>();
    std::printf("memory at %d ranks, %d blocks (%.2f M parameters): step peak %.2f MB per rank (worst), between "
                "steps %.2f MB; (P+G+O)/N %.2f MB; bound = (P+G+O)/N + 2 blocks %.2f MB + largest gradient %.2f MB + "
                "root %.2f MB = %.2f MB; peak/bound %.3f, between-steps/(P+G+O)/N %.3f\n",
                n, (int)c.layers, total_params / 1e6, pk / 1e6, st / 1e6, state / 1e6, 8.0 * block_params / 1e6,
                4.0 * largest / 1e6, 4.0 * root_params / 1e6, bound / 1e6, pk / bound, st / state);
  }
  return 0;
}

// The figure bench/peers.sh sets beside PyTorch's: the median step of fully_shard (each
// block and the root, fp32, AdamW, HP_FSDP_OVERLAP's default) at B x T tokens per rank,
// the slowest rank's, and the peak tensor memory per rank. One JSON line.
// The model's matmuls in one step (forward; backward twice that), as (m, k, n) products
// of an m x k by a k x n matrix: per block qkv, proj, fc1, fc2 and attention's two batched
// products, then the tied head.
std::vector<std::array<int64_t, 4>> step_matmuls(const TinyConfig& c, int64_t batch, int64_t tokens) {
  const int64_t bt = batch * tokens, dh = c.dim / c.heads;
  std::vector<std::array<int64_t, 4>> mm;  // {count, m, k, n}
  mm.push_back({c.layers, bt, c.dim, 3 * c.dim});
  mm.push_back({c.layers, bt, c.dim, c.dim});
  mm.push_back({c.layers, bt, c.dim, c.ffn});
  mm.push_back({c.layers, bt, c.ffn, c.dim});
  mm.push_back({c.layers * batch * c.heads, tokens, dh, tokens});  // q k^T
  mm.push_back({c.layers * batch * c.heads, tokens, tokens, dh});  // att v
  mm.push_back({1, bt, c.dim, c.vocab});
  return mm;
}

// Model FLOP utilization: the step's matmul FLOPs (3x the forward's) over step time x this
// core's fp32 matmul throughput at the same shapes, measured now (best of 5 per shape, with
// the rank's compute threads). Returns {utilization, GFLOP/s measured, GFLOP per step}.
std::array<double, 3> mfu(const TinyConfig& c, int64_t batch, int64_t tokens, double step_s) {
  double flops = 0, secs = 0;
  for (const auto& [count, m, k, n] : step_matmuls(c, batch, tokens)) {
    const double f = 2.0 * m * k * n;
    flops += 3.0 * count * f;
    at::Tensor a = at::randn({m, k}), b = at::randn({k, n});
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const int reps = std::max<int64_t>(1, 20000000 / std::max<int64_t>(1, m * k * n));
      double t0 = now_s();
      for (int i = 0; i < reps; ++i) at::mm(a, b);
      best = std::min(best, (now_s() - t0) / reps);
    }
    secs += 3.0 * count * best;
  }
  const double rate = flops / secs;
  return {flops / (step_s * rate), rate / 1e9, flops / 1e9};
}

// The loop `peer` times and `profile` dissects: fully_shard on each block and the root,
// B x T tokens per rank, after 3 warm-up steps (AdamW's state allocated).
struct PeerLoop {
  TinyConfig c = model_config();
  Trainer t{c, true, /*prefetch=*/true};
  at::Tensor x, y;
  PeerLoop(int64_t batch, int64_t tokens) {
    auto [xf, yf] = data(c, batch);
    x = xf.narrow(1, 0, tokens);
    y = yf.narrow(1, 0, tokens);
    for (int i = 0; i < 3; ++i) step();
  }
  void step() { t.step(x, y); }
};

int peer(int64_t batch, int64_t tokens, int steps) {
  auto w = hp::world();
  PeerLoop loop(batch, tokens);
  const TinyConfig& c = loop.c;
  hp::memory::reset_peak();
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    w->barrier().wait();
    double t0 = now_s();
    loop.step();
    ms.push_back((now_s() - t0) * 1e3);
  }
  struct rusage ru{};
  getrusage(RUSAGE_SELF, &ru);  // the peak resident set, as PyTorch's figure is
  at::Tensor m = at::tensor({hp::bench::median(ms), static_cast<double>(hp::memory::peak_bytes()),
                             static_cast<double>(ru.ru_maxrss) * 1024},
                            at::kDouble);
  w->all_reduce(m, {hp::ReduceOp::MAX}).wait();
  // Measured on every rank at once, as the steps ran (ranks share the node's cores).
  auto [util, gflops, gflop] = mfu(c, batch, tokens, m[0].item<double>() * 1e-3);
  if (w->rank() == 0) {
    std::printf("{\"impl\": \"hyperparallel\", \"ranks\": %d, \"batch\": %lld, \"tokens\": %lld, \"step_ms\": %.2f, "
                "\"peak_tensor_bytes\": %.0f, \"peak_rss_bytes\": %.0f, \"overlap\": \"%s\", "
                "\"matmul_gflop_per_step\": %.3f, \"matmul_gflops_measured\": %.1f, \"mfu\": %.3f}\n",
                w->size(), (long long)batch, (long long)tokens, m[0].item<double>(), m[1].item<double>(),
                m[2].item<double>(), hp::fsdp_overlap() ? "on" : "off", gflop, gflops, util);
  }
  return 0;
}

// Where rank 0's step goes: `steps` steps of `peer`'s loop under libtorch's profiler. Each
// op the training thread called directly is charged its whole time (what it calls
// included: aten::linear holds its addmm, a backward node its kernels), so the rows add up
// to what the profiler saw; "not in any op" is the rest of the step (fully_shard's own
// code outside ATen ops, the hooks, the engine's bookkeeping, waits in the communicator).
int profile(int64_t batch, int64_t tokens, int steps) {
  auto w = hp::world();
  PeerLoop loop(batch, tokens);
#if TORCH_VERSION_MAJOR < 2
  namespace prof = torch::autograd::profiler;
  const bool tracing = hp::trace::enabled();
  if (!tracing) hp::trace::enable("/tmp");  // for fully_shard's own spans; never flushed
  hp::trace::clear();
  prof::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::CPU));
  const double t0 = now_s();
  for (int i = 0; i < steps; ++i) loop.step();
  const double total_us = (now_s() - t0) * 1e6;
  const prof::thread_event_lists lists = prof::disableProfilerLegacy();
  std::map<std::string, std::pair<double, int>> spans;  // fully_shard's, on this thread, by kind
  for (const auto& e : hp::trace::events()) {
    if (e.tid != hp::trace::current_tid() || (e.cat != "fsdp" && e.cat != "wait")) continue;
    auto& row = spans[e.name.substr(0, e.name.find(" hp::"))];
    row.first += static_cast<double>(e.dur_us);
    row.second += 1;
  }
  if (!tracing) hp::trace::disable();
  // The training thread's list is the one whose outermost ops cover the most time.
  std::map<std::string, std::pair<double, int>> best;
  double best_us = -1;
  for (const auto& list : lists) {
    std::map<std::string, std::pair<double, int>> top;
    std::vector<const prof::LegacyEvent*> open;
    double covered = 0;
    for (const auto& e : list) {
      if (e.kind() == prof::EventKind::PushRange) {
        open.push_back(&e);
      } else if (e.kind() == prof::EventKind::PopRange && !open.empty()) {
        const prof::LegacyEvent* start = open.back();
        open.pop_back();
        if (!open.empty()) continue;
        auto& row = top[start->name()];
        row.first += start->cpuElapsedUs(e);
        row.second += 1;
        covered += start->cpuElapsedUs(e);
      }
    }
    if (covered > best_us) {
      best_us = covered;
      best.swap(top);
    }
  }
  if (w->rank() == 0) {
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [name, v] : best) rows.emplace_back(v.first, name);
    std::sort(rows.rbegin(), rows.rend());
    std::printf("profile, rank 0 of %d, batch %lld x %lld, %d steps: %.1f ms per step\n", w->size(), (long long)batch,
                (long long)tokens, steps, total_us / steps / 1e3);
    std::printf("%10s %7s %8s  %s\n", "ms/step", "share", "calls", "op (outermost on the training thread)");
    for (const auto& [us, name] : rows) {
      if (us / total_us < 0.002) continue;
      std::printf("%10.2f %6.1f%% %8d  %s\n", us / steps / 1e3, 100 * us / total_us, best[name].second / steps,
                  name.c_str());
    }
    std::printf("%10.2f %6.1f%% %8s  %s\n", (total_us - best_us) / steps / 1e3, 100 * (total_us - best_us) / total_us,
                "", "not in any op");
    std::printf("fully_shard's own spans on the training thread (they nest, and cut across the ops above):\n");
    for (const auto& [name, v] : spans) {
      std::printf("%10.2f %6.1f%% %8d  %s\n", v.first / steps / 1e3, 100 * v.first / total_us, v.second / steps,
                  name.c_str());
    }
  }
  return 0;
#else
  (void)steps;
  if (w->rank() == 0) std::printf("fsdp_bench profile: built against libtorch 2.x; the profile uses 1.x's legacy profiler\n");
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  hp::init();
  int rc = 2;
  if (mode == "overhead") rc = overhead();
  else if (mode == "overlap") {
    // Batches as SEQUENCESxTOKENS; by default compute-heavy, in between, communication-bound.
    std::vector<std::pair<int64_t, int64_t>> batches;
    bool ok = true;
    for (int i = 2; i < argc && ok; ++i) {
      long long b = 0, t = 0;
      ok = std::sscanf(argv[i], "%lldx%lld", &b, &t) == 2 && b >= 1 && t >= 1 && t <= model_config().seq;
      if (ok) batches.emplace_back(b, t);
      else std::fprintf(stderr, "fsdp_bench overlap: batch '%s' is not SEQUENCESxTOKENS (tokens 1..%lld)\n", argv[i],
                        (long long)model_config().seq);
    }
    if (batches.empty() && ok) batches = {{16, 64}, {1, 64}, {1, 4}};
    if (ok) rc = overlap(batches, 15);
  }
  else if (mode == "memory") rc = memory();
  else if ((mode == "peer" || mode == "profile") && argc > 2) {
    long long b = 0, t = 0;
    if (std::sscanf(argv[2], "%lldx%lld", &b, &t) == 2 && b >= 1 && t >= 1 && t <= model_config().seq) {
      const int steps = argc > 3 ? std::atoi(argv[3]) : mode == "peer" ? 15 : 5;
      rc = mode == "peer" ? peer(b, t, steps) : profile(b, t, steps);
    } else {
      std::fprintf(stderr, "fsdp_bench %s: batch '%s' is not SEQUENCESxTOKENS (tokens 1..%lld)\n", mode.c_str(),
                   argv[2], (long long)model_config().seq);
    }
  }
  else if (mode == "steps-plain" || mode == "steps-fsdp") rc = steps_only(mode == "steps-fsdp", argc > 2 ? std::atoi(argv[2]) : 1);
  else std::fprintf(stderr, "usage: fsdp_bench overhead | overlap [SEQSxTOKENS ...] | memory | peer SEQSxTOKENS [steps] | profile SEQSxTOKENS [steps]\n");
  hp::finalize();
  return rc;
}
