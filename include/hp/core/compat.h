// What differs between the libtorch versions hyperparallel builds against: Debian's 1.13
// (CPU, CI here) and 2.x (CUDA, the GPU machine). Everything version-dependent lives here.
#pragma once

#include <torch/version.h>

#define HP_TORCH_VERSION (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR)

// c10::Allocator::allocate lost its const qualifier in 2.3, which also added the pure
// virtual copy_data.
#if HP_TORCH_VERSION >= 203
#define HP_ALLOCATOR_ALLOCATE_CONST
#define HP_ALLOCATOR_HAS_COPY_DATA 1
#else
#define HP_ALLOCATOR_ALLOCATE_CONST const
#define HP_ALLOCATOR_HAS_COPY_DATA 0
#endif

#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>

#include "hp/config.h"
#include "hp/core/error.h"
#if HP_HAVE_CUDA
#include <ATen/native/cuda/Resize.h>
#endif

namespace hp::compat {

// Resizes the storage under `t` in place to `bytes` (0 frees it): the StorageImpl, and so
// every tensor sharing it (autograd's saved tensors included), sees the new allocation.
// On CUDA the allocation goes through the caching allocator on the current stream.
inline void resize_storage_bytes(const at::Tensor& t, size_t bytes) {
  if (t.is_cuda()) {
#if HP_HAVE_CUDA
    at::native::resize_bytes_cuda(t.storage().unsafeGetStorageImpl(), bytes);
    return;
#else
    HP_CHECK(false, "a CUDA tensor in a build without CUDA");
#endif
  }
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), bytes);
}

}  // namespace hp::compat
