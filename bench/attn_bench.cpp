// attn_bench: the tiled attention kernel (hp/attn) against plain softmax attention written
// here (the S x S scores, a causal mask, softmax, the weighted sum; autograd's backward),
// in the same run: peak tensor memory (counting allocator) and time of forward + backward
// for one attention call, causal, fp32, batch 1, 8 heads of 64 (4 key/value heads for the
// tiled kernel, repeated for the plain one as the models did), at S = 512 ... 8192.
//
//   build/attn_bench [tile ...]     tiles to time (default 64 128 256); ATTN_BENCH_REPS
//                                   repetitions (default 3, the median is printed);
//                                   ATTN_BENCH_MAX_SEQ the longest sequence (default 8192)
//
// Memory is above the inputs and the output's gradient: what the call allocates at its
// peak (forward's kept tensors, backward's gradients and workspace).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <vector>

#include "bench_util.h"
#include "hp/attn/attention.h"
#include "hp/core/memory.h"
#include "hp/runtime.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

at::Tensor plain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t group = q.size(1) / k.size(1), S = q.size(2);
  const at::Tensor kr = k.repeat_interleave(group, 1), vr = v.repeat_interleave(group, 1);
  at::Tensor s = at::matmul(q, kr.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  s = s.masked_fill(at::ones({S, S}, at::kBool).triu(1), -std::numeric_limits<float>::infinity());
  return at::matmul(s.softmax(-1), vr);
}

struct Result {
  double seconds = 0, peak = 0;
};

Result measure(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>& fn,
               int64_t S, int reps) {
  const int64_t H = 8, KVH = 4, d = 64;
  at::manual_seed(1);
  at::Tensor q = at::randn({1, H, S, d}).requires_grad_(true), k = at::randn({1, KVH, S, d}).requires_grad_(true),
             v = at::randn({1, KVH, S, d}).requires_grad_(true);
  const at::Tensor go = at::randn({1, H, S, d});
  std::vector<double> t;
  Result r;
  for (int i = 0; i < reps + 1; ++i) {
    q.mutable_grad() = at::Tensor();
    k.mutable_grad() = at::Tensor();
    v.mutable_grad() = at::Tensor();
    const int64_t base = hp::memory::current_bytes();
    hp::memory::reset_peak();
    const double t0 = now_s();
    fn(q, k, v).backward(go);
    if (i > 0) t.push_back(now_s() - t0);  // the first warms up
    r.peak = static_cast<double>(hp::memory::peak_bytes() - base);
  }
  r.seconds = hp::bench::median(t);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  hp::init();
  hp::memory::install_counting_allocator();
  std::vector<int64_t> tiles;
  for (int i = 1; i < argc; ++i) tiles.push_back(std::atoll(argv[i]));
  if (tiles.empty()) tiles = {64, 128, 256};
  const int reps = hp::bench::env_int("ATTN_BENCH_REPS", 3);
  const int64_t max_seq = hp::bench::env_int("ATTN_BENCH_MAX_SEQ", 8192);
  std::printf("attn_bench: one causal attention call, forward + backward, fp32, 8 heads of 64 (4 kv heads), %d "
              "thread(s); peak MiB above the inputs, ms (median of %d)\n",
              at::get_num_threads(), reps);
  std::printf("%6s %12s %10s", "S", "plain MiB", "plain ms");
  for (int64_t t : tiles) std::printf(" %9s%-4lld %9s%-4lld", "MiB t", static_cast<long long>(t), "ms t", static_cast<long long>(t));
  std::printf(" %12s\n", "time ratio");
  for (int64_t S = 512; S <= max_seq; S *= 2) {
    const Result p = measure(plain, S, reps);
    std::printf("%6lld %12.1f %10.1f", static_cast<long long>(S), p.peak / 1048576.0, p.seconds * 1e3);
    double best = 1e30;
    for (int64_t t : tiles) {
      const Result r = measure(
          [t](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
            return hp::attn::attention(q, k, v, hp::attn::Mask::kCausal, 0.0, t);
          },
          S, reps);
      best = std::min(best, r.seconds);
      std::printf(" %13.1f %13.1f", r.peak / 1048576.0, r.seconds * 1e3);
    }
    std::printf(" %12.2f\n", best / p.seconds);  // the best tile's time over plain's
    std::fflush(stdout);
  }
  hp::finalize();
  return 0;
}
