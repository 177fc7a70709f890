// Private: one fully_shard unit (a parameter group) and the state machines it runs.
//
// A group's storage state: sharded (only the shards exist), post-forward share (after a
// forward with reshard_after_forward_group_size, this rank keeps its slice for a smaller
// gather before backward), gathering (all-gathers in flight), unsharded (the module's
// tensors hold the whole parameters). Its training state: idle, forward (its forward is
// running), pre-backward (the gradient of one of its outputs arrived), post-backward (its
// gradients were reduced, or accumulated when gradient sync is off).
//
// The verbs are defined by concern: group_unshard.cpp (storage: unshard, reshard),
// group_reduce.cpp (gradients: reduce-scatter, all-reduce, applying the results),
// module_state.cpp (the hooks and the training-state machine), comm_context.cpp (the order
// of collectives across groups and roots).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/shard_plan.h"
#include "param_state.h"
#include "rules.h"

namespace hp {

namespace detail {

enum class ShardState { kSharded, kPostForwardShare, kGathering, kUnsharded };
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };
const char* to_string(ShardState s);
const char* to_string(TrainingState s);

// The implementation's way to a handle's state (the public header keeps it opaque).
struct FsdpAccess {
  using GroupState = FSDPModule::State;
  static GroupState& state(const FSDPModule& m) { return m.state(); }
};
// One fully_shard unit's state, as the implementation names it.
using GroupState = FsdpAccess::GroupState;

// One root's forward pass and the backward that follows it. It belongs to the root (the
// module whose forward ran outside any other sharded module's), not to the process: two
// models, or two pipeline stages, run forwards and backwards side by side in one process,
// each with its own pass. Every module that runs inside the root's forward joins its pass.
struct FsdpPass {
  uint64_t id = 0;  // new for each root forward outside backward (unique in the process)
  int forward_depth = 0;
  bool callback_queued = false;  // this pass's end-of-backward callback is queued
  std::vector<detail::GroupState*> forward_order;      // by when their forward started
  std::vector<detail::GroupState*> forward_end_order;  // by when their forward finished
  // The module whose reshard after forward is put off: the latest (not the root) to finish
  // its forward. The next forward to start reshards it; if none does before the root's
  // forward ends and a backward follows, it keeps its parameters for that backward, which
  // reaches it first (module_state.cpp).
  detail::GroupState* kept = nullptr;
};

}  // namespace detail

struct FSDPModule::State {
  torch::nn::Module* module = nullptr;
  std::string label;
  CommPtr shard;
  std::string shard_dim = "world";  // the mesh dim `shard` spans
  CommPtr replicate;  // null for FSDP
  FullyShardOptions opts;
  GroupDtypes dt;
  std::vector<detail::ParamInfo> params;
  c10::Device device = c10::kCPU;  // of every parameter of the group
  FusedLayout layout;
  std::vector<State*> nested;  // fully_shard'ed modules inside this one
  // The module's owner when it is held by a shared_ptr (as ModuleHolders are): tells a live
  // module from a destroyed one whose address a new module reuses.
  std::weak_ptr<torch::nn::Module> owner;
  bool owned = false;
  bool owner_gone() const { return owned && owner.expired(); }
  detail::FsdpPass own_pass;          // used when this module is the root of a forward
  detail::FsdpPass* pass = nullptr;   // the pass of this module's latest forward

  detail::ShardState storage = detail::ShardState::kSharded;
  detail::TrainingState training = detail::TrainingState::kIdle;
  bool unsharded() const { return storage == detail::ShardState::kUnsharded; }
  bool gathering() const { return storage == detail::ShardState::kGathering; }
  // Every change of `storage` and `training` goes through these, which raise hp::Error
  // naming the module and both states for a transition the machines do not have.
  void move_to(detail::ShardState to);
  void enter(detail::TrainingState to);
  void check_enter(detail::TrainingState to) const;

  std::vector<Work> ag_works;
  // wait_per_submodule: the pending gather is a forward's, one op per parameter
  // (ag_works[i] for params[i]), each waited for when needed (ParamInfo::gather_pending);
  // the submodules that own parameters, by name, each with a pre-forward hook calling
  // finish_submodule.
  bool lazy_gather = false;
  std::vector<std::string> submodules;
  detail::OwnedBuffer ag_in, ag_out;
  // reshard_after_forward_group_size k > 1: after forward this rank keeps 1/k of each
  // unsharded (padded) parameter, in the all-gather dtype, for the group of k consecutive
  // dp_shard ranks it belongs to (`post_group`); backward gathers over that group.
  CommPtr post_group;
  std::vector<int64_t> post_offsets;  // of each parameter's slice in post_fwd
  int64_t post_total = 0;
  detail::OwnedBuffer post_fwd;
  uint64_t post_fwd_iteration = 0;  // the iteration whose forward left post_fwd
  bool post_gather_fused = false;  // the pending all-gather is the fused post-forward one

  bool requires_sync = true;
  bool requires_all_reduce = true;
  bool reshard_after_backward = true;
  bool reshard_after_forward = true;  // runtime switch; opts.reshard_after_forward still decides
  bool is_last_backward = true;
  // Kept unsharded after its forward for the backward that follows (the root, and the last
  // module to finish forward): resharded by that backward, or at the root's next forward if
  // no backward came (the shards may have changed since).
  bool kept_for_backward = false;
  double divide_factor = 0;
  ReduceOp reduce_op = ReduceOp::AVG;
  std::vector<std::weak_ptr<FSDPModule>> fwd_prefetch, bwd_prefetch;

  // Per forward.
  int64_t backward_start_us = 0;  // for the trace span of this module's backward
  int grads_pending = 0;
  std::vector<detail::PendingReduce> pending;

  int shards() const { return shard->size(); }
  bool overlap() const { return detail::fsdp_overlap_for(shard->copies_without_cpu()); }
  bool has_grads() const {
    for (const auto& p : params) {
      if (p.requires_grad) return true;
    }
    return false;
  }

  // `backward`: the gather before (or prefetched for) a backward, which may start from the
  // post-forward shards; any other gather drops them and starts from the real shards.
  // `behind_reductions`: a backward prefetch issued while reduce-scatters are in flight on
  // the same communicator; its ops allocate their outputs as they start (comm_context.h).
  void begin_unshard(bool backward = false, bool behind_reductions = false);
  void finish_unshard();
  // wait_per_submodule: waits for parameter i's all-gather (raising hp::Error, after the
  // wait, if the parameter was read before it); for those of submodule k (its pre-forward
  // hook). read_before_gather names the parameters still pending that were read (`only`:
  // parameter `only` alone), and check_not_read_early raises the error naming them.
  void finish_param(size_t i);
  void finish_submodule(int k);
  std::string read_before_gather(int only = -1) const;
  void check_not_read_early(const std::string& names) const;
  void do_reshard();
  void reshard_to_group();
  // The reshard a forward asked for: to the post-forward group when a backward follows,
  // else all the way.
  void reshard_after_forward_now();
  // Frees the post-forward share, if that is what is held (the storage is then sharded).
  void drop_post_forward_share();
  void pre_forward();
  void post_forward();
  at::Tensor on_output(const at::Tensor& out, const std::shared_ptr<FSDPModule>& self);
  // The gradient of the output of this module's run that finished at `end_index` of
  // `run_pass`'s finishing order arrived.
  void pre_backward(detail::FsdpPass* run_pass, size_t end_index);
  void on_grad(size_t i);
  // This module's backward is over (all its gradients arrived, a later module's backward
  // started, or the backward ended): reduce its gradients and reshard. Once per forward;
  // `again` (reduce_grads()) reduces what accumulated since, outside backward.
  void post_backward(bool again = false);
  // The group's side of post_backward (group_reduce.cpp): issues the reductions of the
  // gradients that accumulated and reshards as configured.
  void reduce_and_reshard();
  // The forward of this module raised: it is no longer running.
  void on_forward_error();
  // Hooks each parameter's gradient accumulator (once, at fully_shard): on_grad.
  void watch_gradients();
  void issue_ready_all_reduces();
  ReduceOp grad_reduce_op() const {
    return (divide_factor > 0 || reduce_op == ReduceOp::SUM) ? ReduceOp::SUM : ReduceOp::AVG;
  }
  bool hsdp() const { return replicate && replicate->size() > 1; }
  void issue_all_reduce(detail::PendingReduce& pr);
  void apply_pending(detail::PendingReduce& pr);
  void apply_reduced(detail::ParamInfo& p, at::Tensor g);
  // One shard holding everything and the compute dtype equal to the parameters': the
  // module's tensors alias the shards, so there is nothing to gather or free.
  bool aliased() const { return detail::params_alias_shards(shards(), dt); }
};

}  // namespace hp
