#include "hp/comm/agree.h"

#include <ATen/ATen.h>

#include <cstring>

#include "hp/core/error.h"

namespace hp {

c10::Device control_device(const CommPtr& comm) { return comm->control_device(); }

int first_failed_rank(const CommPtr& comm, bool ok) {
  const auto opts = at::TensorOptions().dtype(at::kInt).device(control_device(comm));
  at::Tensor first = at::full({1}, ok ? comm->size() : comm->rank(), opts);
  comm->all_reduce(first, {ReduceOp::MIN}).wait();
  const int bad = first.cpu().item<int>();
  return bad == comm->size() ? -1 : bad;
}

void raise_if_any_failed(const CommPtr& comm, const std::string& error, const std::string& what) {
  const int bad = first_failed_rank(comm, error.empty());
  if (bad < 0) return;
  HP_CHECK(error.empty(), error);
  throw Error(detail::str_cat(what, " failed on rank ", bad, " (its error says why)"));
}

bool all_ranks_equal(const CommPtr& comm, const at::Tensor& values, at::Tensor* max, at::Tensor* min) {
  // Where the backend carries them (a host tensor goes to the GPU for nccl).
  const c10::Device dev = comm->supports_device(values.device()) ? values.device() : control_device(comm);
  at::Tensor mx = values.to(dev, /*non_blocking=*/false, /*copy=*/true), mn = values.to(dev, false, true);
  Work a = comm->all_reduce(mx, {ReduceOp::MAX});
  Work b = comm->all_reduce(mn, {ReduceOp::MIN});
  a.wait();
  b.wait();
  if (max) *max = mx;
  if (min) *min = mn;
  return at::equal(mx, mn);
}

std::string broadcast_text(const CommPtr& comm, const std::string& text, int root) {
  const c10::Device dev = control_device(comm);
  at::Tensor n = at::full({1}, static_cast<int64_t>(text.size()), at::TensorOptions().dtype(at::kLong).device(dev));
  comm->broadcast(n, root).wait();
  const int64_t size = n.cpu().item<int64_t>();
  if (size == 0) return {};
  at::Tensor bytes = at::empty({size}, at::kByte);
  if (comm->rank() == root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  bytes = bytes.to(dev);
  comm->broadcast(bytes, root).wait();
  bytes = bytes.cpu();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(size));
}

}  // namespace hp
