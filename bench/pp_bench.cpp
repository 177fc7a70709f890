// pp_bench: pipeline schedules measured against the simulator and against each other.
//
//   mpirun -np P build/pp_bench [steps]
//
// For GPipe, 1F1B, interleaved 1F1B (2 stages per rank), ZB-H1, ZBV and DualPipeV (from m = 2P)
// at m = P, 2P, 4P micro-batches,
// on the reference Llama at bench dims split into P x v stages (fp32, no data parallelism):
//   - the measured step time (median over `steps`, slowest rank), and the step time the
//     simulator predicts from this run's own measured costs: the median forward and backward
//     (ZB-H1: input- and weight-gradient) time of one stage on one micro-batch, taken from the
//     trace spans of the timed steps;
//   - the measured bubble (1 - compute time / step time, mean over ranks) against the
//     simulator's;
//   - the peak tensor memory held during the step beyond what was held before it (activations
//     kept for backward, plus transfer buffers), against the closed form: the schedule's peak
//     number of micro-batches in flight on the rank (from the simulator) x the bytes one stage
//     keeps for one micro-batch (measured here on its own, with one forward).
// The simulator charges nothing for transfers, so the gap to it is the transfers' cost plus
// the runtime's overhead.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "hp/core/memory.h"
#include "hp/core/trace.h"
#include "hp/hooks/call.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/llama.h"
#include "hp/pp/pipeline.h"
#include "hp/pp/schedule.h"
#include "hp/runtime.h"

namespace {

hp::models::LlamaConfig bench_config() {
  hp::models::LlamaConfig c;
  c.vocab = 1024;
  c.dim = 256;
  c.layers = 8;
  c.heads = 8;
  c.kv_heads = 4;
  c.ffn_dim = 768;
  return c;
}

constexpr int64_t kRowsPerMicrobatch = 2, kSeq = 128;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Row {
  std::string schedule;
  int m = 0;
  double step_s = 0, predicted_s = 0, bubble = 0, predicted_bubble = 0;
  double peak_bytes = 0, closed_form_bytes = 0;
};

Row run(const hp::CommPtr& world, const std::string& kind, int v, int m, int steps) {
  const int p = world->size(), r = world->rank();
  const auto c = bench_config();
  const auto slices = hp::models::split_layers(c.layers, p * v);
  hp::pp::Schedule sched = kind == "gpipe"  ? hp::pp::gpipe(p, m)
                           : kind == "1f1b" ? hp::pp::one_f_one_b(p, m)
                           : kind == "zbh1" ? hp::pp::zero_bubble_h1(p, m)
                           : kind == "zbv"  ? hp::pp::zero_bubble_v(p, m)
                           : kind == "dualpipev" ? hp::pp::dualpipev(p, m)
                                            : hp::pp::interleaved_1f1b(p, v, m);
  std::vector<hp::models::Llama> chunks;
  std::vector<hp::pp::PipelineStage> stages;
  hp::models::Llama last{nullptr};
  for (int s : sched.stages_of(r)) {
    hp::models::Llama mdl(c, slices[static_cast<size_t>(s)]);
    chunks.push_back(mdl);
    if (s == p * v - 1 || !last) last = mdl;
    stages.push_back({s, [mdl](const at::Tensor& x) mutable { return hp::call(mdl, x); }, mdl.ptr().get()});
  }
  hp::pp::Pipeline pipe(sched, stages, world,
                        [last](const at::Tensor& o, const at::Tensor& y) { return last->loss_of_logits(o, y); });
  const int64_t B = kRowsPerMicrobatch * m;
  auto batch = [&](int step) {
    return at::randint(c.vocab, {B, kSeq + 1}, at::detail::createCPUGenerator(step), at::kLong);
  };
  auto step_once = [&](int step) {
    at::Tensor b = batch(step);
    pipe.step(b.narrow(1, 0, kSeq), b.narrow(1, 1, kSeq));
    for (auto& ch : chunks) ch->zero_grad();
  };
  step_once(0);  // warm-up: allocations, the shape headers

  std::vector<double> times, fwd, bwd, bwd_in, bwd_w;
  double busy = 0, peak = 0;
  for (int s = 0; s < steps; ++s) {
    world->barrier().wait();
    hp::trace::enable("/tmp/hp_pp_bench_trace");
    hp::trace::clear();
    const int64_t before = hp::memory::current_bytes();
    hp::memory::reset_peak();
    const double t0 = now_s();
    step_once(s + 1);
    const double t = now_s() - t0;
    peak = std::max(peak, static_cast<double>(hp::memory::peak_bytes() - before));
    double compute = 0;
    for (const auto& e : hp::trace::events()) {
      if (e.cat != "compute") continue;
      const double d = static_cast<double>(e.dur_us) * 1e-6;
      if (e.name.rfind("pp forward", 0) == 0) fwd.push_back(d);
      if (e.name.rfind("pp backward", 0) == 0) {
        // "pp backward 3I1": the action's kind follows its stage number.
        const auto a = hp::pp::Action::parse(e.name.substr(12));
        (a.kind == hp::pp::ActionKind::kBackwardInput    ? bwd_in
         : a.kind == hp::pp::ActionKind::kBackwardWeight ? bwd_w
                                                        : bwd)
            .push_back(d);
      }
      if (e.name.rfind("pp ", 0) == 0) compute += d;
    }
    hp::trace::disable();
    at::Tensor worst = at::full({1}, t, at::kDouble);
    world->all_reduce(worst, {hp::ReduceOp::MAX}).wait();
    times.push_back(worst.item<double>());
    busy += compute;
  }
  Row row;
  row.schedule = kind == "interleaved" ? "interleaved v=" + std::to_string(v) : kind;
  row.m = m;
  row.step_s = hp::bench::median(times);
  // Costs: the medians over every rank's spans.
  auto med = [](const std::vector<double>& v) { return v.empty() ? 0.0 : hp::bench::median(v); };
  at::Tensor costs = at::tensor({med(fwd), med(bwd), busy / steps, med(bwd_in), med(bwd_w)}, at::kDouble);
  world->all_reduce(costs, {hp::ReduceOp::AVG}).wait();
  hp::pp::Costs k;
  k.forward = costs[0].item<double>();
  k.backward = costs[1].item<double>();
  k.backward_input = costs[3].item<double>();
  k.backward_weight = costs[4].item<double>();
  const auto sim = hp::pp::simulate(sched, k);
  row.predicted_s = sim.makespan;
  row.bubble = 1.0 - costs[2].item<double>() / row.step_s;
  double sim_bubble = 0;
  for (double b : sim.bubble) sim_bubble += b;
  row.predicted_bubble = sim_bubble / sim.bubble.size();

  // One stage's activation bytes for one micro-batch: a forward of this rank's first stage,
  // its graph kept, measured alone.
  double per_mb = 0;
  {
    at::Tensor b = batch(99).narrow(0, 0, kRowsPerMicrobatch);
    at::Tensor x = b.narrow(1, 0, kSeq);
    if (r != 0) x = at::randn({kRowsPerMicrobatch, kSeq, c.dim}).requires_grad_(true);
    const int64_t before = hp::memory::current_bytes();
    at::Tensor out = hp::call(chunks[0], x);
    per_mb = static_cast<double>(hp::memory::current_bytes() - before);
  }
  at::Tensor mem = at::tensor({peak, per_mb * sim.peak_in_flight[static_cast<size_t>(r)]}, at::kDouble);
  world->all_reduce(mem, {hp::ReduceOp::MAX}).wait();
  row.peak_bytes = mem[0].item<double>();
  row.closed_form_bytes = mem[1].item<double>();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  hp::init();
  {
    const int steps = argc > 1 ? std::atoi(argv[1]) : 3;
    auto world = hp::world();
    const int p = world->size();
    if (p < 2) {
      std::fprintf(stderr, "pp_bench: run it on 2 or more ranks (mpirun -np 2)\n");
      hp::finalize();
      return 1;
    }
    hp::memory::install_counting_allocator();
    std::vector<Row> rows;
    for (int m : {p, 2 * p, 4 * p}) {
      rows.push_back(run(world, "gpipe", 1, m, steps));
      rows.push_back(run(world, "1f1b", 1, m, steps));
      rows.push_back(run(world, "interleaved", 2, m, steps));
      rows.push_back(run(world, "zbh1", 1, m, steps));
      rows.push_back(run(world, "zbv", 2, m, steps));
      if (m >= 2 * p) rows.push_back(run(world, "dualpipev", 2, m, steps));  // needs 2p micro-batches
    }
    if (world->rank() == 0) {
      std::printf("pp_bench: %d ranks, Llama dim %lld x %lld layers, %lld x %lld tokens per micro-batch, fp32, "
                  "%d timed steps (median)\n",
                  p, static_cast<long long>(bench_config().dim), static_cast<long long>(bench_config().layers),
                  static_cast<long long>(kRowsPerMicrobatch), static_cast<long long>(kSeq), steps);
      std::printf("| schedule | m | step ms | simulated ms | measured/simulated | bubble | simulated bubble | "
                  "peak activation MiB | closed form MiB |\n|---|---|---|---|---|---|---|---|---|\n");
      for (const auto& w : rows) {
        std::printf("| %s | %d | %.1f | %.1f | %.3f | %.3f | %.3f | %.2f | %.2f |\n", w.schedule.c_str(), w.m,
                    w.step_s * 1e3, w.predicted_s * 1e3, w.step_s / w.predicted_s, w.bubble, w.predicted_bubble,
                    w.peak_bytes / 1048576.0, w.closed_form_bytes / 1048576.0);
      }
    }
  }
  hp::finalize();
  return 0;
}
