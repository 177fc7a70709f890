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
//                                       top-4, dim 256, fp32; then DeepSeek tiny's: 8,
//                                       top-2, dim 64) per rank: every expert on every
//                                       rank (no communication, the baseline), EP N
//                                       plain, EP N de-duplicated, EP N/2 plain (two EP
//                                       groups; N >= 4), and every expert under
//                                       fully_shard over the N ranks (gathered in forward
//                                       and again in backward, gradients reduce-scattered:
//                                       the layout without EP), and every expert split
//                                       over the N ranks along its hidden dim (tensor
//                                       parallel with sequence parallel: the N ranks'
//                                       tokens gathered, each rank's slice of every
//                                       expert run on all of them, the output
//                                       reduce-scattered back); steps interleaved,
//                                       median step time, the experts' parameter bytes and
//                                       the step's tensor-memory peak above what was
//                                       allocated before it, per rank (no gradient
//                                       reduction but fully_shard's own)
//   HP_SIM_NET=... mpirun -np N build/ep_bench overlap [steps]
//                                       one MoE layer at DeepSeek tiny-wide's widths
//                                       (dim 256, expert hidden 128, one shared expert)
//                                       with 4N experts, top-4, 1024 tokens per rank, EP
//                                       over all N ranks, forward + backward, without
//                                       overlap (the baseline) and with its all-to-alls
//                                       in 2 and 4 chunks of local experts; steps
//                                       interleaved, median step time (slowest rank),
//                                       and from the trace the exchange's time: without
//                                       overlap every all-to-all's (each is waited for
//                                       at once), with it the `ep wait` spans plus the
//                                       counts' exchange, per step, median over steps
//                                       (rank 0), beside the planner's replay of it
//                                       (ep::overlap_exposure on the simulated link's
//                                       times, with the plain run's compute split by
//                                       FLOPs, or the experts timed alone) and the share
//                                       of the replay's hidden time that was hidden
//                                       (the planner's kOverlapCredit); meant for a
//                                       simulated network slow enough that the exchange
//                                       is a large part of the step (BENCHMARKS.md has
//                                       the command)
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/comm/simulated_network.h"
#include "hp/core/trace.h"
#include "hp/ep/dispatch.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/deepseek.h"
#include "hp/runtime.h"
#include "hp/tp/parallelize.h"

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

// One MoE layer's step under each layout of its experts (see the file comment).
void time_layer(const char* label, const hp::models::DeepSeekConfig& c, int64_t tokens, int steps) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  enum Variant { kReplicated, kEpPlain, kEpDedup, kEpHalf, kFullyShard, kTpSplit };
  std::vector<Variant> variants = {kReplicated, kEpPlain, kEpDedup};
  // EP over half the ranks (two EP groups, each holding every expert) where that is EP 2 or more.
  if (n >= 4 && n % 2 == 0) variants.push_back(kEpHalf);
  variants.push_back(kFullyShard);
  variants.push_back(kTpSplit);
  auto half = std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"replica", 2}, {"ep", -1}});
  std::vector<std::string> names;
  std::vector<hp::models::MoE> layers;
  hp::FSDPHandle sharded;  // the fully_shard variant's experts
  for (Variant v : variants) {
    hp::models::MoE m(c);
    if (v == kEpPlain || v == kEpDedup) {
      hp::models::expert_parallel(*m, w, {v == kEpPlain ? hp::ep::DispatcherKind::kAllToAll : hp::ep::DispatcherKind::kDedup});
      names.push_back(std::string("EP ") + std::to_string(n) + (v == kEpPlain ? " plain" : " dedup"));
    } else if (v == kEpHalf) {
      hp::models::expert_parallel(*m, half->group("ep"), {hp::ep::DispatcherKind::kAllToAll});
      names.push_back("EP " + std::to_string(n / 2) + " plain");
    } else if (v == kFullyShard) {
      sharded = hp::fully_shard(*m->experts);
      names.push_back("fully_shard " + std::to_string(n));
    } else if (v == kTpSplit) {
      // The tensor-parallel plan of the reference model's MoE (src/models/tensor_parallel.cpp),
      // over all N ranks, the tokens being each rank's piece of the sequence.
      using namespace hp::tp;
      const Placement partial = Partial();
      ParallelizePlan plan = {{"", PrepareModuleInput({Shard(0)}, {Replicate()})},
                              {"", PrepareModuleOutput(partial, Shard(0))},
                              {"gate", ReplicateParallel()}};
      for (const std::string e : {"shared", "experts.*"}) {
        plan.push_back({e + ".w1", ColwiseParallel().prepared_input()});
        plan.push_back({e + ".w3", ColwiseParallel().prepared_input()});
        plan.push_back({e + ".w2", RowwiseParallel().output(partial)});
      }
      parallelize_module(*m, w, plan);
      names.push_back("TP split " + std::to_string(n));
    } else {
      names.push_back("replicated");
    }
    layers.push_back(m);
  }
  const size_t V = variants.size();
  std::vector<std::vector<double>> times(V);
  std::vector<int64_t> peak(V, 0);
  for (int s = 0; s < steps + 1; ++s) {
    at::manual_seed(1000 * s + r);
    at::Tensor x = at::randn({tokens, c.dim});
    for (size_t v = 0; v < V; ++v) {
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
      if (variants[v] == kFullyShard) {
        for (auto& p : sharded->parameters()) p.mutable_grad() = at::Tensor();
      }
    }
  }
  if (r == 0) {
    std::printf("ep_bench time: %s MoE layer (%lld experts, top-%lld, dim %lld, hidden %lld, fp32), %lld tokens per "
                "rank, %d ranks, forward + backward, median of %d steps (slowest rank)\n",
                label, static_cast<long long>(c.experts), static_cast<long long>(c.experts_per_token),
                static_cast<long long>(c.dim), static_cast<long long>(c.expert_hidden), static_cast<long long>(tokens), n,
                steps);
    const double base = hp::bench::median(times[0]);
    for (size_t v = 0; v < V; ++v) {
      const double t = hp::bench::median(times[v]);
      int64_t expert_bytes = 0;
      // Held between steps: fully_shard's shards, else the experts' parameters (pieces under TP).
      for (const auto& p : variants[v] == kFullyShard ? sharded->parameters() : layers[v]->experts->parameters()) {
        expert_bytes += static_cast<int64_t>(p.nbytes());
      }
      std::printf("%-14s %8.2f ms  x%.3f of replicated   expert params %.3f MiB, step peak above them %.2f MiB "
                  "(rank 0)\n",
                  names[v].c_str(), 1e3 * t, t / base, static_cast<double>(expert_bytes) / (1 << 20),
                  static_cast<double>(peak[v]) / (1 << 20));
    }
  }
}

void time_mode(int steps) {
  hp::models::DeepSeekConfig wide;
  wide.dim = 256;
  wide.experts = 16;
  wide.experts_per_token = 4;
  wide.expert_hidden = 128;
  wide.shared_experts = 1;
  time_layer("the wider", wide, 1024, steps);
  time_layer("DeepSeek tiny's", hp::models::DeepSeekConfig::tiny(), 1024, steps);
}

// The exchange's time in one step's trace on this rank: every all-to-all's from issue to
// completion where each is waited for at once (no overlap), else the waits (`ep wait`
// spans) and the counts' exchange (the first all-to-all of each dispatch, waited at once).
double exposed_exchange_s(const std::vector<hp::trace::Event>& events, bool overlapped) {
  std::vector<const hp::trace::Event*> exchanges;
  double waits = 0;
  for (const auto& e : events) {
    if (e.cat == "comm" && e.name == "all_to_all") exchanges.push_back(&e);
    if (e.cat == "ep") waits += static_cast<double>(e.dur_us);
  }
  std::sort(exchanges.begin(), exchanges.end(),
            [](const hp::trace::Event* a, const hp::trace::Event* b) { return a->ts_us < b->ts_us; });
  double total = 0;
  for (size_t i = 0; i < exchanges.size(); ++i) {
    // Forward issues 1 + 2C (the counts first), backward 2C.
    const bool counts = overlapped && i == 0;
    if (!overlapped || counts) total += static_cast<double>(exchanges[i]->dur_us);
  }
  return 1e-6 * (total + waits);
}

void overlap_mode(int steps) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  // One rank holds every expert: nothing is exchanged, nothing chunked.
  HP_CHECK(n >= 2, "ep_bench overlap: run it on 2 or more ranks (mpirun -np 2), not ", n);
  hp::models::DeepSeekConfig c;
  c.dim = 256;
  c.expert_hidden = 128;
  c.shared_experts = 1;
  c.experts = 4 * n;
  c.experts_per_token = 4;
  c.expert_groups = 1;
  c.groups_per_token = 1;
  const int64_t tokens = 1024;
  const std::vector<int> chunk_counts = {1, 2, 4};
  std::vector<hp::models::MoE> layers;
  for (int chunks : chunk_counts) {
    hp::models::MoE m(c);
    hp::models::expert_parallel(*m, w, {hp::ep::DispatcherKind::kAllToAll, chunks});
    layers.push_back(m);
  }
  const std::string dir = "/tmp/hp_ep_bench_overlap_trace";
  hp::trace::enable(dir);
  const size_t V = layers.size();
  std::vector<std::vector<double>> times(V), exposed(V);
  for (int s = 0; s < steps + 1; ++s) {
    at::manual_seed(1000 * s + r);
    at::Tensor x = at::randn({tokens, c.dim});
    for (size_t v = 0; v < V; ++v) {
      at::Tensor xi = x.clone().requires_grad_(true);
      w->barrier().wait();
      hp::trace::clear();
      const double t0 = now_s();
      hp::call(layers[v], xi).sum().backward();
      const double mine = now_s() - t0;
      const std::vector<hp::trace::Event> events = hp::trace::events();
      at::Tensor dt = at::tensor({mine}, at::kDouble);
      w->all_reduce(dt, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
      if (s > 0) {  // the first step warms up
        times[v].push_back(dt.item<double>());
        exposed[v].push_back(exposed_exchange_s(events, chunk_counts[v] > 1));
      }
      for (auto& p : layers[v]->parameters()) p.mutable_grad() = at::Tensor();
    }
  }
  hp::trace::clear();
  hp::trace::disable();
  // The compute the exchange can hide, timed alone on every rank at once (the same sharing
  // of this machine's cores as in the steps): this rank's experts on the rows a balanced
  // routing sends them (tokens x k over its experts) and the shared expert on the tokens,
  // forward and backward apart.
  hp::models::MoE& plain = layers[0];
  const int64_t local = static_cast<int64_t>(plain->experts->list.size());
  const std::vector<int64_t> counts(static_cast<size_t>(local), tokens * c.experts_per_token / local);
  std::vector<double> routed_f, routed_b, shared_f, shared_b;
  for (int s = 0; s < steps + 1; ++s) {
    at::manual_seed(77 + s + r);
    at::Tensor rows = at::randn({tokens * c.experts_per_token, c.dim}).requires_grad_(true);
    at::Tensor x = at::randn({tokens, c.dim}).requires_grad_(true);
    w->barrier().wait();
    double t0 = now_s();
    at::Tensor y = plain->experts->forward(rows, counts);
    const double f1 = now_s() - t0;
    t0 = now_s();
    y.sum().backward();
    const double b1 = now_s() - t0;
    t0 = now_s();
    at::Tensor z = plain->shared->forward(x);
    const double f2 = now_s() - t0;
    t0 = now_s();
    z.sum().backward();
    const double b2 = now_s() - t0;
    if (s > 0) {
      routed_f.push_back(f1);
      routed_b.push_back(b1);
      shared_f.push_back(f2);
      shared_b.push_back(b2);
    }
  }
  if (r == 0) {
    std::printf("ep_bench overlap: MoE layer (%lld experts, top-%lld, dim %lld, hidden %lld, 1 shared expert, fp32), "
                "%lld tokens per rank, EP %d, forward + backward, median of %d steps\n",
                static_cast<long long>(c.experts), static_cast<long long>(c.experts_per_token),
                static_cast<long long>(c.dim), static_cast<long long>(c.expert_hidden), static_cast<long long>(tokens),
                n, steps);
    const double base = hp::bench::median(times[0]), base_exposed = hp::bench::median(exposed[0]);
    // The planner's replay (ep::overlap_exposure) of the same exchange: each chunk's
    // all-to-all as the simulated link models it, beside the experts' compute timed alone.
    // "replay (FLOPs)" splits the plain step's time outside the exchange between forward
    // and backward 1:2 and between the routed and the shared experts k : shared, as the
    // planner splits a block's; "replay (timed)" uses the timings.
    const char* spec = std::getenv("HP_SIM_NET");
    const hp::SimulatedNetwork net = hp::SimulatedNetwork::parse(spec ? spec : "20:10");
    const hp::LinkModel& link = net.ranks_per_node > 0 && n > net.ranks_per_node ? net.inter : net.intra;
    const double compute = base - base_exposed;
    const double routed_share = static_cast<double>(c.experts_per_token) /
                                static_cast<double>(c.experts_per_token + c.shared_experts);
    const double row_bytes = static_cast<double>(tokens * c.experts_per_token * c.dim) * 4.0;
    const double counts_s = hp::SimulatedNetwork::seconds(hp::CommOp::kAllToAll, 8 * c.experts, n, link);
    std::printf("timed alone (ms): experts forward %.2f backward %.2f, shared forward %.2f backward %.2f; "
                "the plain step outside its exchange %.2f\n",
                1e3 * hp::bench::median(routed_f), 1e3 * hp::bench::median(routed_b),
                1e3 * hp::bench::median(shared_f), 1e3 * hp::bench::median(shared_b), 1e3 * compute);
    // "hidden / replay's": the exchange the overlap hid (plain's exposed less this one's) over
    // what the timed replay hides (its plain exposure less its overlapped one).
    std::printf("%-12s %10s %8s %16s %12s %12s %16s %16s %18s\n", "chunks", "step ms", "x plain",
                "exchange ms (r0)", "of plain's", "rest ms", "replay (FLOPs)", "replay (timed)", "hidden / replay's");
    double replay_plain = 0;
    for (size_t v = 0; v < V; ++v) {
      const double t = hp::bench::median(times[v]), e = hp::bench::median(exposed[v]);
      hp::ep::OverlapTimes o;
      o.chunks = chunk_counts[v];
      o.rows = o.outputs = hp::SimulatedNetwork::seconds(
          hp::CommOp::kAllToAll, static_cast<int64_t>(row_bytes / o.chunks), n, link);
      o.experts_forward = compute / 3 * routed_share;
      o.experts_backward = 2 * o.experts_forward;
      o.shared_forward = compute / 3 * (1 - routed_share);
      o.shared_backward = 2 * o.shared_forward;
      const hp::ep::Exposure flops = hp::ep::overlap_exposure(o);
      o.experts_forward = hp::bench::median(routed_f);
      o.experts_backward = hp::bench::median(routed_b);
      o.shared_forward = hp::bench::median(shared_f);
      o.shared_backward = hp::bench::median(shared_b);
      const hp::ep::Exposure timed = hp::ep::overlap_exposure(o);
      const double replay = counts_s + timed.forward + timed.backward;
      if (v == 0) replay_plain = replay;
      const std::string hidden = v == 0 || replay_plain - replay <= 0
                                     ? std::string("-")
                                     : std::to_string((base_exposed - e) / (replay_plain - replay)).substr(0, 5);
      std::printf("%-12s %10.2f %8.3f %16.2f %12.3f %12.2f %16.2f %16.2f %18s\n",
                  chunk_counts[v] == 1 ? "1 (none)" : std::to_string(chunk_counts[v]).c_str(), 1e3 * t, t / base,
                  1e3 * e, e / base_exposed, 1e3 * (t - e), 1e3 * (counts_s + flops.forward + flops.backward),
                  1e3 * replay, hidden.c_str());
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
  } else if (mode == "overlap") {
    overlap_mode(argc > 2 ? std::atoi(argv[2]) : 10);
  } else {
    std::fprintf(stderr, "usage: ep_bench bytes|time|overlap [steps]\n");
    hp::finalize();
    return 2;
  }
  hp::finalize();
  return 0;
}
