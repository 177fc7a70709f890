// ep_bench: expert parallelism's token movement, each figure against a baseline in the
// same run.
//
//   mpirun -np N build/ep_bench bytes   bytes each rank sends to the others per MoE layer
//                                       (dispatch + combine, forward) with the plain and
//                                       the de-duplicating dispatcher over all N ranks, at
//                                       the tiny routing (8 experts, top-2, dim 64, fp32)
//                                       and at DeepSeek-V3's (256 experts, top-8, dim 7168,
//                                       bf16), uniform random routing; beside it the
//                                       expected copies per token counted for 8 and 64 ranks
//   mpirun -np N build/ep_bench time    forward + backward of one MoE layer (16 experts,
//                                       top-4, dim 256, fp32) per rank: every expert on
//                                       every rank (no communication, the baseline), EP N
//                                       plain, EP N de-duplicated, and every expert under
//                                       fully_shard over the N ranks (gathered in forward
//                                       and again in backward, gradients reduce-scattered:
//                                       the layout without EP); steps interleaved,
//                                       median step time, the experts' parameter bytes and
//                                       the step's tensor-memory peak above what was
//                                       allocated before it, per rank (no gradient
//                                       reduction but fully_shard's own)
#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.h"
#include "hp/core/memory.h"
#include "hp/ep/dispatch.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"
#include "hp/models/deepseek.h"
#include "hp/runtime.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// log C(n, k)
double log_choose(int64_t n, int64_t k) {
  return std::lgamma(static_cast<double>(n + 1)) - std::lgamma(static_cast<double>(k + 1)) -
         std::lgamma(static_cast<double>(n - k + 1));
}

// Expected ranks holding at least one of a token's k experts, uniform over E experts on R ranks.
double expected_copies(int64_t experts, int64_t k, int64_t ranks) {
  const int64_t local = experts / ranks;
  return static_cast<double>(ranks) * (1.0 - std::exp(log_choose(experts - local, k) - log_choose(experts, k)));
}

struct Routing {
  const char* name;
  int64_t experts, k, dim;
  at::ScalarType dtype;
};

void bytes_mode() {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  const int64_t tokens = 512;
  if (r == 0) {
    std::printf("ep_bench bytes: %d ranks, %lld tokens per rank, uniform random top-k routing\n", n,
                static_cast<long long>(tokens));
    std::printf("%-12s %12s %14s %14s %8s %16s\n", "routing", "rows/token", "plain B/rank", "dedup B/rank",
                "dedup/plain", "expected copies");
  }
  for (const Routing& ro : {Routing{"tiny", 8, 2, 64, at::kFloat}, Routing{"deepseek_v3", 256, 8, 7168, at::kBFloat16}}) {
    if (ro.experts % n != 0) continue;
    at::manual_seed(100 + r);
    at::Tensor x = at::randn({tokens, ro.dim}, at::TensorOptions().dtype(ro.dtype));
    at::Tensor ids = std::get<1>(at::rand({tokens, ro.experts}).topk(ro.k, -1));
    at::Tensor weights = at::rand({tokens, ro.k});
    double sent[2] = {0, 0};
    int64_t rows = 0;
    for (int kind = 0; kind < 2; ++kind) {
      auto d = hp::ep::make_dispatcher(kind == 0 ? hp::ep::DispatcherKind::kAllToAll : hp::ep::DispatcherKind::kDedup, w,
                                       ro.experts);
      hp::ep::Dispatched out = d->dispatch(x, ids, weights);
      d->combine(out.rows, out);
      at::Tensor b = at::tensor({static_cast<double>(out.dispatch_bytes + out.combine_bytes)}, at::kDouble);
      w->all_reduce(b).wait();
      sent[kind] = b.item<double>() / n;
      if (kind == 0) rows = out.rows.size(0);
    }
    at::Tensor got = at::tensor({rows}, at::kLong);
    w->all_reduce(got).wait();
    if (r == 0) {
      std::printf("%-12s %12.3f %14.0f %14.0f %8.3f %16.3f\n", ro.name,
                  static_cast<double>(got.item<int64_t>()) / static_cast<double>(tokens * n), sent[0], sent[1],
                  sent[1] / sent[0], expected_copies(ro.experts, ro.k, n));
    }
  }
  if (r == 0) {
    for (int64_t ranks : {8, 64}) {
      std::printf("counted: deepseek_v3 routing over %lld ranks: %.3f copies per token against %d rows "
                  "(rows saved %.1f%%)\n",
                  static_cast<long long>(ranks), expected_copies(256, 8, ranks), 8,
                  100.0 * (1.0 - expected_copies(256, 8, ranks) / 8.0));
    }
  }
}

void time_mode(int steps) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  hp::models::DeepSeekConfig c;
  c.dim = 256;
  c.experts = 16;
  c.experts_per_token = 4;
  c.expert_hidden = 128;
  c.shared_experts = 1;
  const int64_t tokens = 1024;
  constexpr int kVariants = 4;
  const char* names[kVariants] = {"replicated", "ep plain", "ep dedup", "fully_shard"};
  std::vector<hp::models::MoE> layers;
  hp::FSDPHandle sharded;  // the fully_shard variant's experts
  for (int v = 0; v < kVariants; ++v) {
    hp::models::MoE m(c);
    if (v == 1 || v == 2) {
      hp::models::expert_parallel(*m, w, v == 1 ? hp::ep::DispatcherKind::kAllToAll : hp::ep::DispatcherKind::kDedup);
    }
    if (v == 3) sharded = hp::fully_shard(*m->experts);
    layers.push_back(m);
  }
  std::vector<std::vector<double>> times(kVariants);
  std::vector<int64_t> peak(kVariants, 0);
  for (int s = 0; s < steps + 1; ++s) {
    at::manual_seed(1000 * s + r);
    at::Tensor x = at::randn({tokens, c.dim});
    for (int v = 0; v < kVariants; ++v) {
      at::Tensor xi = x.clone().requires_grad_(true);
      w->barrier().wait();
      hp::memory::reset_peak();
      const int64_t base = hp::memory::current_bytes();
      const double t0 = now_s();
      hp::call(layers[v], xi).sum().backward();
      at::Tensor dt = at::tensor({now_s() - t0}, at::kDouble);
      w->all_reduce(dt, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
      if (s > 0) times[v].push_back(dt.item<double>());  // the first step warms up
      peak[v] = std::max(peak[v], hp::memory::peak_bytes() - base);
      for (auto& p : layers[v]->parameters()) p.mutable_grad() = at::Tensor();
      if (v == 3) {
        for (auto& p : sharded->parameters()) p.mutable_grad() = at::Tensor();
      }
    }
  }
  if (r == 0) {
    std::printf("ep_bench time: one MoE layer (%lld experts, top-%lld, dim %lld, hidden %lld, fp32), %lld tokens per "
                "rank, %d ranks, forward + backward, median of %d steps (slowest rank)\n",
                static_cast<long long>(c.experts), static_cast<long long>(c.experts_per_token),
                static_cast<long long>(c.dim), static_cast<long long>(c.expert_hidden), static_cast<long long>(tokens), n,
                steps);
    const double base = hp::bench::median(times[0]);
    for (int v = 0; v < kVariants; ++v) {
      const double t = hp::bench::median(times[v]);
      int64_t expert_bytes = 0;
      // Held between steps: fully_shard's shards, else the experts' parameters.
      for (const auto& p : v == 3 ? sharded->parameters() : layers[v]->experts->parameters()) {
        expert_bytes += static_cast<int64_t>(p.nbytes());
      }
      std::printf("%-11s %8.2f ms  x%.3f of replicated   expert params %.2f MiB, step peak above them %.2f MiB "
                  "(rank 0)\n",
                  names[v], 1e3 * t, t / base, static_cast<double>(expert_bytes) / (1 << 20),
                  static_cast<double>(peak[v]) / (1 << 20));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  hp::init();
  hp::memory::install_counting_allocator();
  const std::string mode = argc > 1 ? argv[1] : "bytes";
  if (mode == "bytes") {
    bytes_mode();
  } else if (mode == "time") {
    time_mode(argc > 2 ? std::atoi(argv[2]) : 10);
  } else {
    std::fprintf(stderr, "usage: ep_bench bytes|time [steps]\n");
    hp::finalize();
    return 2;
  }
  hp::finalize();
  return 0;
}
