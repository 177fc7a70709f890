// Private: the storage fully_shard owns, with ownership in the types.
//
// UnshardedParam is the module's own tensor of a sharded parameter: the only code that
// gives it storage (an unshard) or takes it away (a reshard).
//
// OwnedBuffer holds a tensor fully_shard allocated itself; it alone may be released
// (its storage freed in place). Tensors that autograd produced or the user passed in are
// handled as plain at::Tensor and are never released or resized by fully_shard: a cast or
// reshape of such a tensor that may alias it is always copied into an OwnedBuffer before
// anything that will be released later (the seed system freed a caller's gradient because
// a same-dtype cast aliased it).
#pragma once

#include <ATen/ATen.h>

#include "hp/core/compat.h"

namespace hp::detail {

// The module's tensor of one sharded parameter. Its identity is kept (module fields and
// autograd's saved tensors refer to it) while its storage comes and goes: sized for the
// padded unsharded parameter by an unshard, emptied in place by a reshard.
class UnshardedParam {
 public:
  UnshardedParam() = default;
  explicit UnshardedParam(at::Tensor t) : t_(std::move(t)) {}
  const at::Tensor& tensor() const { return t_; }
  void allocate(int64_t bytes) const { compat::resize_storage_bytes(t_, bytes); }
  void free() const { compat::resize_storage_bytes(t_, 0); }
  // A tensor over the storage (which must be allocated) that shares neither its version
  // counter nor its autograd meta, so collectives writing through it do not look like
  // in-place edits of the parameter to autograd. It must not outlive the next free(): the
  // all-gathers writing through it are waited for before any reshard.
  at::Tensor raw(at::IntArrayRef shape, at::ScalarType dt) const {
    return at::from_blob(t_.data_ptr(), shape, at::TensorOptions().dtype(dt).device(t_.device()));
  }

 private:
  at::Tensor t_;
};

class OwnedBuffer {
 public:
  OwnedBuffer() = default;
  static OwnedBuffer zeros(at::IntArrayRef shape, at::ScalarType dt, c10::Device dev) {
    return OwnedBuffer(at::zeros(shape, at::TensorOptions().dtype(dt).device(dev)));
  }
  static OwnedBuffer empty(at::IntArrayRef shape, at::ScalarType dt, c10::Device dev) {
    return OwnedBuffer(at::empty(shape, at::TensorOptions().dtype(dt).device(dev)));
  }
  // Copies `src` (never aliases it) into a new buffer of dtype dt on src's device.
  static OwnedBuffer copy_of(const at::Tensor& src, at::ScalarType dt) {
    OwnedBuffer b = empty(src.sizes(), dt, src.device());
    b.t_.copy_(src);
    return b;
  }
  OwnedBuffer(OwnedBuffer&&) = default;
  OwnedBuffer& operator=(OwnedBuffer&&) = default;
  OwnedBuffer(const OwnedBuffer&) = delete;
  OwnedBuffer& operator=(const OwnedBuffer&) = delete;

  bool defined() const { return t_.defined(); }
  const at::Tensor& tensor() const { return t_; }
  // Frees the storage in place (every view of it becomes empty) and forgets the tensor.
  void release() {
    if (t_.defined()) compat::resize_storage_bytes(t_, 0);
    t_ = at::Tensor();
  }
  // Forgets the tensor without freeing it, for a collective to own: a Work keeps its
  // tensors alive until the op completes and drops them then, on the communicator's
  // thread, so the storage goes the moment the op is done rather than when fully_shard
  // next looks at it.
  at::Tensor hand_to_op() {
    at::Tensor t = std::move(t_);
    t_ = at::Tensor();
    return t;
  }

 private:
  explicit OwnedBuffer(at::Tensor t) : t_(std::move(t)) {}
  at::Tensor t_;
};

}  // namespace hp::detail
