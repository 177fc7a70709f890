// cp_bench: context parallelism's activation memory, attention time, exposed ring
// communication and bytes, each against a baseline in the same run. The layer is a Llama
// of small width over a long sequence ("tiny-wide": dim 256, 8 heads, 4 key/value heads,
// head dim 32, SwiGLU hidden 704, vocab 256, 2 layers, fp32, batch 1, causal). CP groups
// are made of the first cp ranks of the world (the others wait), so one run at N ranks
// holds the rows cp 1, 2, ..., N (powers of 2).
//
//   mpirun -np N build/cp_bench memory [seq]  tensor bytes per rank (rank 0) above the
//                                       parameters and their gradients, held after forward
//                                       and peak over forward + backward: the attention
//                                       call alone, the MLP alone, one block, the whole
//                                       model with its loss; cp 1 and every method at cp
//                                       2..N, as a ratio to cp 1 beside 1/cp (seq 4096)
//   mpirun -np N build/cp_bench time [reps]   attention alone (forward + backward, one
//                                       compute thread per rank) per rank at seq 1024,
//                                       2048, 4096: cp 1 on rank 0, each method at cp
//                                       2..N (slowest rank), and the compute a rank does
//                                       at cp 2, 4, 8 with no communication (its query
//                                       chunks against every rank's keys, in one process)
//   mpirun -np 2 build/cp_bench overlap SPEC...  the ring at cp 2: attention forward and
//                                       backward per layer over a world with the
//                                       simulated link SPEC (HP_SIM_NET's syntax) against
//                                       the same over the plain world, interleaved; the
//                                       exposed time is the difference (seq
//                                       CP_BENCH_SEQ, default 2048; CP_BENCH_REPS, default 5)
//   mpirun -np N build/cp_bench bytes [seq]  bytes each rank sends per attention call
//                                       (forward + backward), every method at cp 2..N,
//                                       against the count derived here
//   build/cp_bench mla                  DeepSeek-V3's MLA under the ring: exchanging the
//                                       decompressed per-head K/V (what the layer does)
//                                       against the compressed latent up-projected by every
//                                       rank; bytes per token, and one received block's
//                                       up-projection timed against its attention (fp32,
//                                       one process) at chunks of 256, 512 and 1024 tokens
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "hp/comm/simulated_network.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/cp/context_parallel.h"
#include "hp/hooks/call.h"
#include "hp/models/llama.h"
#include "hp/runtime.h"

namespace {

using hp::cp::ContextParallel;
using hp::cp::ContextParallelOptions;
using hp::cp::Mask;
using hp::cp::Method;
using hp::cp::Split;

hp::models::LlamaConfig tiny_wide(int64_t seq) {
  hp::models::LlamaConfig c;
  c.vocab = 256;
  c.dim = 256;
  c.layers = 2;
  c.heads = 8;
  c.kv_heads = 4;
  c.max_seq = seq;
  return c;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// The CP degrees a world of n ranks runs: 1, 2, 4, ... up to n.
std::vector<int> degrees(int n) {
  std::vector<int> out;
  for (int cp = 1; cp <= n; cp *= 2) out.push_back(cp);
  return out;
}

// The first `cp` ranks of the world as a group (a collective of the world); null elsewhere.
hp::CommPtr first_ranks(int cp) {
  auto w = hp::world();
  return w->split(w->rank() < cp ? 0 : -1, w->rank());
}

// The methods a row of degree cp runs: the local computation at cp 1, every method above.
std::vector<Method> methods_at(int cp) {
  if (cp == 1) return {Method::kRing};  // one rank: no exchange, whatever the method
  return {Method::kRing, Method::kAllGather, Method::kUlysses};
}

std::string row_name(int cp, Method m) { return cp == 1 ? "local" : hp::cp::method_name(m); }

// ---- memory ----------------------------------------------------------------------------

struct Bytes {
  int64_t held = 0;  // allocated at the end of forward beyond the baseline: saved for backward
  int64_t peak = 0;  // highest beyond the baseline over forward + backward
};

// Runs forward (returning a scalar) then backward; gradients of the parameters exist before
// the baseline (accumulated in place), so neither they nor the parameters are counted.
template <typename Forward>
Bytes measure(const std::vector<at::Tensor>& params, Forward forward) {
  for (at::Tensor p : params) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
  }
  // Let the communicators' threads drop the tensors of the ops before (they free them
  // shortly after completion, which would lower the count during this measurement).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  hp::memory::reset_peak();
  const int64_t base = hp::memory::current_bytes();
  Bytes b;
  {
    at::Tensor loss = forward();
    b.held = hp::memory::current_bytes() - base;
    loss.backward();
  }
  b.peak = hp::memory::peak_bytes() - base;
  return b;
}

void memory_mode(int64_t seq) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  const hp::models::LlamaConfig c = tiny_wide(seq);
  const char* parts[] = {"attention", "mlp", "block", "model"};
  struct Row {
    int cp;
    Method method;
    Bytes b[4];
  };
  std::vector<Row> rows;
  for (int cp : degrees(n)) {
    hp::CommPtr g = first_ranks(cp);
    for (Method m : methods_at(cp)) {
      Row row{cp, m, {}};
      if (g) {
        hp::set_compute_threads(std::max(1, hp::usable_cores() / cp));  // the idle ranks wait
        auto ctx = std::make_shared<ContextParallel>(g, ContextParallelOptions{m, Split::kHeadTail});
        const int64_t T = seq / cp, hd = c.head_dim();
        at::manual_seed(10 + g->rank());
        // The attention call alone. Its inputs are made inside the measurement (as the
        // projections make them in a model), so what it keeps of them counts.
        at::Tensor q = at::randn({1, c.heads, T, hd}).requires_grad_(true);
        at::Tensor k = at::randn({1, c.kv_heads, T, hd}).requires_grad_(true);
        at::Tensor v = at::randn({1, c.kv_heads, T, hd}).requires_grad_(true);
        at::Tensor go = at::randn({1, c.heads, T, hd});
        row.b[0] = measure({q, k, v}, [&] {
          return (ctx->attention(q * 1.0, k * 1.0, v * 1.0, Mask::kCausal) * go).sum();
        });
        // The MLP alone, and one block (its attention over the whole sequence through ctx).
        at::Tensor x = at::randn({1, T, c.dim}).requires_grad_(true);
        hp::models::SwiGLU mlp(c.dim, c.hidden_dim());
        row.b[1] = measure(mlp->parameters(), [&] { return hp::call(mlp, x).square().sum(); });
        hp::models::LlamaBlock block(c);
        block->attn->context_parallel = ctx;
        auto [cos, sin] =
            hp::models::rotary_rows(hp::models::rotary_tables(seq, c.head_dim(), c.rope()), ctx.get());
        row.b[2] = measure(block->parameters(), [&] { return hp::call(block, x, cos, sin).square().sum(); });
        // The whole model with its loss, on this rank's tokens.
        hp::models::Llama model(c);
        hp::models::context_parallel(*model, ctx);
        at::Tensor all = at::randint(c.vocab, {1, seq + 1}, at::kLong);
        const hp::cp::SequenceSplit split = ctx->split_of(seq);
        at::Tensor xs = hp::cp::shard(all.narrow(1, 0, seq), 1, split, g->rank());
        at::Tensor ys = hp::cp::shard(all.narrow(1, 1, seq), 1, split, g->rank());
        row.b[3] = measure(model->parameters(), [&] { return model->loss_of_logits(hp::call(model, xs), ys); });
        g->barrier().wait();
      }
      rows.push_back(row);
    }
    w->barrier().wait();
  }
  if (r != 0) return;
  std::printf("cp_bench memory: tiny-wide Llama (dim %lld, heads %lld, kv_heads %lld, hidden %lld, %lld layers, vocab "
              "%lld, fp32), seq %lld, batch 1, head-tail split; MiB above parameters and gradients, rank 0\n",
              static_cast<long long>(c.dim), static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
              static_cast<long long>(c.hidden_dim()), static_cast<long long>(c.layers),
              static_cast<long long>(c.vocab), static_cast<long long>(seq));
  std::printf("%-10s %3s %-9s %10s %10s %9s %9s %6s\n", "part", "cp", "method", "held MiB", "peak MiB", "held/cp1",
              "peak/cp1", "1/cp");
  for (int p = 0; p < 4; ++p) {
    const Bytes& one = rows[0].b[p];
    for (const Row& row : rows) {
      const Bytes& b = row.b[p];
      std::printf("%-10s %3d %-9s %10.2f %10.2f %9.3f %9.3f %6.3f\n", parts[p], row.cp, row_name(row.cp, row.method).c_str(),
                  mib(b.held), mib(b.peak), static_cast<double>(b.held) / static_cast<double>(one.held),
                  static_cast<double>(b.peak) / static_cast<double>(one.peak), 1.0 / row.cp);
    }
  }
  int64_t params = 0;
  for (const auto& p : hp::models::Llama(c)->parameters()) params += static_cast<int64_t>(p.nbytes());
  std::printf("not counted above (the same at every cp): parameters %.2f MiB and their gradients %.2f MiB\n", mib(params),
              mib(params));
}

// ---- time ------------------------------------------------------------------------------

// Forward + backward of one attention call; seconds.
double attention_step(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>& attend,
                      const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0, const at::Tensor& go) {
  at::Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
             v = v0.detach().requires_grad_(true);
  const double t0 = now_s();
  attend(q, k, v).backward(go);
  return now_s() - t0;
}

void time_mode(int reps) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  hp::set_compute_threads(1);
  const hp::models::LlamaConfig c = tiny_wide(4096);
  const int64_t hd = c.head_dim();
  if (r == 0) {
    std::printf("cp_bench time: attention alone (heads %lld, kv_heads %lld, head dim %lld, fp32, causal, batch 1), "
                "forward + backward, 1 compute thread per rank, %d ranks on %d usable cores, median of %d\n",
                static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads), static_cast<long long>(hd), n,
                hp::usable_cores(), reps);
    std::printf("%6s %3s %-22s %10s %14s %9s %14s\n", "seq", "cp", "method", "ms/rank", "tokens/s/rank", "cp1/this",
                "scores/rank");
  }
  for (int64_t seq : {1024, 2048, 4096}) {
    double t_one = 0;
    auto report = [&](int cp, const std::string& what, double t, int64_t scores) {
      if (cp == 1 && t_one == 0) t_one = t;
      std::printf("%6lld %3d %-22s %10.2f %14.0f %9.3f %14lld\n", static_cast<long long>(seq), cp, what.c_str(), 1e3 * t,
                  static_cast<double>(seq / cp) / t, t_one / t, static_cast<long long>(scores));
    };
    for (int cp : degrees(n)) {
      hp::CommPtr g = first_ranks(cp);
      for (Method m : methods_at(cp)) {
        double t = 0;
        int64_t scores = 0;
        if (g) {
          ContextParallel ctx(g, ContextParallelOptions{m, Split::kHeadTail});
          const int64_t T = seq / cp;
          at::manual_seed(20 + g->rank());
          at::Tensor q = at::randn({1, c.heads, T, hd}), k = at::randn({1, c.kv_heads, T, hd}),
                     v = at::randn({1, c.kv_heads, T, hd}), go = at::randn({1, c.heads, T, hd});
          auto attend = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& d) {
            return ctx.attention(a, b, d, Mask::kCausal);
          };
          std::vector<double> ts;
          for (int i = 0; i < reps + 1; ++i) {
            g->barrier().wait();
            ctx.reset_stats();
            at::Tensor dt = at::tensor({attention_step(attend, q, k, v, go)}, at::kDouble);
            g->all_reduce(dt, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
            if (i > 0) ts.push_back(dt.item<double>());  // the first warms up
          }
          t = hp::bench::median(ts);
          // Query x key pairs over every head this rank computes (Ulysses: heads / cp of them).
          scores = ctx.stats().score_elements * (m == Method::kUlysses ? c.heads / cp : c.heads);
        }
        if (r == 0) report(cp, row_name(cp, m) + (cp > hp::usable_cores() ? " (oversubscribed)" : ""), t, scores);
      }
      w->barrier().wait();
    }
    // What one rank computes at cp 2, 4, 8 with no exchange: its query chunks against every
    // rank's keys, one local call per source rank (the blocks the ring computes, outputs
    // summed instead of merged through their log-sum-exp).
    if (r == 0) {
      for (int cp : {2, 4, 8}) {
        const hp::cp::SequenceSplit split(seq, cp, Split::kHeadTail);
        at::manual_seed(30);
        const int64_t T = split.local();
        at::Tensor q = at::randn({1, c.heads, T, hd}), k = at::randn({1, c.kv_heads, cp * T, hd}),
                   v = at::randn({1, c.kv_heads, cp * T, hd}), go = at::randn({1, c.heads, T, hd});
        const std::vector<hp::cp::Run> mine = split.runs(0);
        auto attend = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& d) {
          at::Tensor out;
          for (int j = 0; j < cp; ++j) {
            at::Tensor o = hp::attn::attention(a, b.narrow(2, j * T, T), d.narrow(2, j * T, T), mine, split.runs(j),
                                              Mask::kCausal, 0.0, T);
            out = j == 0 ? o : out + o;
          }
          return out;
        };
        std::vector<double> ts;
        for (int i = 0; i < reps + 1; ++i) {
          const double t = attention_step(attend, q, k, v, go);
          if (i > 0) ts.push_back(t);
        }
        int64_t scores = 0;
        for (const auto& qr : mine) {
          for (int j = 0; j < cp; ++j) {
            for (const auto& kr : split.runs(j)) {
              if (kr.start <= qr.start + qr.length - 1) scores += qr.length * kr.length;  // not skipped
            }
          }
        }
        report(cp, "compute alone", hp::bench::median(ts), scores * c.heads);
      }
    }
    w->barrier().wait();
  }
}

// ---- overlap ---------------------------------------------------------------------------

void overlap_mode(const std::vector<std::string>& specs, int reps) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  HP_CHECK(n == 2, "cp_bench overlap runs at 2 ranks (cp 2), got ", n);
  hp::set_compute_threads(1);
  const int64_t seq = hp::bench::env_int("CP_BENCH_SEQ", 2048);
  const hp::models::LlamaConfig c = tiny_wide(seq);
  const int64_t T = seq / 2, hd = c.head_dim();
  const int64_t block_bytes = 2 * c.kv_heads * T * hd * 4;  // K and V, fp32, one rank's
  at::manual_seed(40 + r);
  at::Tensor q = at::randn({1, c.heads, T, hd}), k = at::randn({1, c.kv_heads, T, hd}),
             v = at::randn({1, c.kv_heads, T, hd}), go = at::randn({1, c.heads, T, hd});
  // The compute the first transfer hides behind: this rank's queries on its own keys
  // (forward), timed in the same loop as the ring.
  const hp::cp::SequenceSplit split(seq, 2, Split::kHeadTail);
  std::vector<double> own;
  auto own_block = [&] {
    const double t0 = now_s();
    at::Tensor o = hp::attn::attention(q, k, v, split.runs(r), split.runs(r), Mask::kCausal, 0.0, split.local());
    own.push_back(now_s() - t0);
  };
  if (r == 0) {
    std::printf("cp_bench overlap: ring attention at cp 2 (2 ranks, 1 compute thread each), seq %lld (%lld tokens per "
                "rank), heads %lld, kv_heads %lld, head dim %lld, fp32; one exchange carries %.2f MiB of K/V; own: "
                "rank 0's queries on its own keys, forward (what the first transfer hides behind); median of %d, "
                "slowest rank\n",
                static_cast<long long>(seq), static_cast<long long>(T), static_cast<long long>(c.heads),
                static_cast<long long>(c.kv_heads), static_cast<long long>(hd), mib(block_bytes), reps);
    std::printf("%-14s %9s %9s %9s %9s %9s %9s %9s %8s %8s %8s\n", "link", "xfer ms", "own ms", "xfer/own", "fwd ms",
                "fwd sim",
                "bwd ms", "bwd sim", "exp fwd", "exp bwd", "exp all");
  }
  for (const std::string& spec : specs) {
    hp::CommOptions o;
    o.simulated_network = spec;
    hp::CommPtr sim = hp::make_mpi_world_communicator(o);
    ContextParallel plain_ctx(w, ContextParallelOptions{Method::kRing, Split::kHeadTail});
    ContextParallel sim_ctx(sim, ContextParallelOptions{Method::kRing, Split::kHeadTail});
    const hp::SimulatedNetwork net = hp::SimulatedNetwork::parse(spec);
    const double xfer = hp::SimulatedNetwork::seconds(hp::CommOp::kBatchSendRecv, block_bytes, 2, net.intra);
    std::vector<double> fwd[2], bwd[2];
    own.clear();
    for (int i = 0; i < reps + 1; ++i) {
      w->barrier().wait();
      own_block();
      if (i == 0) own.clear();
      for (int s = 0; s < 2; ++s) {
        ContextParallel& ctx = s == 0 ? plain_ctx : sim_ctx;
        at::Tensor qi = q.detach().requires_grad_(true), ki = k.detach().requires_grad_(true),
                   vi = v.detach().requires_grad_(true);
        w->barrier().wait();
        const double t0 = now_s();
        at::Tensor out = ctx.attention(qi, ki, vi, Mask::kCausal);
        const double t1 = now_s();
        out.backward(go);
        const double t2 = now_s();
        at::Tensor dt = at::tensor({t1 - t0, t2 - t1}, at::kDouble);
        w->all_reduce(dt, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
        if (i > 0) {
          fwd[s].push_back(dt[0].item<double>());
          bwd[s].push_back(dt[1].item<double>());
        }
      }
    }
    if (r == 0) {
      const double f0 = hp::bench::median(fwd[0]), f1 = hp::bench::median(fwd[1]);
      const double b0 = hp::bench::median(bwd[0]), b1 = hp::bench::median(bwd[1]);
      const double own_fwd = hp::bench::median(own);
      std::printf("%-14s %9.1f %9.1f %9.2f %9.1f %9.1f %9.1f %9.1f %7.1f%% %7.1f%% %7.1f%%\n", spec.c_str(), 1e3 * xfer,
                  1e3 * own_fwd, xfer / own_fwd, 1e3 * f0, 1e3 * f1, 1e3 * b0, 1e3 * b1, 100 * (f1 - f0) / f0, 100 * (b1 - b0) / b0,
                  100 * (f1 + b1 - f0 - b0) / (f0 + b0));
    }
  }
}

// ---- bytes -----------------------------------------------------------------------------

void bytes_mode(int64_t seq) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  const hp::models::LlamaConfig c = tiny_wide(seq);
  const int64_t hd = c.head_dim();
  if (r == 0) {
    std::printf("cp_bench bytes: one attention call (forward + backward), seq %lld, heads %lld, kv_heads %lld, head "
                "dim %lld, fp32; bytes rank 0 sends (ContextParallel::stats().bytes_sent) against the count\n",
                static_cast<long long>(seq), static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
                static_cast<long long>(hd));
    std::printf("%3s %-9s %14s %14s %10s %12s\n", "cp", "method", "bytes sent", "counted", "vs ring", "x local K/V");
  }
  for (int cp : degrees(n)) {
    if (cp == 1) continue;
    hp::CommPtr g = first_ranks(cp);
    const int64_t T = seq / cp;
    const int64_t kv = 2 * c.kv_heads * T * hd * 4, qo = 2 * c.heads * T * hd * 4;  // K+V, Q+O of one rank
    double ring = 0;
    for (Method m : methods_at(cp)) {
      int64_t sent = 0;
      if (g) {
        ContextParallel ctx(g, ContextParallelOptions{m, Split::kHeadTail});
        at::manual_seed(50 + g->rank());
        at::Tensor q = at::randn({1, c.heads, T, hd}).requires_grad_(true);
        at::Tensor k = at::randn({1, c.kv_heads, T, hd}).requires_grad_(true);
        at::Tensor v = at::randn({1, c.kv_heads, T, hd}).requires_grad_(true);
        ctx.attention(q, k, v, Mask::kCausal).sum().backward();
        sent = ctx.stats().bytes_sent;
      }
      // Ring: K/V cp-1 times forward and again backward, the gradient accumulators cp times.
      // All-gather: (cp-1)/cp of the gathered K/V forward and backward, the same of the
      // reduce-scattered gradient. Ulysses: (cp-1)/cp of q, k, v and out each way.
      int64_t counted = 0;
      if (m == Method::kRing) counted = (3 * cp - 2) * kv;
      if (m == Method::kAllGather) counted = 3 * (cp - 1) * kv;
      if (m == Method::kUlysses) counted = 2 * (cp - 1) * (qo + kv) / cp;
      if (m == Method::kRing) ring = static_cast<double>(sent);
      if (r == 0) {
        std::printf("%3d %-9s %14lld %14lld %10.3f %12.3f\n", cp, hp::cp::method_name(m), static_cast<long long>(sent),
                    static_cast<long long>(counted), static_cast<double>(sent) / ring,
                    static_cast<double>(sent) / static_cast<double>(kv));
      }
    }
    w->barrier().wait();
  }
}

// One received block of `c` tokens under the ring, DeepSeek-V3's sizes (128 heads, keys of
// 128 + 64, values of 128, a latent of 512 + 64): the decompressed exchange sends 128 x
// (192 + 128) = 40,960 values a token; the latent one 576 and up-projects them, wkv_b's
// 512 x 32,768, at every rank that receives them (2 x 512 x 32,768 FLOPs a token forward,
// twice that backward). The block's attention: c x c x 128 x (192 + 128) x 2 FLOPs
// forward. Timed here: the up-projection of c tokens, and the block's attention
// (one tile of c queries against c keys, no mask), fp32.
void mla_mode() {
  const int64_t heads = 128, nope = 128, rope = 64, vdim = 128, latent = 512;
  const int64_t qk = nope + rope, per_token = heads * (qk + vdim), latent_token = latent + rope;
  std::printf("cp_bench mla: DeepSeek-V3 attention under the ring; values per token exchanged: decompressed %lld, "
              "latent %lld (%.1fx fewer)\n",
              static_cast<long long>(per_token), static_cast<long long>(latent_token),
              static_cast<double>(per_token) / static_cast<double>(latent_token));
  std::printf("%6s %14s %14s %12s %12s %10s %10s\n", "chunk", "up-proj GFLOP", "attn GFLOP", "up-proj ms", "attn ms",
              "FLOP ratio", "time ratio");
  at::manual_seed(9);
  const at::Tensor w = at::randn({heads * (nope + vdim), latent}) * 0.02;
  for (int64_t c : {256, 512, 1024}) {
    const at::Tensor lat = at::randn({1, c, latent});
    const at::Tensor q = at::randn({1, heads, c, qk}), k = at::randn({1, heads, c, qk}), v = at::randn({1, heads, c, vdim});
    const std::vector<hp::cp::Run> run = {hp::cp::Run{0, c, 0}};
    auto best = [](const std::function<void()>& f) {
      f();  // warm-up
      double t = 1e30;
      for (int i = 0; i < 3; ++i) {
        const double t0 = now_s();
        f();
        t = std::min(t, now_s() - t0);
      }
      return t;
    };
    const double up = best([&] { (void)at::matmul(lat, w.t()).sum().item<float>(); });
    const double attn = best([&] { (void)hp::attn::attention(q, k, v, run, run, Mask::kNone, 0.0, c).sum().item<float>(); });
    const double up_flops = 2.0 * static_cast<double>(c * latent * heads * (nope + vdim));
    const double attn_flops = 2.0 * static_cast<double>(c * c * heads * (qk + vdim));
    std::printf("%6lld %14.2f %14.2f %12.1f %12.1f %10.3f %10.3f\n", static_cast<long long>(c), up_flops / 1e9,
                attn_flops / 1e9, up * 1e3, attn * 1e3, up_flops / attn_flops, up / attn);
  }
}

}  // namespace

int main(int argc, char** argv) {
  hp::prefer_passive_openmp(argv);
  hp::init();
  hp::memory::install_counting_allocator();
  const std::string mode = argc > 1 ? argv[1] : "memory";
  if (mode == "memory") {
    memory_mode(argc > 2 ? std::atoll(argv[2]) : 4096);
  } else if (mode == "time") {
    time_mode(argc > 2 ? std::atoi(argv[2]) : 3);
  } else if (mode == "overlap" && argc > 2) {
    overlap_mode(std::vector<std::string>(argv + 2, argv + argc), hp::bench::env_int("CP_BENCH_REPS", 5));
  } else if (mode == "bytes") {
    bytes_mode(argc > 2 ? std::atoll(argv[2]) : 4096);
  } else if (mode == "mla") {
    mla_mode();
  } else {
    std::fprintf(stderr, "usage: cp_bench memory [seq] | time [reps] | overlap SPEC... | bytes [seq] | mla\n");
    hp::finalize();
    return 2;
  }
  hp::finalize();
  return 0;
}
