// tp_bench: tensor parallelism's communication, activation memory and step time, each
// against a baseline or an analytic count in the same run.
//
//   mpirun -np N build/tp_bench bytes    bytes of every tp collective of one training step
//                                        (from the trace) against the count derived here
//                                        from the layout, sequence parallel on and off
//   mpirun -np N build/tp_bench memory   tensor bytes kept from forward for backward per
//                                        rank, tp N with and without sequence parallel,
//                                        against one process
//   mpirun -np N build/tp_bench time     step time of layouts of the N ranks on the same
//                                        global batch, interleaved step by step: FSDP N,
//                                        TP N, and (N = 4) TP 2 x FSDP 2; with the fraction
//                                        of the step spent in tp collectives
//
// The model is the reference Llama at bench dims (fp32, AdamW).
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "bench_util.h"
#include "hp/core/memory.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/tensor_parallel.h"
#include "hp/runtime.h"

namespace {

hp::models::LlamaConfig bench_config() {
  hp::models::LlamaConfig c;
  c.vocab = 1024;
  c.dim = 256;
  c.layers = 4;
  c.heads = 8;
  c.kv_heads = 4;
  c.ffn_dim = 768;
  return c;
}

constexpr int64_t kBatch = 4, kSeq = 128;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

at::Tensor tokens(int step, int64_t rows) {
  return at::randint(bench_config().vocab, {rows, kSeq + 1}, at::detail::createCPUGenerator(step), at::kLong);
}

int64_t field(const std::string& args, const std::string& key) {
  auto p = args.find("\"" + key + "\":");
  return p == std::string::npos ? -1 : std::stoll(args.substr(p + key.size() + 3));
}

// ---- bytes ---------------------------------------------------------------------------

void bytes_mode() {
  auto g = hp::world();
  const int64_t n = g->size();
  if (n == 1) {
    std::printf("bytes: needs more than one rank\n");
    return;
  }
  const auto c = bench_config();
  for (bool sp : {true, false}) {
    hp::models::Llama m(c);
    hp::models::TensorParallelOptions o;
    o.sequence_parallel = sp;
    hp::models::parallelize_llama(m, g, o);
    at::Tensor all = tokens(0, kBatch);
    hp::trace::enable("/tmp/hp_tp_bench_trace");
    hp::trace::clear();
    m->loss_of_logits(m->forward(all.narrow(1, 0, kSeq)), all.narrow(1, 1, kSeq)).backward();
    auto events = hp::trace::events();
    hp::trace::disable();
    std::map<std::string, int64_t> traced;  // op -> input bytes summed
    for (const auto& e : events) {
      if (e.cat == "comm" && e.args.find("\"group\":\"" + g->name() + "\"") != std::string::npos) {
        traced[e.name] += field(e.args, "bytes");
      }
    }
    // The count from the layout: A = one full activation [B, T, dim] in fp32; rows = B*T
    // fp32 values per loss reduction.
    const int64_t A = kBatch * kSeq * c.dim * 4, L = c.layers, rows = kBatch * kSeq * 4, norm = c.dim * 4;
    std::map<std::string, int64_t> want;
    if (sp) {
      // forward: embedding RS, per block 2 AG + 2 RS, output head AG; backward the
      // transposes, plus the norm-gradient sums (2 per block + the final norm).
      want["all_gather"] = (2 * L + 1) * (A / n) * 2;
      want["reduce_scatter"] = (2 * L + 1) * A * 2;
      want["all_reduce"] = rows + 2 * rows + (2 * L + 1) * norm;
    } else {
      // forward: embedding + 2 per block; backward: 2 per block + the output head's
      // input gradient; loss parallel's two.
      want["all_reduce"] = (2 * L + 1) * A + (2 * L + 1) * A + rows + 2 * rows;
    }
    // Bytes each rank sends on a ring: all-gather (n-1) x input, reduce-scatter
    // (n-1)/n x input, all-reduce 2 (n-1)/n x input.
    auto wire = [n](const std::map<std::string, int64_t>& b) {
      double w = 0;
      for (const auto& [op, v] : b) {
        w += op == "all_gather" ? (n - 1.0) * v : op == "reduce_scatter" ? (n - 1.0) / n * v : 2.0 * (n - 1) / n * v;
      }
      return w;
    };
    if (g->rank() == 0) {
      std::printf("tp %lld, sequence parallel %s (B=%lld T=%lld dim=%lld layers=%lld):\n",
                  static_cast<long long>(n), sp ? "on" : "off", static_cast<long long>(kBatch),
                  static_cast<long long>(kSeq), static_cast<long long>(c.dim), static_cast<long long>(L));
      for (const auto& [op, v] : want) {
        const int64_t got = traced.count(op) ? traced[op] : 0;
        std::printf("  %-15s traced %10lld B  analytic %10lld B  %s\n", op.c_str(), static_cast<long long>(got),
                    static_cast<long long>(v), got == v ? "equal" : "DIFFERENT");
      }
      for (const auto& [op, v] : traced) {
        if (!want.count(op)) std::printf("  %-15s traced %10lld B  (not in the count)\n", op.c_str(), static_cast<long long>(v));
      }
      std::printf("  sent per rank on a ring: %.2f MiB traced, %.2f MiB analytic\n", wire(traced) / 1048576.0,
                  wire(want) / 1048576.0);
    }
  }
}

// ---- memory --------------------------------------------------------------------------

// Bytes allocated by forward and still held when it returns (what backward will read), and
// the part of them allocated inside the residual stream's norms (the norm regions of the
// sequence-parallel paper: their outputs and what they save for backward).
struct Kept {
  int64_t total = 0, norms = 0;
};
Kept kept_by_forward(hp::models::Llama& m) {
  auto start = std::make_shared<int64_t>(0);
  auto in_norms = std::make_shared<int64_t>(0);
  std::vector<hp::HookHandle> hooks;
  for (const auto& item : m->named_modules()) {
    const std::string& name = item.key();
    if (name != "norm" && !(name.size() > 5 && name.compare(name.size() - 5, 5, "_norm") == 0)) continue;
    hp::ForwardHooks h;
    h.pre = [start](torch::nn::Module&) { *start = hp::memory::current_bytes(); };
    h.post = [start, in_norms](torch::nn::Module&) { *in_norms += hp::memory::current_bytes() - *start; };
    hooks.push_back(hp::register_forward_hooks(*item.value(), std::move(h)));
  }
  at::Tensor all = tokens(0, kBatch);
  const int64_t before = hp::memory::current_bytes();
  at::Tensor loss = m->loss_of_logits(m->forward(all.narrow(1, 0, kSeq)), all.narrow(1, 1, kSeq));
  Kept k{hp::memory::current_bytes() - before, *in_norms};
  loss.backward();
  for (hp::HookHandle h : hooks) hp::remove_forward_hooks(h);
  return k;
}

void memory_mode() {
  auto g = hp::world();
  const auto c = bench_config();
  hp::memory::install_counting_allocator();
  hp::models::Llama one(c);
  const Kept base = kept_by_forward(one);
  std::map<bool, Kept> tp;
  for (bool sp : {false, true}) {
    hp::models::Llama m(c);
    hp::models::TensorParallelOptions o;
    o.sequence_parallel = sp;
    hp::models::parallelize_llama(m, g, o);
    tp[sp] = kept_by_forward(m);
  }
  at::Tensor worst = at::tensor({static_cast<double>(tp[false].total), static_cast<double>(tp[true].total),
                                 static_cast<double>(tp[false].norms), static_cast<double>(tp[true].norms)},
                                at::kDouble);
  g->all_reduce(worst, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
  if (g->rank() == 0) {
    const double mib = 1048576.0, b = static_cast<double>(base.total), bn = static_cast<double>(base.norms);
    std::printf("activations kept by forward, per rank (B=%lld T=%lld dim=%lld layers=%lld, fp32), all / in the norms:\n",
                static_cast<long long>(kBatch), static_cast<long long>(kSeq), static_cast<long long>(c.dim),
                static_cast<long long>(c.layers));
    std::printf("  one process           %8.2f MiB / %6.2f MiB\n", b / mib, bn / mib);
    std::printf("  tp %d                  %8.2f MiB (%.3f) / %6.2f MiB (%.3f)\n", g->size(), worst[0].item<double>() / mib,
                worst[0].item<double>() / b, worst[2].item<double>() / mib, worst[2].item<double>() / bn);
    std::printf("  tp %d + sequence par.  %8.2f MiB (%.3f) / %6.2f MiB (%.3f)\n", g->size(),
                worst[1].item<double>() / mib, worst[1].item<double>() / b, worst[3].item<double>() / mib,
                worst[3].item<double>() / bn);
  }
}

// ---- time ----------------------------------------------------------------------------

struct Layout {
  std::string name;
  hp::models::Llama model{nullptr};
  std::vector<hp::FSDPHandle> handles;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::string tp_group;
  int64_t dp = 1, dp_rank = 0;
  std::vector<double> step_s, tp_s;
};

std::unique_ptr<Layout> make_layout(const std::string& name, int64_t tp, int64_t dp_shard) {
  auto w = hp::world();
  auto l = std::make_unique<Layout>();
  l->name = name;
  auto mesh = std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"dp_shard", dp_shard}, {"tp", tp}});
  l->model = hp::models::Llama(bench_config());
  if (tp > 1) hp::models::parallelize_llama(l->model, mesh->group("tp"));
  l->tp_group = mesh->group("tp")->name();
  std::vector<at::Tensor> params = l->model->parameters();
  if (dp_shard > 1) {
    hp::FullyShardOptions o;
    o.mesh = mesh;
    for (auto& b : l->model->blocks) l->handles.push_back(hp::fully_shard(*b, o));
    l->handles.push_back(hp::fully_shard(*l->model, o));
    params.clear();
    for (auto& h : l->handles) {
      for (auto& p : h->parameters()) params.push_back(p);
    }
  }
  l->opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4));
  l->dp = dp_shard;
  l->dp_rank = mesh->coordinate("dp_shard");
  return l;
}

void run_step(Layout& l, int step) {
  const int64_t rows = kBatch / l.dp;
  at::Tensor all = tokens(step, kBatch).narrow(0, l.dp_rank * rows, rows);
  hp::trace::enable("/tmp/hp_tp_bench_trace");
  hp::trace::clear();
  hp::world()->barrier().wait();
  const double t0 = now_s();
  l.opt->zero_grad();
  l.model->loss_of_logits(hp::call(l.model, all.narrow(1, 0, kSeq)), all.narrow(1, 1, kSeq)).backward();
  l.opt->step();
  const double t = now_s() - t0;
  auto events = hp::trace::events();
  hp::trace::disable();
  double in_tp = 0;
  for (const auto& e : events) {
    if (e.cat == "comm" && e.args.find("\"group\":\"" + l.tp_group + "\"") != std::string::npos) in_tp += e.dur_us * 1e-6;
  }
  l.step_s.push_back(t);
  l.tp_s.push_back(in_tp);
}

void time_mode(int steps) {
  auto w = hp::world();
  const int64_t n = w->size();
  std::vector<std::unique_ptr<Layout>> layouts;
  layouts.push_back(make_layout("FSDP " + std::to_string(n), 1, n));
  layouts.push_back(make_layout("TP " + std::to_string(n), n, 1));
  if (n == 4) layouts.push_back(make_layout("TP 2 x FSDP 2", 2, 2));
  for (int s = 0; s < steps + 1; ++s) {
    for (auto& l : layouts) run_step(*l, s);
  }
  if (w->rank() != 0) return;
  std::printf("step time, %lld ranks, global batch %lld x %lld tokens (median of %d steps after one warm-up):\n",
              static_cast<long long>(n), static_cast<long long>(kBatch), static_cast<long long>(kSeq), steps);
  const double base = hp::bench::median({layouts[0]->step_s.begin() + 1, layouts[0]->step_s.end()});
  for (auto& l : layouts) {
    const double t = hp::bench::median({l->step_s.begin() + 1, l->step_s.end()});
    const double c = hp::bench::median({l->tp_s.begin() + 1, l->tp_s.end()});
    std::printf("  %-14s %8.1f ms  (%.2f x %s)  in tp collectives %5.1f%%\n", l->name.c_str(), t * 1e3, t / base,
                layouts[0]->name.c_str(), 100.0 * c / t);
  }
}

}  // namespace

int main(int argc, char** argv) {
  hp::init();
  const std::string mode = argc > 1 ? argv[1] : "bytes";
  if (mode == "bytes") {
    bytes_mode();
  } else if (mode == "memory") {
    memory_mode();
  } else if (mode == "time") {
    time_mode(argc > 2 ? std::atoi(argv[2]) : 10);
  } else {
    std::fprintf(stderr, "usage: tp_bench bytes|memory|time [steps]\n");
    hp::finalize();
    return 2;
  }
  hp::finalize();
  return 0;
}
