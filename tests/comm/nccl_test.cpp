// The nccl backend on CUDA tensors (run with HP_BACKEND=nccl; built when CUDA and NCCL
// are): every op against references built here, ordering after the producer's stream,
// tensors the caller dropped kept alive, bad devices rejected. Written for any world
// size; the GPU check runs it at world size 1 (NCCL refuses two ranks on one GPU), where
// every reduction is an identity: a pass there shows the plumbing (streams, events,
// lifetimes, dtypes, counts of all_gather) but not NCCL's arithmetic across ranks, the
// NOCOLOR side of split, new_group's id exchange, or the abort path.
#include <gtest/gtest.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "hp/runtime.h"
#include "test_util.h"

namespace {

c10::Device gpu() { return c10::Device(c10::kCUDA, c10::cuda::current_device()); }

at::Tensor on_gpu(const at::Tensor& t) { return t.to(gpu()); }

}  // namespace

TEST(Nccl, EveryOpMatchesItsReference) {
  auto w = hp::world();
  ASSERT_EQ(w->backend(), "nccl") << "run with HP_BACKEND=nccl";
  const int n = w->size(), r = w->rank();
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kInt, at::kLong, at::kByte}) {
    SCOPED_TRACE(hp::test::dtype_name(dt));
    const int64_t m = 1000;
    // all_gather: rank i's pattern at offset i * m.
    at::Tensor in = on_gpu(hp::test::pattern(r, m, 0, dt));
    at::Tensor out = at::empty({n * m}, in.options());
    w->all_gather(out, in).wait();
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(at::equal(out.narrow(0, i * m, m).cpu(), hp::test::pattern(i, m, 0, dt)));
    }
    // all_reduce SUM and MAX; reduce_scatter SUM: against sums built on the CPU.
    at::Tensor sum = at::zeros({n * m}, at::kDouble), mx;
    for (int i = 0; i < n; ++i) {
      at::Tensor p = hp::test::pattern(i, n * m, 0, dt).to(at::kDouble);
      sum += p;
      mx = mx.defined() ? at::maximum(mx, p) : p;
    }
    at::Tensor x = on_gpu(hp::test::pattern(r, n * m, 0, dt));
    w->all_reduce(x, {hp::ReduceOp::SUM}).wait();
    EXPECT_TRUE(at::equal(x.cpu().to(at::kDouble), sum));
    x = on_gpu(hp::test::pattern(r, n * m, 0, dt));
    w->all_reduce(x, {hp::ReduceOp::MAX}).wait();
    EXPECT_TRUE(at::equal(x.cpu().to(at::kDouble), mx));
    at::Tensor rs = at::empty({m}, x.options());
    w->reduce_scatter(rs, on_gpu(hp::test::pattern(r, n * m, 0, dt)), {hp::ReduceOp::SUM}).wait();
    EXPECT_TRUE(at::equal(rs.cpu().to(at::kDouble), sum.narrow(0, r * m, m)));
    if (at::isFloatingType(dt)) {  // AVG: the sum divided by n, by the library
      at::Tensor a = on_gpu(hp::test::pattern(r, n * m, 0, dt));
      w->all_reduce(a, {hp::ReduceOp::AVG}).wait();
      hp::test::expect_rounded_once(a, sum / n, "nccl all_reduce AVG");
    }
    // broadcast from the last rank; all_to_all with equal splits.
    at::Tensor b = on_gpu(hp::test::pattern(r, m, 0, dt));
    w->broadcast(b, n - 1).wait();
    EXPECT_TRUE(at::equal(b.cpu(), hp::test::pattern(n - 1, m, 0, dt)));
    at::Tensor a2a_in = on_gpu(hp::test::pattern(r, n * m, 0, dt)), a2a_out = at::empty_like(a2a_in);
    w->all_to_all(a2a_out, a2a_in).wait();
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(at::equal(a2a_out.narrow(0, i * m, m).cpu(), hp::test::pattern(i, n * m, 0, dt).narrow(0, r * m, m)));
    }
  }
  w->barrier().wait();
}

// The op runs after the work that produced its input on the caller's stream, even when
// that stream is a side stream busy with a long kernel, and the caller may drop its
// references at once.
TEST(Nccl, OrderedAfterTheProducerStreamAndKeepsInputsAlive) {
  auto w = hp::world();
  const int n = w->size();
  at::Tensor out;
  hp::Work work;
  {
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    c10::cuda::CUDAStreamGuard g(side);
    at::Tensor big = at::randn({2048, 2048}, at::TensorOptions().device(gpu()));
    for (int i = 0; i < 8; ++i) big = big.matmul(big).div_(2048);  // keeps the side stream busy
    at::Tensor x = at::full({1 << 20}, 3.0f, at::TensorOptions().device(gpu())) + big.sum() * 0;
    out = at::empty({n << 20}, x.options());
    work = w->all_gather(out, x);
  }
  // x and big are gone: the communicator must keep x until the op is done. New tensors of
  // the same size on the same stream would reuse x's block if it had been freed early.
  std::vector<at::Tensor> decoys;
  {
    c10::cuda::CUDAStreamGuard g(c10::cuda::getStreamFromPool());
    for (int i = 0; i < 4; ++i) decoys.push_back(at::full({1 << 20}, -1.0f, at::TensorOptions().device(gpu())));
  }
  work.wait();
  EXPECT_TRUE(at::all(out.cpu() == 3.0f).item<bool>());
}

TEST(Nccl, RejectsTensorsItCannotMove) {
  auto w = hp::world();
  // Checked on the caller's thread before anything is sent: the communicator stays usable.
  hp::test::expect_error([&] { w->all_reduce(at::ones({4})).wait(); }, {"cpu", "nccl"});
  at::Tensor x = at::ones({4}, at::TensorOptions().device(gpu()));
  w->all_reduce(x).wait();
  EXPECT_EQ(x[0].item<float>(), static_cast<float>(w->size()));
}

TEST(Nccl, SubCommunicators) {
  auto w = hp::world();
  auto sub = w->split(0, w->rank());
  ASSERT_TRUE(sub);
  EXPECT_EQ(sub->size(), w->size());
  EXPECT_EQ(sub->world_ranks()[sub->rank()], w->rank());
  at::Tensor x = at::ones({8}, at::TensorOptions().device(gpu()));
  sub->all_reduce(x).wait();
  EXPECT_EQ(x[0].item<float>(), static_cast<float>(w->size()));
}
