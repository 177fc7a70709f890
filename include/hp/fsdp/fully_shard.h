// fully_shard: FSDP and HSDP for libtorch modules.
//
// fully_shard(module, options) shards the parameters of `module` (those not already
// managed by a fully_shard applied to one of its submodules, nor ignored) along dim 0
// over the mesh's dp_shard ranks, and returns the module's FSDPModule handle. Apply it
// bottom-up: each transformer block, then the root. Run the root, and every sharded
// module, through hp::call (hp/hooks/call.h): its hooks all-gather the parameters before
// forward (and again before backward when they were resharded), reduce-scatter the
// gradients as each module's backward finishes (then all-reduce them over dp_replicate
// for HSDP), and leave the reduced gradient on the sharded parameters by the time
// backward() returns.
//
// Ownership: after fully_shard the module's parameter tensors keep their identity (module
// fields and autograd's saved tensors stay valid) but their storage is managed by
// fully_shard: allocated when unsharded, freed in place when resharded. Gradients that
// autograd produces and tensors the user passes in are only read, never freed or resized;
// fully_shard frees only buffers it allocated itself (OwnedBuffer in src/fsdp/buffers.h).
//
// The optimizer steps on handle->parameters(): one leaf per parameter holding this rank's
// rows (dim0 / shards rows, fewer for the last ranks when dim 0 does not divide).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/fsdp/mixed_precision.h"
#include "hp/mesh/shard_spec.h"
#include "hp/hooks/call.h"  // sharded modules run through hp::call
#include "hp/mesh/device_mesh.h"

namespace hp {

struct FullyShardOptions {
  // A mesh with a dim named dp_shard: FSDP over it, HSDP when it also has dp_replicate;
  // its other dims (tp, pp) are not data-parallel: fully_shard works within each of their
  // groups (under tensor parallelism, on each rank's pieces). Otherwise by position: 1-D,
  // FSDP over its only dim; 2-D, HSDP over (replicate, shard). Null: FSDP over hp::world().
  std::shared_ptr<DeviceMesh> mesh;
  // Free the unsharded parameters after forward (all-gather again before backward).
  bool reshard_after_forward = true;
  // FSDP2's int form of reshard_after_forward: with k > 1, after forward each rank keeps
  // 1/k of every unsharded parameter (in the all-gather dtype) for its group of k
  // consecutive dp_shard ranks, and the all-gather before backward runs over that group
  // only (within a node, say). k must divide dp_shard; 1 keeps the parameters unsharded
  // (as reshard_after_forward = false); 0: not set. Needs reshard_after_forward = true.
  int reshard_after_forward_group_size = 0;
  MixedPrecisionPolicy mp_policy;
  // One all-gather / reduce-scatter per module (fused, aligned buffers) instead of one per
  // parameter.
  bool comm_fusion = false;
  // Forward (with grad mode on) waits for each parameter's all-gather only when the
  // submodule that owns it is called through hp::call, not for the whole module's at its
  // start: a block's first layer computes while the rest of its parameters arrive (under a
  // slow link, a step's first block no longer waits for all of its gathers).
  // Contract: the module's forward uses a submodule's parameters only through that
  // submodule's hp::call, or after it. A read before it that autograd records (any use
  // that shapes the output, with grad mode on) raises an error naming the parameter; one it
  // cannot see (under NoGradGuard, through detach() or item()) would read a gather in
  // flight. Parameters of the module itself, shared by several submodules, or frozen are
  // waited for at its start; without grad mode and in backward the whole module is waited
  // for, as by default. Per-parameter all-gathers only: with comm_fusion it is not
  // supported yet.
  bool wait_per_submodule = false;
  // Parameters of the module left alone (not sharded, not reduced).
  std::vector<at::Tensor> ignored_params;
  // Deferred initialization: for a module built under hp::memory::DeferredAllocation (its
  // tensors have no storage of their own), fills `full` (the parameter's global shape and
  // dtype) with the value `param` (the module's tensor, by identity) must start with.
  // fully_shard calls it for one parameter at a time and keeps only this rank's rows, so
  // no rank ever holds more than one whole parameter. Required for such a module; ignored
  // for parameters with real storage. hp::models::parameter_initializer gives one.
  std::function<void(const at::Tensor& param, at::Tensor& full)> param_init;
  // The device the shards, their gradients and the gathered parameters live on; unset: the
  // parameters' own. Parameters built elsewhere (on the CPU, or without storage) are copied
  // there one at a time as they are sharded, so a model built on the host trains on a GPU
  // without a rank ever holding it whole there. The module's buffers are not moved
  // (materialize_deferred_buffers takes a device for them).
  c10::optional<c10::Device> device;
};

// One rank's shard of a parameter, as in a sharded state dict.
struct ShardedTensor {
  std::string name;             // the parameter's name in the fully_shard'ed module
  at::Tensor local;             // this rank's real rows (may have 0 rows)
  std::vector<int64_t> global_shape;
  int64_t row_offset;           // first global dim-0 row of `local`
  // This rank's box of the parameter: dim 0 split over the shard mesh dim ("dp_shard", or
  // "world" without a mesh); a 0-d parameter counts as shape [1]. For a tensor-parallel
  // piece (hp/mesh/parameter_spec.h) the box is in the global tensor: the piece's box with
  // its dim 0 split again (global_shape and row_offset above stay the piece's). Checkpoints
  // reshard by intersecting such boxes (hp/mesh/shard_spec.h).
  ShardSpec spec;
};

class FSDPModule;
namespace detail {
struct FsdpAccess;  // fully_shard's implementation: the only code that reaches a handle's state
}
using FSDPHandle = std::shared_ptr<FSDPModule>;

class FSDPModule {
 public:
  // The sharded parameters, in the module's parameter order (frozen ones included, with
  // requires_grad false): give these to the optimizer.
  std::vector<at::Tensor> parameters() const;
  std::vector<ShardedTensor> state_dict() const;
  const GroupDtypes& dtypes() const;
  // With apply_grad_on_fp32_main_grad: the fp32 main gradient of each parameter() (same
  // order; undefined for frozen ones). Otherwise all undefined.
  std::vector<at::Tensor> main_grads() const;
  torch::nn::Module& module() const;

  // Runtime controls. `recurse` also applies to the fully_shard'ed modules nested inside.
  // Off: gradients accumulate unsharded (in the reduce dtype) until a backward with it on.
  void set_requires_gradient_sync(bool on, bool recurse = true);
  // HSDP: off = reduce-scatter but skip the dp_replicate all-reduce, accumulating the
  // reduced shards until a backward with it on.
  void set_requires_all_reduce(bool on, bool recurse = true);
  void set_reshard_after_backward(bool on, bool recurse = true);
  // Off: the parameters stay unsharded after forward (a pipeline stage running several
  // micro-batches between its UNSHARD and RESHARD); on: as the options say.
  void set_reshard_after_forward(bool on, bool recurse = true);
  // False keeps the parameters unsharded after this backward (e.g. before another
  // micro-batch); true (the default) reshards as configured.
  void set_is_last_backward(bool last);
  // Divide reduced gradients by `factor` instead of averaging (0 = average).
  void set_gradient_divide_factor(double factor);
  // AVG (default) or SUM over the data-parallel ranks.
  void set_reduce_op(ReduceOp op);
  // All-gather these modules' parameters right after this one's, in forward / backward.
  void set_modules_to_forward_prefetch(const std::vector<FSDPHandle>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPHandle>& modules);

  // Explicit all-gather: returns at once with the collectives in flight when async;
  // wait_for_unshard() completes it (forward does so by itself).
  void unshard(bool async = false);
  void wait_for_unshard();
  void reshard();
  bool is_unsharded() const;
  // An all-gather was issued (unshard(async) or a prefetch) and not yet completed.
  bool unshard_in_flight() const;
  // Whether a gradient reduction of this module is still running (true inside backward,
  // or between reduce_grads() and finalize_backward(): the end-of-backward callback and
  // finalize_backward() wait for all of them).
  bool gradients_in_flight() const;

  // Explicit gradient verbs, for a schedule that runs several backwards before reducing
  // (a pipeline's micro-batches): with set_requires_gradient_sync(false) those backwards
  // accumulate unreduced gradients. reduce_grads() issues this module's reduction of what
  // accumulated (reduce-scatter, then the dp_replicate all-reduce as it completes) now,
  // outside backward, whatever the sync setting, and reshards it when configured.
  // finalize_backward() waits for every reduction issued so far (of any module) and leaves
  // the results on the sharded parameters, as the end of a backward does. Raises when called
  // from inside a backward of this module's pass.
  void reduce_grads();
  void finalize_backward();

  ~FSDPModule();
  FSDPModule(const FSDPModule&) = delete;
  FSDPModule& operator=(const FSDPModule&) = delete;

 private:
  // The implementation's (src/fsdp/group.h); handles are made by fully_shard only.
  struct State;
  friend struct detail::FsdpAccess;
  friend FSDPHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& options);
  explicit FSDPModule(std::unique_ptr<State> s);
  State& state() const { return *state_; }

  std::unique_ptr<State> state_;
};

FSDPHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});
// Gives every buffer of `module` (recursively) that was built under a DeferredAllocation
// real storage, filled with zeros (the reference models' buffers all start at zero; a
// module whose buffers start otherwise sets them after this). With `device`, then moves
// every buffer there (FullyShardOptions::device's counterpart).
void materialize_deferred_buffers(torch::nn::Module& module, c10::optional<c10::Device> device = c10::nullopt);
// The handle of a module fully_shard was applied to, or null.
FSDPHandle fsdp_handle(const torch::nn::Module& module);

// Overlap: on, all-gathers are prefetched and reductions run while backward goes on; off,
// every fully_shard collective is waited for where it is issued and nothing is prefetched.
// HP_FSDP_OVERLAP=auto (the default) turns it on by fsdp_overlap_auto: for a module whose
// group's communicator copies without the CPU (Communicator::copies_without_cpu(): nccl),
// or where each rank has a core to spare for its communication thread, and off otherwise:
// a communication thread sharing the compute thread's core makes the step slower, not
// faster. The planner predicts with the same rule. 0 and 1 force
// it. set_fsdp_overlap forces it process-wide (between steps, not inside a forward or
// backward); reset_fsdp_overlap returns to HP_FSDP_OVERLAP. fsdp_overlap() says what a
// CPU backend's module does now.
void set_fsdp_overlap(bool on);
void reset_fsdp_overlap();
bool fsdp_overlap();
// The auto rule: on where the communicator copies without the CPU, or where a node's
// `cores` hold each of its `ranks_per_node` ranks' `threads_per_rank` compute threads and
// one communication thread.
bool fsdp_overlap_auto(bool copies_without_cpu, int cores, int ranks_per_node, int threads_per_rank);
namespace detail {
// What a module whose shard group copies without the CPU (or not) does now.
bool fsdp_overlap_for(bool copies_without_cpu);
}  // namespace detail

}  // namespace hp
