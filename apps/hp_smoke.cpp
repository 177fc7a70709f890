// hp-smoke: a few collectives across the world, printed by rank 0.
// Run: mpirun -np 4 build/hp-smoke   (or without mpirun: a world of one rank)
#include <ATen/ATen.h>

#include <iostream>

#include "hp/core/memory.h"
#include "hp/mesh/device_mesh.h"
#include "hp/runtime.h"

int main() {
  hp::CommPtr world = hp::init();
  const int r = world->rank(), n = world->size();
  auto say = [&](const std::string& s) {
    if (r == 0) std::cout << s << std::endl;
  };
  say("hyperparallel smoke run: " + std::to_string(n) + " rank(s), backend " + world->backend());

  // all_reduce: sum of (rank + 1) over ranks = n(n+1)/2
  at::Tensor x = at::full({4}, r + 1.0, at::kFloat);
  world->all_reduce(x).wait();
  say(std::string("all_reduce(sum of rank+1)      = ") + at::toString(x.scalar_type()) + " " +
      std::to_string(x[0].item<float>()) + "  (expected " + std::to_string(n * (n + 1) / 2.0) + ")");

  // all_gather: each rank contributes its rank
  at::Tensor mine = at::full({1}, r, at::kLong);
  at::Tensor all = at::empty({n}, at::kLong);
  world->all_gather(all, mine).wait();
  std::string g;
  for (int i = 0; i < n; ++i) g += std::to_string(all[i].item<int64_t>()) + " ";
  say("all_gather(rank)               = [ " + g + "]");

  // reduce_scatter in bf16: slice i of every rank's input is (i + 1); rank i gets n(i+1)
  at::Tensor in = at::arange(1, n + 1, at::kFloat).repeat_interleave(3).to(at::kBFloat16);
  at::Tensor out = at::empty({3}, at::kBFloat16);
  world->reduce_scatter(out, in).wait();
  at::Tensor outs = at::empty({3 * n}, at::kBFloat16);
  world->all_gather(outs, out).wait();
  std::string rs;
  for (int i = 0; i < n; ++i) rs += std::to_string(outs[3 * i].item<float>()) + " ";
  say("reduce_scatter(bf16) per rank  = [ " + rs + "]");

  // A 2-D mesh when the world allows it: sum over each dim separately.
  if (n % 2 == 0) {
    hp::DeviceMesh mesh(world, {{"dp_replicate", 2}, {"dp_shard", -1}});
    at::Tensor v = at::full({1}, r, at::kFloat);
    mesh.group("dp_shard")->all_reduce(v).wait();
    at::Tensor vs = at::empty({n}, at::kFloat);
    world->all_gather(vs, v).wait();
    std::string m;
    for (int i = 0; i < n; ++i) m += std::to_string(static_cast<int>(vs[i].item<float>())) + " ";
    say("mesh (dp_replicate=2, dp_shard=" + std::to_string(mesh.size("dp_shard")) +
        "): all_reduce over dp_shard of rank = [ " + m + "]");
  }
  world->barrier().wait();
  say("peak tensor memory on rank 0: " + std::to_string(hp::memory::peak_bytes()) + " bytes");
  say("smoke run OK");
  hp::finalize();
  return 0;
}
