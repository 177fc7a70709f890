// Mixed precision for fully_shard: the policy a user gives, and the one function that
// resolves it, per parameter group, into every dtype the group uses.
//
// Every path of fully_shard (fused and per-parameter, FSDP and HSDP, sync and no-sync)
// takes its dtypes from GroupDtypes; no allocation falls back to a library default. In
// particular reduce_dtype unset means "the gradient's own dtype" (param_dtype when set,
// else the parameter's dtype) for the per-parameter path and the fused buffers alike.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <string>

namespace hp {

struct MixedPrecisionPolicy {
  // Dtype of the unsharded parameters in forward/backward (and of their all-gather);
  // unset = the parameters' own dtype.
  c10::optional<at::ScalarType> param_dtype;
  // Dtype of gradient reduce-scatter / all-reduce; unset = the gradient's dtype.
  c10::optional<at::ScalarType> reduce_dtype;
  // Forward outputs are cast to this dtype; unset = left as computed.
  c10::optional<at::ScalarType> output_dtype;
  // Floating-point forward inputs are cast to param_dtype.
  bool cast_forward_inputs = true;
  // Reduced gradients accumulate into an fp32 main gradient per sharded parameter, and
  // the optimizer steps with it.
  bool apply_grad_on_fp32_main_grad = false;
};

struct GroupDtypes {
  at::ScalarType param;            // the sharded parameters' storage dtype
  at::ScalarType compute;          // unsharded parameters in forward/backward
  at::ScalarType all_gather;       // all-gather input/output buffers
  at::ScalarType grad;             // gradients autograd produces for the unsharded params
  // Reduce-scatter and all-reduce, and every buffer they use, fused or per parameter: one
  // field that every allocation of the reduction reads, so no path can size or allocate a
  // reduction buffer in another dtype (the seed system's defect 000).
  at::ScalarType reduce;
  at::ScalarType unsharded_accumulate;   // unsharded grads kept across no-sync micro-steps
  at::ScalarType sharded_accumulate;     // reduced shards kept across steps without all-reduce
  at::ScalarType sharded_grad;     // what the optimizer steps with (main grad or .grad)
  bool main_grad;                  // sharded_grad is a separate fp32 main gradient
  c10::optional<at::ScalarType> output;  // forward output cast, if any
  c10::optional<at::ScalarType> input;   // forward input cast, if any

  std::string to_string() const;
};

// Resolves `policy` for a group whose parameters have dtype `param_dtype`. Raises
// hp::Error naming the field for a non-floating dtype.
GroupDtypes resolve_dtypes(const MixedPrecisionPolicy& policy, at::ScalarType param_dtype);

}  // namespace hp
