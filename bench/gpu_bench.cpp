// gpu_bench: step time and peak GPU memory of a bf16 transformer under hp::fully_shard at
// world size 1 (built with CUDA and NCCL; run with HP_BACKEND=nccl). bench/fsdp2_bench.py
// runs the same model, batch and precision policy under PyTorch's FSDP2 in the same GPU
// check, and scripts/gpu_check.sh puts the two side by side.
//
//   HP_BACKEND=nccl build-gpu/gpu_bench small|large [steps]
//
// The model is the tests' transformer (tests/fsdp/fsdp_model.h): pre-norm blocks with
// LayerNorm, multi-head causal attention and a 4x GELU MLP, an 8192-token embedding tied
// to the output head. fp32 parameters, bf16 compute, fp32 gradient reduction, AdamW (the
// multi-tensor hp::optim::ForeachAdamW, as FSDP2's AdamW defaults to foreach); each
// block and the root under fully_shard. One JSON line per configuration.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.h"
#include "fsdp/fsdp_model.h"
#include "fsdp/fsdp_test_util.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/optim/foreach_adamw.h"
#include "hp/runtime.h"

namespace {

struct Config {
  const char* name;
  int64_t dim, layers, batch, seq;
};

int run(const Config& k, int steps) {
  auto world = hp::world();
  hp::test::TinyConfig c;
  c.vocab = 8192;
  c.dim = k.dim;
  c.heads = k.dim / 64 >= 32 ? 32 : k.dim / 64;
  c.ffn = 4 * k.dim;
  c.layers = k.layers;
  c.seq = k.seq;
  const c10::Device dev(c10::kCUDA, c10::cuda::current_device());
  torch::manual_seed(0);
  hp::test::TinyModel m(c);
  m->to(dev);
  hp::FullyShardOptions o;
  o.mesh = std::make_shared<hp::DeviceMesh>(world, std::vector<hp::MeshDim>{{"dp_shard", -1}});
  o.mp_policy.param_dtype = at::kBFloat16;
  o.mp_policy.reduce_dtype = at::kFloat;
  auto [hs, params] = hp::test::shard_blocks_then_root(m, o);
  // Multi-tensor AdamW, as FSDP2's Python AdamW uses foreach kernels by default.
  hp::optim::ForeachAdamW opt(params, torch::optim::AdamWOptions(1e-4));
  at::Tensor all = at::randint(c.vocab, {k.batch, k.seq + 1}, at::TensorOptions().dtype(at::kLong).device(dev));
  at::Tensor x = all.narrow(1, 0, k.seq), y = all.narrow(1, 1, k.seq);

  const auto idx = static_cast<c10::DeviceIndex>(dev.index());
  std::vector<double> ms;
  for (int s = 0; s < steps + 3; ++s) {  // 3 warm-up steps
    if (s == 3) c10::cuda::CUDACachingAllocator::resetPeakStats(idx);
    cudaDeviceSynchronize();
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    hp::call(m, x, y).backward();
    opt.step();
    cudaDeviceSynchronize();
    if (s >= 3) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(idx);
  const int64_t peak = stats.allocated_bytes[0].peak;  // the aggregate pool

  std::printf("{\"impl\":\"hp\",\"config\":\"%s\",\"dim\":%lld,\"layers\":%lld,\"batch\":%lld,\"seq\":%lld,"
              "\"step_ms_median\":%.2f,\"step_ms_min\":%.2f,\"peak_bytes\":%lld}\n",
              k.name, static_cast<long long>(k.dim), static_cast<long long>(k.layers), static_cast<long long>(k.batch),
              static_cast<long long>(k.seq), hp::bench::median(ms), *std::min_element(ms.begin(), ms.end()), static_cast<long long>(peak));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 10;
  hp::init();
  const Config small{"small", 256, 32, 8, 256}, large{"large", 4096, 4, 8, 2048};
  if (which == "small") return run(small, steps);
  if (which == "large") return run(large, steps);
  std::fprintf(stderr, "usage: gpu_bench small|large [steps]\n");
  return 2;
}
