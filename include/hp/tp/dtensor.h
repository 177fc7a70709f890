// Placements of a tensor over one mesh dim, and redistribution between them.
//
// A tensor-parallel group holds one logical (global) tensor as a local tensor per rank,
// placed in one of three ways:
//   Shard(d)   rank i holds the i-th of `size` equal pieces along dim d;
//   Replicate  every rank holds the whole tensor;
//   Partial    every rank holds a tensor of the global shape, and the global tensor is
//              their sum (or their average, Partial(kAvg)).
//
// redistribute() moves a local tensor from one placement to another with the collective
// the transition needs (Shard -> Replicate: all-gather; Partial -> Replicate: all-reduce;
// Partial -> Shard: reduce-scatter; Replicate -> Shard: a local slice) and is
// differentiable: its backward moves the gradient with the transposed collective. The
// gradient's own placement cannot be known from the forward alone (a replicated tensor
// read by tensor-parallel compute gets a Partial gradient, the same tensor read by
// replicated compute a Replicate one), so the caller states it (`grad`); the backward then
// moves the gradient from that placement to the one the input's gradient must have (Shard
// for a Shard input, Replicate for a Replicate or a Partial input).
//
// Pieces are equal: a sharded dim must be divisible by the group size (hp::Error names the
// dim and both sizes). Collectives run on the group's Communicator and wait (the caller's
// compute depends on them). Gradient reductions may run in a wider dtype (`reduce_dtype`,
// the mixed-precision policy's reduce dtype), the result cast back to the gradient's dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/mesh/parameter_spec.h"

namespace hp::tp {

struct Placement {
  enum class Kind { kShard, kReplicate, kPartial };
  Kind kind = Kind::kReplicate;
  int64_t dim = 0;                   // kShard: the sharded dim (negative counts from the end)
  ReduceOp reduce = ReduceOp::SUM;   // kPartial: SUM or AVG

  bool is_shard() const { return kind == Kind::kShard; }
  bool is_replicate() const { return kind == Kind::kReplicate; }
  bool is_partial() const { return kind == Kind::kPartial; }
  // "Shard(1)", "Replicate()", "Partial(sum)".
  std::string to_string() const;
  // Equal kinds, dims (after resolving negative ones against `ndim`) and reduce ops.
  bool same_as(const Placement& o, int64_t ndim) const;
};

inline Placement Shard(int64_t dim) { return Placement{Placement::Kind::kShard, dim, ReduceOp::SUM}; }
inline Placement Replicate() { return Placement{Placement::Kind::kReplicate, 0, ReduceOp::SUM}; }
inline Placement Partial(ReduceOp op = ReduceOp::SUM) { return Placement{Placement::Kind::kPartial, 0, op}; }

struct RedistributeOptions {
  // Wider dtype for the backward's reductions (unset: the gradient's own dtype).
  c10::optional<at::ScalarType> reduce_dtype;
};

// Differentiable: see the file comment. `grad` is the placement of the gradient that will
// arrive for the result. Supported: Shard(d) -> Replicate, Replicate -> Shard(d),
// Partial -> Replicate, Partial -> Shard(d), and any placement to itself (Replicate ->
// Replicate with a Partial gradient is the "enter a tensor-parallel region" step: nothing
// in forward, an all-reduce of the gradient in backward). Others raise "not supported yet".
at::Tensor redistribute(const at::Tensor& local, const CommPtr& group, const Placement& from, const Placement& to,
                        const Placement& grad, const RedistributeOptions& o = {});

// Not differentiable: the forward data movement alone (used by the backward, and where no
// gradient flows, such as token ids).
at::Tensor redistribute_no_grad(const at::Tensor& local, const CommPtr& group, const Placement& from,
                                const Placement& to, c10::optional<at::ScalarType> reduce_dtype = c10::nullopt);

// The piece `rank` of `size` holds of a tensor with the global shape of `full` (a view).
at::Tensor local_piece(const at::Tensor& full, const Placement& p, int64_t size, int64_t rank);

// A local tensor with its group, placement and global shape: what a rank holds of one
// logical tensor.
class DTensor {
 public:
  DTensor() = default;
  // The global shape is derived from the local one (a Shard dim times the group size).
  static DTensor from_local(at::Tensor local, CommPtr group, Placement placement);
  // Every rank passes the same full tensor; each keeps its piece (a copy).
  static DTensor distribute(const at::Tensor& full, CommPtr group, Placement placement);

  const at::Tensor& local() const { return local_; }
  const CommPtr& group() const { return group_; }
  const Placement& placement() const { return placement_; }
  const std::vector<int64_t>& global_shape() const { return global_shape_; }

  DTensor redistribute(const Placement& to, const Placement& grad, const RedistributeOptions& o = {}) const;
  // The whole tensor on every rank (its gradient taken as replicated).
  at::Tensor full_tensor() const;

 private:
  at::Tensor local_;
  CommPtr group_;
  Placement placement_;
  std::vector<int64_t> global_shape_;
};

// The boxes of split parameters (hp/mesh/parameter_spec.h), also under hp::tp.
using hp::parameter_spec;
using hp::set_parameter_spec;

}  // namespace hp::tp
