// The smallest program a user writes: init, shard a layer, one training step, and a check
// of the averaged gradient against the same step in one process.
#include <torch/nn/modules/linear.h>

#include <cstdio>

#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"

int main() {
  hp::CommPtr world = hp::init();
  const int n = world->size(), r = world->rank();
  torch::manual_seed(1);
  torch::nn::Linear ref(6, 3);
  torch::manual_seed(1);
  torch::nn::Linear layer(6, 3);
  hp::FSDPHandle h = hp::fully_shard(*layer);
  torch::manual_seed(2);
  at::Tensor x = at::randn({2 * n, 6});
  (hp::call(ref, x).sum() / n).backward();
  hp::call(layer, x.narrow(0, 2 * r, 2)).sum().backward();
  // This rank's rows of the weight's gradient against the reference's.
  const auto sd = h->state_dict();
  at::Tensor mine = h->parameters()[0].grad();
  at::Tensor want = ref->weight.grad().narrow(0, sd[0].row_offset, mine.size(0));
  // fp32: the sharded gradient is the average of per-rank sums, the reference one sum over
  // all rows, so they differ by summation order only (~1e-7 relative here).
  const bool ok = at::allclose(mine, want, 1e-5, 1e-6);
  std::printf("consumer rank %d of %d: %s\n", r, n, ok ? "ok" : "WRONG GRADIENT");
  return ok ? 0 : 1;
}
