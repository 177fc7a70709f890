// muon_bench: Newton–Schulz of many same-shape matrices as one batch against one matrix at
// a time, and a Muon step against a ForeachAdamW step over the same matrices, in one run;
// under mpirun, distributed Muon's two schemes against each other.
//
//   build/muon_bench [COUNT] [ROWS] [COLS]
//   mpirun -np N build/muon_bench        (the distributed part only)
//
// COUNT matrices of ROWS x COLS (default 74 of 24 x 10240: the seed system's case), the
// quintic schedule (5 steps), each dtype of bf16 (Muon's default) and fp32. Each figure is
// the median of 5 runs, after one warm-up. Threads per rank as hp::init sets them
// (HP_NUM_THREADS).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_util.h"
#include "hp/mesh/shard_spec.h"
#include "hp/optim/foreach_adamw.h"
#include "hp/optim/muon.h"
#include "hp/runtime.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename Fn>
double median_time(Fn fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    const double t0 = now_s();
    fn();
    t.push_back(now_s() - t0);
  }
  return hp::bench::median(t);
}

// Distributed Muon over every rank, each matrix's rows split as fully_shard splits them:
// the matrices of 4 blocks of a model of width 256 (attention 4 x 256 x 256, MLP 2 x 704 x
// 256 and 256 x 704), bf16 iteration, fp32 parameters. Per scheme, each the largest over
// the ranks: the step (median of 5, a barrier before it included), the owned cost, the
// matrices computed, the elements sent per step.
void distributed(const hp::CommPtr& w) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (int b = 0; b < 4; ++b) {
    for (const char* n : {"wq", "wk", "wv", "wo"}) shapes.push_back({std::to_string(b) + n, {256, 256}});
    shapes.push_back({std::to_string(b) + "w1", {704, 256}});
    shapes.push_back({std::to_string(b) + "w3", {704, 256}});
    shapes.push_back({std::to_string(b) + "w2", {256, 704}});
  }
  if (w->rank() == 0) std::printf("distributed: %zu matrices over %d ranks (rows split), bf16 iteration\n", shapes.size(), w->size());
  for (hp::optim::MuonScheme scheme : {hp::optim::MuonScheme::kGatherEverywhere, hp::optim::MuonScheme::kOwner}) {
    std::vector<at::Tensor> params;
    std::vector<hp::optim::MatrixPiece> pieces;
    at::manual_seed(1);
    for (const auto& [name, shape] : shapes) {
      const hp::ShardSpec box = hp::make_shard_spec(shape, {{{"dp_shard", w->size(), w->rank()}}, {}});
      params.push_back(at::randn(box.lengths).set_requires_grad(true));
      params.back().mutable_grad() = at::randn(box.lengths);
      pieces.push_back({params.back(), name, box});
    }
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(params, std::make_unique<hp::optim::MuonOptions>(0.02));
    hp::optim::Muon muon(std::move(g));
    muon.distribute(w, pieces, scheme);
    const double t = median_time([&] {
      w->barrier().wait();
      muon.step();
    });
    at::Tensor stats = at::tensor({t, muon.plan_stats().owned_cost, static_cast<double>(muon.plan_stats().send_elements),
                                   static_cast<double>(muon.plan_stats().owned)},
                                  at::kDouble);
    w->all_reduce(stats, {hp::ReduceOp::MAX}).wait();
    if (w->rank() == 0) {
      std::printf("  %-17s step %8.2f ms | largest owned cost %.3g (%lld matrices) | most elements sent %lld\n",
                  scheme == hp::optim::MuonScheme::kOwner ? "owner" : "gather everywhere", stats[0].item<double>() * 1e3,
                  stats[1].item<double>(), static_cast<long long>(stats[3].item<double>()),
                  static_cast<long long>(stats[2].item<double>()));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  auto w = hp::init();
  if (w->size() > 1) {
    distributed(w);
    hp::finalize();
    return 0;
  }
  const int64_t count = argc > 1 ? std::atoll(argv[1]) : 74;
  const int64_t rows = argc > 2 ? std::atoll(argv[2]) : 24;
  const int64_t cols = argc > 3 ? std::atoll(argv[3]) : 10240;
  if (count < 1 || rows < 1 || cols < 1) {
    std::fprintf(stderr, "usage: muon_bench [COUNT >= 1] [ROWS >= 1] [COLS >= 1]\n");
    return 2;
  }
  std::printf("muon_bench: %lld matrices of %lld x %lld, quintic 5 steps, %d thread(s)\n",
              static_cast<long long>(count), static_cast<long long>(rows), static_cast<long long>(cols),
              at::get_num_threads());
  const auto steps = hp::optim::ns_steps(hp::optim::NsSchedule::kQuintic);
  at::manual_seed(0);
  std::vector<at::Tensor> mats;
  for (int64_t i = 0; i < count; ++i) mats.push_back(at::randn({rows, cols}));
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const double one = median_time([&] {
      for (const auto& m : mats) hp::optim::newton_schulz(m, steps, dtype);
    });
    const double batched = median_time([&] { hp::optim::newton_schulz(at::stack(mats), steps, dtype); });
    std::printf("  %-9s one at a time %8.2f ms | batched %8.2f ms | batched / one at a time %.2f\n",
                dtype == at::kBFloat16 ? "bf16" : "fp32", one * 1e3, batched * 1e3, batched / one);
  }
  // A whole optimizer step over the same matrices (fp32 parameters): Muon (bf16 iteration)
  // against ForeachAdamW.
  auto params = [&] {
    std::vector<at::Tensor> p;
    for (const auto& m : mats) {
      p.push_back(m.clone().set_requires_grad(true));
      p.back().mutable_grad() = at::randn_like(m);
    }
    return p;
  };
  std::vector<at::Tensor> pm = params(), pa = params();
  std::vector<torch::optim::OptimizerParamGroup> gm, ga;
  gm.emplace_back(pm, std::make_unique<hp::optim::MuonOptions>(0.02));
  ga.emplace_back(pa, std::make_unique<torch::optim::AdamWOptions>(1e-3));
  hp::optim::Muon muon(std::move(gm));
  hp::optim::ForeachAdamW adamw(std::move(ga), torch::optim::AdamWOptions(1e-3));
  const double tm = median_time([&] { muon.step(); });
  const double ta = median_time([&] { adamw.step(); });
  std::printf("  step      Muon %8.2f ms | ForeachAdamW %8.2f ms | Muon / AdamW %.2f\n", tm * 1e3, ta * 1e3, tm / ta);
  hp::finalize();
  return 0;
}
