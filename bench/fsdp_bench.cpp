// fsdp_bench: fully_shard's cost, overlap and memory, each against a baseline in the same run.
//
//   build/fsdp_bench overhead                 world size 1: step time under fully_shard vs
//                                             the same loop without it (interleaved rounds)
//   mpirun -np 2 build/fsdp_bench overlap [SEQSxTOKENS ...]
//                                             fraction of the step a rank waits on
//                                             communication (trace "wait" spans) with overlap
//                                             on and off, alternating step by step, at
//                                             compute-heavy to communication-bound batches
//   mpirun -np N build/fsdp_bench memory      peak tensor bytes of one step vs the analytic
//                                             (params + grads + AdamW state) / N + two
//                                             unsharded blocks
//
// The model is the tests' small transformer (tests/fsdp/fsdp_model.h) at larger dims.
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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
  Trainer(const TinyConfig& c, bool sharded, bool prefetch) : cfg(c) {
    torch::manual_seed(0);
    model = TinyModel(c);
    std::vector<at::Tensor> params;
    if (sharded) {
      for (auto& b : model->blocks) handles.push_back(hp::fully_shard(*b));
      handles.push_back(hp::fully_shard(*model));
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
  TinyConfig c = model_config();
  for (auto [batch, tokens] : batches) {
    Trainer t(c, true, /*prefetch=*/true);
    auto [xf, yf] = data(c, batch);
    at::Tensor x = xf.narrow(1, 0, tokens), y = yf.narrow(1, 0, tokens);
    hp::trace::enable("/tmp/hp_fsdp_bench_trace");
    std::vector<double> frac[2], step[2];  // [0]: off, [1]: on
    for (int r = -1; r < rounds; ++r) {
      for (int k = 0; k < 2; ++k) {
        const bool on = (r + k) % 2 == 0;  // alternate which goes first
        hp::set_fsdp_overlap(on);
        hp::trace::clear();
        w->barrier().wait();
        double t0 = now_s();
        t.step(x, y);
        double dt = now_s() - t0;
        double wait = 0;
        for (const auto& e : hp::trace::events()) {
          if (e.cat == "wait") wait += e.dur_us * 1e-6;
        }
        if (r < 0) continue;  // warm-up round
        frac[on].push_back(wait / dt);
        step[on].push_back(dt);
      }
    }
    hp::trace::disable();
    hp::set_fsdp_overlap(true);
    using hp::bench::median;
    at::Tensor m = at::tensor({median(frac[1]), median(frac[0]), median(step[1]), median(step[0])}, at::kDouble);
    w->all_reduce(m, {hp::ReduceOp::MAX}).wait();
    if (w->rank() == 0) {
      auto v = m.accessor<double, 1>();
      std::printf("batch %lld x %lld tokens: step %.1f ms overlap on, %.1f ms off; waiting on communication "
                  "%.1f%% on, %.1f%% off (exposed on/off %.2f)\n",
                  (long long)batch, (long long)tokens, v[2] * 1e3, v[3] * 1e3, v[0] * 100, v[1] * 100,
                  v[1] > 0 ? v[0] / v[1] : 0.0);
    }
  }
  return 0;
}

int memory() {
  auto w = hp::world();
  const int n = w->size();
  TinyConfig c = model_config();
  c.layers = 8;
  c.seq = 4;  // activations negligible next to the model state
  int64_t base = hp::memory::current_bytes();
  Trainer t(c, true, false);
  auto [x, y] = data(c, 1);
  t.step(x, y);  // AdamW state exists after the first step
  // Measure a steady-state step: model built and sharded, optimizer state allocated.
  hp::memory::reset_peak();
  t.step(x, y);
  int64_t peak = hp::memory::peak_bytes() - base;
  int64_t steady = hp::memory::current_bytes() - base;
  // Analytic: P + G + O (AdamW: 2P) over N ranks, plus two unsharded blocks.
  int64_t total_params = 0, block_params = 0;
  for (size_t i = 0; i < t.handles.size(); ++i) {
    for (const auto& st : t.handles[i]->state_dict()) {
      int64_t numel = 1;
      for (int64_t d : st.global_shape) numel *= d;
      total_params += numel;
      if (i == 0) block_params += numel;
    }
  }
  double analytic = 4.0 * (4.0 * total_params / n + 2.0 * block_params);
  at::Tensor p = at::tensor({static_cast<double>(peak), static_cast<double>(steady)}, at::kDouble);
  w->all_reduce(p, {hp::ReduceOp::MAX}).wait();
  if (w->rank() == 0) {
    double pk = p[0].item<double>(), st = p[1].item<double>();
    std::printf("memory at %d ranks: step peak %.2f MB per rank (worst), between steps %.2f MB; analytic "
                "(P+G+O)/N + 2 blocks %.2f MB, (P+G+O)/N %.2f MB; peak/analytic %.3f, between-steps/(P+G+O)/N %.3f\n",
                n, pk / 1e6, st / 1e6, analytic / 1e6, 16.0 * total_params / n / 1e6, pk / analytic,
                st / (16.0 * total_params / n));
  }
  return 0;
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
  else if (mode == "steps-plain" || mode == "steps-fsdp") rc = steps_only(mode == "steps-fsdp", argc > 2 ? std::atoi(argv[2]) : 1);
  else std::fprintf(stderr, "usage: fsdp_bench overhead | overlap [SEQSxTOKENS ...] | memory\n");
  hp::finalize();
  return rc;
}
