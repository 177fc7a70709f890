// fully_shard: parameter shards, unshard/reshard in place, gradient reduction.
//
// Per module (one parameter group):
//   forward   pre hook: all-gather (unless already unsharded or prefetched); explicit
//             forward prefetch of the listed modules. post hook: reshard if configured;
//             a hook on the output tensor runs pre_backward.
//   backward  pre_backward (output's gradient arrives): all-gather again if resharded,
//             prefetch the module that ran before this one in forward. AccumulateGrad post
//             hooks count the group's gradients; when all arrived, post_backward copies them
//             into owned buffers (reduce dtype), issues the reduce-scatter and reshards.
//             HSDP all-reduces are issued in reduce-scatter order as those complete.
//   end       an engine callback (queued by the first hook of the backward) reduces the
//             groups whose gradients never all arrived (zeros for the missing ones), waits
//             for every collective and leaves the reduced gradients on the sharded leaves;
//             a parameter that got no gradient on any rank is left alone (GradFlags), as
//             one process leaves it.
// Every dtype comes from the group's GroupDtypes (resolve_dtypes).
#include "hp/fsdp/fully_shard.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <set>

#include "buffers.h"
#include "hp/core/compat.h"
#include "hp/core/env.h"
#include "hp/core/memory.h"
#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/fsdp/parameter_spec.h"
#include "hp/fsdp/shard_plan.h"
#include "hp/hooks/call.h"
#include "hp/hooks/checkpoint.h"
#include "hp/runtime.h"
#include "rules.h"

namespace hp {

using detail::OwnedBuffer;

namespace {

constexpr int64_t kFusedAlignBytes = 64;

struct ParamInfo {
  std::string name;
  at::Tensor param;  // the module's own tensor: unsharded view, identity kept
  std::vector<int64_t> shape;
  ShardPlan plan;
  bool requires_grad = false;
  at::Tensor padded;   // [rows_per_shard, rest...] in the param dtype, owned
  at::Tensor sharded;  // leaf view of the real rows of `padded`: the optimizer's
  std::shared_ptr<torch::autograd::Node> accumulator;
  bool grad_ready = false;
  OwnedBuffer unsharded_acc;  // gradients kept across no-sync micro-steps
  OwnedBuffer sharded_acc;    // reduced shards kept across steps without all-reduce
  at::Tensor main_grad;       // fp32 main gradient of the real rows
  // The gradient tensor last set on `sharded` and its version then: if the optimizer
  // cleared or zeroed it since, the main gradient starts again from zero.
  at::Tensor grad_set;
  int64_t grad_set_version = -1;
};

// Which of a group's parameters got a gradient on any rank this step (1) or on none (0):
// reduced with MAX over dp_shard before the gradients' reduce-scatter, then over
// dp_replicate before their all-reduce. A parameter no rank produced a gradient for is
// still reduced (as zeros, so every rank issues the same collectives) but its result is not
// applied: its .grad stays as one process leaves it (undefined after zero_grad(set_to_none)).
struct GradFlags {
  at::Tensor flags;  // int32 [params of the group]
  Work shard_w, replicate_w;
  bool replicate_issued = false;
  std::vector<int32_t> host;  // `flags` once every reduction of it is waited for
  const std::vector<int32_t>& wait() {
    if (host.empty()) {
      shard_w.wait();
      if (replicate_issued) replicate_w.wait();
      at::Tensor c = flags.cpu();
      host.assign(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel());
    }
    return host;
  }
};

struct PendingReduce {
  int param = -1;      // -1: the whole group (fused)
  std::shared_ptr<GradFlags> flags;  // shared by the group's reductions of this backward
  // The reduce-scatter's input (a buffer of ours, or autograd's gradient itself) is held
  // by the op alone, which drops it the moment it completes.
  OwnedBuffer output;  // reduce-scatter output = all-reduce bucket
  Work rs;
  Work ar;
  bool ar_issued = false;
  bool rs_done = false;  // reduce-scatter waited for (the op has dropped its input)
  bool applied = false;  // gradients left on the shards, output released
};

std::mutex g_mu;
std::map<const torch::nn::Module*, std::weak_ptr<FSDPModule>> g_handles;
// Parameters already managed, by tensor; the weak handle tells a live manager from one
// whose module was destroyed (the address may be reused by a new parameter).
std::map<const c10::TensorImpl*, std::weak_ptr<FSDPModule>> g_managed;

}  // namespace

namespace detail {
// The implementation's way to a handle's state (the public header keeps it opaque).
struct FsdpAccess {
  static FSDPModule::State& state(const FSDPModule& m) { return m.state(); }
};

// One root's forward pass and the backward that follows it. It belongs to the root (the
// module whose forward ran outside any other sharded module's), not to the process: two
// models, or two pipeline stages, run forwards and backwards side by side in one process,
// each with its own pass. Every module that runs inside the root's forward joins its pass.
struct FsdpPass {
  uint64_t id = 0;  // new for each root forward outside backward (unique in the process)
  int forward_depth = 0;
  bool callback_queued = false;  // this pass's end-of-backward callback is queued
  std::vector<FSDPModule::State*> forward_order;      // by when their forward started
  std::vector<FSDPModule::State*> forward_end_order;  // by when their forward finished
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
  std::vector<ParamInfo> params;
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

  bool unsharded = false;
  bool unshard_pending = false;
  std::vector<Work> ag_works;
  OwnedBuffer ag_in, ag_out;
  // reshard_after_forward_group_size k > 1: after forward this rank keeps 1/k of each
  // unsharded (padded) parameter, in the all-gather dtype, for the group of k consecutive
  // dp_shard ranks it belongs to (`post_group`); backward gathers over that group.
  CommPtr post_group;
  std::vector<int64_t> post_offsets;  // of each parameter's slice in post_fwd
  int64_t post_total = 0;
  OwnedBuffer post_fwd;
  uint64_t post_fwd_iteration = 0;  // the iteration whose forward left post_fwd
  bool post_gather_fused = false;  // the pending all-gather is the fused post-forward one

  bool requires_sync = true;
  bool requires_all_reduce = true;
  bool reshard_after_backward = true;
  bool reshard_after_forward = true;  // runtime switch; opts.reshard_after_forward still decides
  bool is_last_backward = true;
  double divide_factor = 0;
  ReduceOp reduce_op = ReduceOp::AVG;
  std::vector<std::weak_ptr<FSDPModule>> fwd_prefetch, bwd_prefetch;

  // Per iteration.
  bool pre_backward_done = false;
  int64_t backward_start_us = 0;  // for the trace span of this module's backward
  bool post_backward_done = false;
  int grads_pending = 0;
  std::vector<PendingReduce> pending;

  int shards() const { return shard->size(); }
  bool overlap() const { return detail::fsdp_overlap_for(shard->backend()); }
  bool has_grads() const {
    for (const auto& p : params) {
      if (p.requires_grad) return true;
    }
    return false;
  }

  // `backward`: the gather before (or prefetched for) a backward, which may start from the
  // post-forward shards; any other gather drops them and starts from the real shards.
  void begin_unshard(bool backward = false);
  void finish_unshard();
  void do_reshard();
  void reshard_to_group();
  void pre_forward();
  void post_forward();
  at::Tensor on_output(const at::Tensor& out, const std::shared_ptr<FSDPModule>& self);
  // The gradient of the output of this module's run that finished at `end_index` of
  // `run_pass`'s finishing order arrived.
  void pre_backward(detail::FsdpPass* run_pass, size_t end_index);
  void on_grad(size_t i);
  void post_backward();
  void issue_ready_all_reduces();
  ReduceOp grad_reduce_op() const {
    return (divide_factor > 0 || reduce_op == ReduceOp::SUM) ? ReduceOp::SUM : ReduceOp::AVG;
  }
  bool hsdp() const { return replicate && replicate->size() > 1; }
  void issue_all_reduce(PendingReduce& pr);
  void apply_pending(PendingReduce& pr);
  void apply_reduced(ParamInfo& p, at::Tensor g);
  // One shard holding everything and the compute dtype equal to the parameters': the
  // module's tensors alias the shards, so there is nothing to gather or free.
  bool aliased() const { return detail::params_alias_shards(shards(), dt); }
};

namespace {
// -1: HP_FSDP_OVERLAP not read yet; 0: off; 1: on; 2: auto.
std::atomic<int> g_overlap{-1};
int overlap_setting() {
  int v = g_overlap.load();
  if (v < 0) {
    const std::string s = env::get_string("HP_FSDP_OVERLAP");
    v = s == "auto" ? 2 : s == "1" ? 1 : 0;
    g_overlap.store(v);
  }
  return v;
}
}  // namespace

namespace detail {
bool fsdp_overlap_for(const std::string& backend) {
  const int v = overlap_setting();
  if (v != 2) return v == 1;
  // The collectives overlap compute for free where a device moves the bytes (nccl), or
  // where the communication thread has a core of its own; otherwise its copies take the
  // core compute needs, and waiting where each collective is issued is faster. (Not a
  // simulated network: its link is modelled, but the real copies still take the core.)
  return backend == "nccl" || spare_core_per_rank();
}
}  // namespace detail

void set_fsdp_overlap(bool on) { g_overlap.store(on ? 1 : 0); }
void reset_fsdp_overlap() { g_overlap.store(-1); }
bool fsdp_overlap() { return detail::fsdp_overlap_for(""); }

namespace {

using detail::FsdpPass;

// The pass whose forward is running on this thread (CPU autograd and the call boundary
// run hooks on the caller's thread); null outside any sharded module's forward.
thread_local FsdpPass* t_forward = nullptr;
std::atomic<uint64_t> g_pass_ids{0};

// Collective bookkeeping shared by every root of the process: roots may share
// communicators, and the collectives of all of them must reach each communicator in one
// order on every rank, so in-flight reductions and held-back prefetches are ordered here,
// across roots, not per root.
struct CommContext {
  std::vector<FSDPModule::State*> reduce_order;  // states in reduce-scatter issue order
  // Backward prefetches held back while a reduce-scatter is in flight, in the order they
  // were asked for. Everything of fully_shard's that issues a collective (begin_unshard,
  // post_backward, the end of backward, the next forward) issues these first, waiting for
  // the reduce-scatters; a gradient hook, or the end of pre_backward, may issue them
  // earlier, once the reduce-scatters are done. Either way they reach the communicator
  // between the same two of fully_shard's collectives on every rank. A module whose
  // post_backward has run is skipped (the flag is set only after post_backward's own flush,
  // so every rank sees the same flags at any flush).
  std::vector<FSDPModule::State*> deferred_prefetch;
};
CommContext& comm_context() {
  static CommContext c;
  return c;
}

void finish_backward(FsdpPass& pass);
void finish_reductions();
void drain_reductions(size_t keep, bool finish);
void issue_deferred_prefetches(bool wait, bool backward = true);

// Queues `pass`'s end-of-backward callback on the backward now running (once per pass;
// two passes whose losses were summed into one backward each get theirs).
void ensure_backward_callback(FsdpPass* pass) {
  if (pass == nullptr || pass->callback_queued) return;
  pass->callback_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback([pass] { finish_backward(*pass); });
}

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(FSDPModule::State* s, size_t i) : s_(s), i_(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    s_->on_grad(i_);
    return outputs;
  }

 private:
  FSDPModule::State* s_;
  size_t i_;
};

// A tensor over `t`'s storage that does not share its version counter or autograd
// meta: writes through it do not look like in-place edits of the parameter to autograd.
at::Tensor raw_view(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dt) {
  return at::from_blob(t.data_ptr(), shape, at::TensorOptions().dtype(dt).device(t.device()));
}

// Copies the flat gradient (numel elements) into dst [shards, shard_numel] as the padded
// dim-0 layout would place it; dst is zero beforehand, so padding stays zero.
void scatter_padded(const at::Tensor& dst, const at::Tensor& flat) {
  const int64_t len = dst.size(1), numel = flat.numel();
  for (int64_t j = 0; j * len < numel; ++j) {
    int64_t n = std::min(len, numel - j * len);
    dst[j].narrow(0, 0, n).copy_(flat.narrow(0, j * len, n));
  }
}

}  // namespace

void FSDPModule::State::begin_unshard(bool backward) {
  if (unsharded || unshard_pending) return;
  if (aliased() || params.empty()) {  // nothing to gather (a root whose children own every parameter)
    unsharded = true;
    return;
  }
  // Collectives must reach each communicator in the same order on every rank: whatever
  // prefetch was held back goes first (this module's own, perhaps, over the group it would
  // have used at a gradient hook), as it would have without the holding back.
  issue_deferred_prefetches(/*wait=*/true);
  if (unshard_pending) return;
  // Post-forward shards serve only the backward of their own iteration: another gather (a
  // forward, an explicit unshard, a later step's prefetch) may come after an optimizer step.
  if (!backward || pass == nullptr || post_fwd_iteration != pass->id) post_fwd.release();
  trace::Span span("unshard " + label, "fsdp");
  const at::ScalarType cd = dt.all_gather;
  const int64_t es = c10::elementSize(cd);
  for (auto& p : params) compat::resize_storage_bytes(p.param, p.plan.padded_numel() * es);
  ag_works.clear();
  post_gather_fused = false;
  if (post_fwd.defined()) {
    // From the post-forward shards, over the smaller group. The ops own the buffer now
    // (views of it when per parameter) and free it as they complete.
    const int64_t g = post_group->size();
    if (opts.comm_fusion) {
      ag_out = OwnedBuffer::empty({g * post_total}, cd, device);
      ag_works.push_back(post_group->all_gather(ag_out.tensor(), post_fwd.hand_to_op()));
      post_gather_fused = true;
    } else {
      at::Tensor buf = post_fwd.hand_to_op();
      for (size_t i = 0; i < params.size(); ++i) {
        const int64_t len = params[i].plan.padded_numel() / g;
        ag_works.push_back(post_group->all_gather(raw_view(params[i].param, {params[i].plan.padded_numel()}, cd),
                                                  buf.narrow(0, post_offsets[i], len)));
      }
    }
  } else if (opts.comm_fusion) {
    ag_in = OwnedBuffer::zeros({layout.total}, cd, device);
    for (size_t i = 0; i < params.size(); ++i) {
      ag_in.tensor().narrow(0, layout.offsets[i], params[i].plan.shard_numel())
          .copy_(params[i].padded.view(-1));
    }
    ag_out = OwnedBuffer::empty({shards() * layout.total}, cd, device);
    ag_works.push_back(shard->all_gather(ag_out.tensor(), ag_in.tensor()));
  } else {
    for (auto& p : params) {
      at::Tensor in = p.padded.view(-1);
      if (in.scalar_type() != cd) in = in.to(cd);
      at::Tensor out = raw_view(p.param, {p.plan.padded_numel()}, cd);
      ag_works.push_back(shard->all_gather(out, in));
    }
  }
  unshard_pending = true;
}

void FSDPModule::State::finish_unshard() {
  if (!unshard_pending) return;
  {
    trace::Span wait("wait all_gather " + label, "wait");
    for (auto& w : ag_works) w.wait();
  }
  ag_works.clear();
  if (post_gather_fused) {
    const int64_t g = post_group->size();
    at::Tensor all = ag_out.tensor().view({g, post_total});
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t len = params[i].plan.padded_numel() / g;
      raw_view(params[i].param, {g, len}, dt.all_gather).copy_(all.narrow(1, post_offsets[i], len));
    }
    ag_out.release();
    post_gather_fused = false;
  } else if (opts.comm_fusion) {
    at::Tensor all = ag_out.tensor().view({shards(), layout.total});
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      raw_view(p.param, {shards(), p.plan.shard_numel()}, dt.all_gather)
          .copy_(all.narrow(1, layout.offsets[i], p.plan.shard_numel()));
    }
    ag_in.release();
    ag_out.release();
  }
  unshard_pending = false;
  unsharded = true;
}

void FSDPModule::State::do_reshard() {
  finish_unshard();
  post_fwd.release();
  if (!unsharded || aliased()) return;
  for (auto& p : params) compat::resize_storage_bytes(p.param, 0);
  unsharded = false;
}

// After forward with a group size: keep this rank's slice of each unsharded parameter
// (its index in the group picks the slice), then free the unsharded storage.
void FSDPModule::State::reshard_to_group() {
  finish_unshard();
  if (!unsharded || aliased()) return;
  const int64_t g = post_group->size(), j = post_group->rank();
  OwnedBuffer keep = OwnedBuffer::empty({post_total}, dt.all_gather, device);
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t len = params[i].plan.padded_numel() / g;
    keep.tensor().narrow(0, post_offsets[i], len)
        .copy_(raw_view(params[i].param, {g, len}, dt.all_gather)[j]);
  }
  do_reshard();
  post_fwd = std::move(keep);
  post_fwd_iteration = pass->id;
}

void FSDPModule::State::pre_forward() {
  if (in_recompute()) {
    // A checkpointed module's forward recomputed in backward: its pass, forward order and
    // gradient counts stay as the first forward left them; only the parameters are needed
    // (the gather before this module's backward). The end-of-backward callback is queued
    // here, on the backward that reached the checkpoint, not on the recomputation's.
    HP_CHECK(pass != nullptr, "fully_shard(", label, "): a recomputation without a first forward");
    ensure_backward_callback(pass);
    begin_unshard(/*backward=*/true);
    finish_unshard();
    return;
  }
  if (t_forward == nullptr) {
    // This module is the root of this forward: its pass starts anew (and whatever a
    // backward that raised left behind is dropped).
    FsdpPass& it = own_pass;
    // Empty unless a backward raised, or this forward runs inside a backward.
    issue_deferred_prefetches(/*wait=*/true, /*backward=*/it.callback_queued);
    if (!it.callback_queued) it.id = ++g_pass_ids;
    it.forward_order.clear();
    it.forward_end_order.clear();
    it.forward_depth = 0;
    t_forward = &it;
  }
  pass = t_forward;
  FsdpPass& it = *pass;
  ++it.forward_depth;
  it.forward_order.push_back(this);
  pre_backward_done = false;
  post_backward_done = false;
  grads_pending = 0;
  for (auto& p : params) {
    p.grad_ready = false;
    if (p.requires_grad) ++grads_pending;
  }
  begin_unshard();
  finish_unshard();
  if (!overlap()) return;
  for (auto& w : fwd_prefetch) {
    if (auto h = w.lock()) h->state().begin_unshard();
  }
}

void FSDPModule::State::post_forward() {
  if (in_recompute()) return;  // keep the parameters for the backward that follows
  const bool root = --pass->forward_depth == 0;
  if (root) t_forward = nullptr;
  pass->forward_end_order.push_back(this);
  if (!opts.reshard_after_forward || !reshard_after_forward) return;
  // The root of a forward that a backward follows, over fully_shard children, keeps its
  // parameters (the embedding and the head, typically): its backward starts first and would
  // gather them again at once, exposed (FSDP2 does the same). A root alone is the whole
  // model and reshards as asked.
  if (root && !nested.empty() && at::GradMode::is_enabled()) return;
  // Without grad mode no backward follows: nothing to keep the group's shares for.
  if (post_group && at::GradMode::is_enabled()) {
    reshard_to_group();
  } else {
    do_reshard();
  }
}

at::Tensor FSDPModule::State::on_output(const at::Tensor& out,
                                        const std::shared_ptr<FSDPModule>& self) {
  if (out.requires_grad() && pass != nullptr) {
    std::weak_ptr<FSDPModule> weak = self;
    // This run's place in the pass's finishing order: post_forward appends it next; a
    // recomputation stands for the module's latest run.
    FsdpPass* run_pass = pass;
    size_t end_index = pass->forward_end_order.size();
    if (in_recompute()) {
      auto& ends = pass->forward_end_order;
      auto last = std::find(ends.rbegin(), ends.rend(), this);
      end_index = last == ends.rend() ? ends.size() : ends.size() - 1 - static_cast<size_t>(last - ends.rbegin());
    }
    out.register_hook([weak, run_pass, end_index](const at::Tensor&) {
      if (auto h = weak.lock()) h->state().pre_backward(run_pass, end_index);
    });
  }
  if (dt.output && out.is_floating_point() && out.scalar_type() != *dt.output) {
    return out.to(*dt.output);
  }
  return out;
}

void FSDPModule::State::pre_backward(FsdpPass* run_pass, size_t end_index) {
  if (run_pass != pass) return;  // the output of a forward whose pass has been replaced
  ensure_backward_callback(pass);
  // Backward runs in reverse forward order: when the backward of this module's run that
  // finished at `end_index` starts, every module all of whose runs finished after it (and
  // that does not contain it) has finished its backward. Reduce those now even if some
  // parameter got no gradient (which can differ between ranks, as with MoE experts):
  // reductions are then issued in the same order on every rank. A module run more than
  // once (twice in a row, or A-B-A) is reduced only after its earliest run's backward:
  // its later runs do not make it eligible.
  auto& ends = pass->forward_end_order;
  if (end_index < ends.size()) {
    for (size_t k = ends.size(); k-- > end_index + 1;) {
      State* later = ends[k];
      if (later->post_backward_done) continue;
      if (std::find(later->nested.begin(), later->nested.end(), this) != later->nested.end()) continue;
      const size_t first_end = static_cast<size_t>(std::find(ends.begin(), ends.end(), later) - ends.begin());
      if (first_end <= end_index) continue;
      later->post_backward();
    }
  }
  if (pre_backward_done) return;
  pre_backward_done = true;
  if (trace::enabled()) backward_start_us = trace::now_us();
  begin_unshard(/*backward=*/true);
  finish_unshard();
  if (!overlap()) return;
  // Prefetch: the listed modules, else the module that ran just before this one. The
  // all-gather is held back while a reduce-scatter is in flight, so that its output and
  // the reduce-scatter's input (a block of gradients each) are never allocated together;
  // it is issued at the first gradient hook that finds them done (see on_grad), or else
  // before the next collective. The communicator runs ops in order, so the all-gather
  // could not have started before them anyway.
  std::vector<State*> targets;
  for (auto& w : bwd_prefetch) {
    if (auto h = w.lock()) targets.push_back(&h->state());
  }
  if (targets.empty()) {
    // The module that started just before this one's last run.
    auto& order = pass->forward_order;
    for (size_t i = order.size(); i-- > 1;) {
      if (order[i] != this) continue;
      if (!order[i - 1]->post_backward_done && order[i - 1] != this) targets.push_back(order[i - 1]);
      break;
    }
  }
  auto& deferred = comm_context().deferred_prefetch;
  for (State* t : targets) {
    if (t->unsharded || t->unshard_pending) continue;
    if (std::find(deferred.begin(), deferred.end(), t) == deferred.end()) deferred.push_back(t);
  }
  issue_deferred_prefetches(/*wait=*/false);
}

void FSDPModule::State::on_grad(size_t i) {
  ensure_backward_callback(pass);
  // Between modules' backward, the gradient hooks are where the training thread can see
  // reductions complete: their outputs are applied and freed, and held-back prefetches go.
  drain_reductions(/*keep=*/SIZE_MAX, /*finish=*/false);
  issue_deferred_prefetches(/*wait=*/false);
  if (params[i].grad_ready) return;
  params[i].grad_ready = true;
  // Autograd accumulates a parameter's gradient only after every node that used it has
  // run its backward, so nothing reads the unsharded values any more: free them now
  // rather than with the rest of the module, when the module reshards after this backward.
  if (unsharded && !unshard_pending && !aliased() && reshard_after_backward && is_last_backward) {
    compat::resize_storage_bytes(params[i].param, 0);
  }
  if (--grads_pending == 0) post_backward();
}

void FSDPModule::State::post_backward() {
  if (post_backward_done) return;
  // Held-back prefetches go before this module's reduce-scatter, on every rank.
  issue_deferred_prefetches(/*wait=*/true);
  post_backward_done = true;
  if (trace::enabled() && pre_backward_done) {
    int64_t now = trace::now_us();
    trace::record(trace::Event{"backward " + label, "compute", backward_start_us, now - backward_start_us,
                               trace::current_tid(), false, 0, ""});
  }
  issue_ready_all_reduces();
  const bool reshard_now = reshard_after_backward && is_last_backward;
  if (!has_grads()) {
    if (reshard_now) do_reshard();
    return;
  }
  trace::Span span("post_backward " + label, "fsdp");
  const at::ScalarType rd = dt.reduce;
  // The gradient of each parameter as a flat tensor (zeros when it got none), plus what
  // earlier no-sync micro-steps accumulated. Borrowed: read only.
  auto flat_grad = [&](ParamInfo& p) -> at::Tensor {
    at::Tensor g = p.param.grad();
    at::Tensor flat;
    if (g.defined()) flat = g.reshape({-1});
    if (p.unsharded_acc.defined()) {
      flat = flat.defined() ? p.unsharded_acc.tensor().add(flat) : p.unsharded_acc.tensor();
    }
    return flat;
  };
  if (!requires_sync) {
    for (auto& p : params) {
      if (!p.requires_grad || !p.param.grad().defined()) continue;
      if (!p.unsharded_acc.defined()) p.unsharded_acc = OwnedBuffer::zeros({p.plan.numel()}, dt.unsharded_accumulate, device);
      p.unsharded_acc.tensor().add_(p.param.grad().reshape({-1}));
      p.param.mutable_grad() = at::Tensor();  // drop our reference; autograd's tensor is not freed here
    }
    if (reshard_now) do_reshard();
    return;
  }
  const ReduceOp op = grad_reduce_op();
  const int n = shards();
  if (n == 1 && !hsdp()) {
    // A world of one data-parallel rank: the reduction is the cast to the reduce dtype.
    for (auto& p : params) {
      if (!p.requires_grad) continue;
      at::Tensor g = flat_grad(p);
      if (!g.defined()) continue;  // no gradient: .grad stays as one process leaves it
      apply_reduced(p, g.to(rd).view(p.sharded.sizes()));
      p.param.mutable_grad() = at::Tensor();  // drop our reference only
      p.unsharded_acc.release();
    }
    if (reshard_now) do_reshard();
    return;
  }
  // Which parameters got a gradient, reduced over the ranks ahead of the gradients.
  auto flags = std::make_shared<GradFlags>();
  {
    std::vector<int32_t> local(params.size(), 0);
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      local[i] = (p.requires_grad && (p.param.grad().defined() || p.unsharded_acc.defined())) ? 1 : 0;
    }
    flags->flags = at::tensor(local, at::kInt).to(device);
    flags->shard_w = shard->all_reduce(flags->flags, {ReduceOp::MAX});
  }
  if (opts.comm_fusion) {
    PendingReduce pr;
    pr.flags = flags;
    OwnedBuffer input = OwnedBuffer::zeros({n, layout.total}, rd, device);
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      if (!p.requires_grad) continue;
      at::Tensor g = flat_grad(p);
      if (g.defined()) scatter_padded(input.tensor().narrow(1, layout.offsets[i], p.plan.shard_numel()), g);
      // Copied: let go of the gradient now, so the group's gradients and the fused
      // buffer coexist one parameter at a time rather than whole.
      p.param.mutable_grad() = at::Tensor();
      p.unsharded_acc.release();
    }
    pr.output = OwnedBuffer::empty({layout.total}, rd, device);
    pr.rs = shard->reduce_scatter(pr.output.tensor(), input.hand_to_op(), {op});
    pending.push_back(std::move(pr));
  } else {
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      if (!p.requires_grad) continue;
      PendingReduce pr;
      pr.param = static_cast<int>(i);
      pr.flags = flags;
      at::Tensor g = flat_grad(p);
      pr.output = OwnedBuffer::empty({p.plan.shard_numel()}, rd, device);
      if (g.defined() && !p.unsharded_acc.defined() && g.scalar_type() == rd && g.is_contiguous() &&
          p.plan.padded_numel() == p.plan.numel()) {
        // Already the reduce-scatter's input (right dtype, no padding): borrow it. It is
        // only read, and the op drops its reference when it completes.
        pr.rs = shard->reduce_scatter(pr.output.tensor(), g, {op});
      } else {
        OwnedBuffer input = OwnedBuffer::zeros({p.plan.padded_numel()}, rd, device);
        if (g.defined()) input.tensor().narrow(0, 0, p.plan.numel()).copy_(g);
        pr.rs = shard->reduce_scatter(pr.output.tensor(), input.hand_to_op(), {op});
      }
      pending.push_back(std::move(pr));
    }
  }
  for (auto& p : params) {
    if (!p.requires_grad) continue;
    p.param.mutable_grad() = at::Tensor();  // drop our reference only
    p.unsharded_acc.release();
  }
  comm_context().reduce_order.push_back(this);
  if (!overlap()) {
    trace::Span wait("wait reduce_scatter " + label, "wait");
    for (auto& pr : pending) pr.rs.wait();
  }
  if (reshard_now) do_reshard();
}

// Folds the partial shards kept by steps without all-reduce into this reduction, then
// all-reduces it over dp_replicate.
void FSDPModule::State::issue_all_reduce(PendingReduce& pr) {
  if (pr.flags && !pr.flags->replicate_issued) {
    // Partials kept from steps without all-reduce count as gradients too (checked for the
    // whole group at its first all-reduce, before any of them is folded in).
    pr.flags->shard_w.wait();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].sharded_acc.defined()) pr.flags->flags[static_cast<int64_t>(i)].fill_(1);
    }
    pr.flags->replicate_w = replicate->all_reduce(pr.flags->flags, {ReduceOp::MAX});
    pr.flags->replicate_issued = true;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if ((pr.param >= 0 && pr.param != static_cast<int>(i)) || !p.sharded_acc.defined()) continue;
    at::Tensor seg = pr.param >= 0 ? pr.output.tensor()
                                   : pr.output.tensor().narrow(0, layout.offsets[i], p.plan.shard_numel());
    seg.add_(p.sharded_acc.tensor());
    p.sharded_acc.release();
  }
  pr.ar = replicate->all_reduce(pr.output.tensor(), {grad_reduce_op()});
  pr.ar_issued = true;
}

// Moves every group's reductions forward, in reduce-scatter issue order (the same on
// every rank): a completed reduce-scatter (whose input the op itself has dropped) gets
// its dp_replicate all-reduce issued; a completed reduction leaves its gradients on the
// shards and frees its output. Waits for the oldest reduce-scatters until at most `keep`
// are in flight: when communication falls behind backward, their inputs (one module's
// gradients each) would otherwise pile up. `finish` (at the end of backward) also waits
// for every all-reduce and applies everything.
namespace {
void drain_reductions(size_t keep, bool finish) {
  auto& order = comm_context().reduce_order;
  size_t in_flight = 0;
  for (FSDPModule::State* s : order) {
    for (auto& pr : s->pending) in_flight += pr.rs_done ? 0 : 1;
  }
  bool blocked = false;
  for (FSDPModule::State* s : order) {
    for (auto& pr : s->pending) {
      if (pr.rs_done) continue;
      if (blocked || (in_flight <= keep && !pr.rs.is_completed())) {
        blocked = true;  // later all-reduces must not overtake this one
        continue;
      }
      --in_flight;
      pr.rs.wait();
      pr.rs_done = true;
      if (s->hsdp() && s->requires_all_reduce) s->issue_all_reduce(pr);
    }
  }
  for (FSDPModule::State* s : order) {
    for (auto& pr : s->pending) {
      if (pr.applied || !pr.rs_done) continue;
      if (pr.ar_issued && !finish && !pr.ar.is_completed()) continue;
      pr.ar.wait();
      s->apply_pending(pr);
      pr.output.release();
      pr.applied = true;
    }
  }
}
}  // namespace

void FSDPModule::State::issue_ready_all_reduces() {
  drain_reductions(detail::kReductionsInFlight - 1, /*finish=*/false);
}

namespace {

bool reduce_scatter_in_flight() {
  for (FSDPModule::State* s : comm_context().reduce_order) {
    for (auto& pr : s->pending) {
      if (!pr.rs_done && !pr.rs.is_completed()) return true;
    }
  }
  return false;
}

// Issues the held-back backward prefetches once no reduce-scatter is in flight; with
// `wait`, waits for those in flight first (the caller is about to issue a collective,
// which must not overtake the prefetches on any rank).
void issue_deferred_prefetches(bool wait, bool backward) {
  CommContext& it = comm_context();
  if (it.deferred_prefetch.empty()) return;
  if (reduce_scatter_in_flight()) {
    if (!wait) return;
    trace::Span span("wait reduce_scatter before prefetch", "wait");
    drain_reductions(/*keep=*/0, /*finish=*/false);
  }
  std::vector<FSDPModule::State*> ready;
  ready.swap(it.deferred_prefetch);
  for (FSDPModule::State* s : ready) {
    if (!s->post_backward_done) s->begin_unshard(backward);
  }
}

}  // namespace

// Leaves a reduced gradient (this rank's real rows, any dtype) on the sharded parameter:
// in its main gradient, or added to its .grad (a copy: `g` may be a borrowed tensor).
void FSDPModule::State::apply_reduced(ParamInfo& p, at::Tensor g) {
  if (divide_factor > 0) g = g / divide_factor;
  if (dt.main_grad) {
    at::Tensor cur = p.sharded.grad();
    if (!cur.defined() || !cur.is_same(p.grad_set) || cur._version() != p.grad_set_version) {
      p.main_grad.zero_();
    }
    p.main_grad.add_(g);
    // fp32 shards step with the main gradient itself; lower-precision shards get a
    // rounded copy (FP32MasterOptimizer steps fp32 masters with the main gradient).
    p.grad_set = p.sharded.scalar_type() == at::kFloat
                     ? p.main_grad
                     : p.main_grad.to(p.sharded.scalar_type(), false, /*copy=*/true);
    p.sharded.mutable_grad() = p.grad_set;
    p.grad_set_version = p.grad_set._version();
  } else if (!p.sharded.grad().defined()) {
    p.sharded.mutable_grad() = g.to(dt.sharded_grad, /*non_blocking=*/false, /*copy=*/true);
  } else {
    p.sharded.mutable_grad().add_(g);
  }
}

// Leaves one completed reduction's gradients on the shards (or keeps them as partials
// when the dp_replicate all-reduce is skipped this step).
void FSDPModule::State::apply_pending(PendingReduce& pr) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (pr.param >= 0 && pr.param != static_cast<int>(i)) continue;
    auto& p = params[i];
    if (!p.requires_grad) continue;
    if (pr.flags && pr.flags->wait()[i] == 0) continue;  // no rank had a gradient for it
    at::Tensor seg = pr.param >= 0 ? pr.output.tensor()
                                   : pr.output.tensor().narrow(0, layout.offsets[i], p.plan.shard_numel());
    if (hsdp() && !requires_all_reduce) {
      // Keep the partial (not yet all-reduced) shard for the next step that all-reduces.
      if (!p.sharded_acc.defined()) {
        p.sharded_acc = OwnedBuffer::zeros({p.plan.shard_numel()}, dt.sharded_accumulate, device);
      }
      p.sharded_acc.tensor().add_(seg);
      continue;
    }
    apply_reduced(p, seg.narrow(0, 0, p.plan.rows * p.plan.row_numel).view(p.sharded.sizes()));
  }
}

namespace {

void finish_backward(FsdpPass& it) {
  CommContext& cc = comm_context();
  it.callback_queued = false;
  // Prefetches still held back go out now, as on a rank that issued them at a gradient
  // hook: the all-gathers must match. A module they gather whose backward never started
  // (its output got no gradient) is resharded by its post_backward below, or, if it did not
  // run in this forward at all (an explicit prefetch target), right after.
  std::vector<FSDPModule::State*> gathered = cc.deferred_prefetch;
  issue_deferred_prefetches(/*wait=*/true);
  // Groups some of whose gradients never arrived reduce now (zeros for the missing), in
  // reverse forward order: the same order on every rank.
  for (auto r = it.forward_order.rbegin(); r != it.forward_order.rend(); ++r) {
    FSDPModule::State* s = *r;
    if (!s->post_backward_done) s->post_backward();
  }
  for (FSDPModule::State* s : gathered) {
    if (std::find(it.forward_order.begin(), it.forward_order.end(), s) == it.forward_order.end()) s->do_reshard();
  }
  finish_reductions();
}

// Waits for every reduction issued so far (this pass's, and any other pass's whose backward
// ran in the same backward call, or an explicit reduce_grads()) and applies it.
void finish_reductions() {
  CommContext& cc = comm_context();
  issue_deferred_prefetches(/*wait=*/true);
  {
    trace::Span wait("wait reductions", "wait");
    drain_reductions(/*keep=*/0, /*finish=*/true);
  }
  for (FSDPModule::State* s : cc.reduce_order) s->pending.clear();
  cc.reduce_order.clear();
}

}  // namespace

namespace {

// A parameter used while its module is resharded has no storage, and ATen raises "...data
// is not allocated yet". Name the sharded module whose forward ran outside hp::call.
void translate_unallocated(torch::nn::Module& failing, const std::exception& e) {
  if (std::string(e.what()).find("not allocated") == std::string::npos) return;
  std::set<const c10::TensorImpl*> used;
  for (const auto& t : failing.parameters(/*recurse=*/true)) used.insert(t.unsafeGetTensorImpl());
  std::vector<FSDPHandle> live;
  {
    std::lock_guard<std::mutex> g(g_mu);
    for (auto& [mod, w] : g_handles) {
      if (auto h = w.lock()) live.push_back(h);
    }
  }
  for (const auto& h : live) {
    FSDPModule::State& s = detail::FsdpAccess::state(*h);
    if (s.unsharded || s.unshard_pending || in_call(*s.module)) continue;
    for (const auto& p : s.params) {
      if (!used.count(p.param.unsafeGetTensorImpl())) continue;
      throw Error(detail::str_cat(
          "module ", s.label, " is sharded by fully_shard and its forward ran outside hp::call, so its ",
          "parameters (here '", p.name, "', used by ", failing.name(), ") were not gathered; call it as ",
          "hp::call(module, inputs...)"));
    }
  }
}

}  // namespace

// ---- FSDPModule -------------------------------------------------------------------------

FSDPModule::FSDPModule(std::unique_ptr<State> s) : state_(std::move(s)) {}
FSDPModule::~FSDPModule() = default;

std::vector<at::Tensor> FSDPModule::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : state_->params) out.push_back(p.sharded);
  return out;
}

std::vector<ShardedTensor> FSDPModule::state_dict() const {
  std::vector<ShardedTensor> out;
  const State& s = *state_;
  for (const auto& p : s.params) {
    std::vector<int64_t> shape = p.shape.empty() ? std::vector<int64_t>{1} : p.shape;
    const DimSplit rows{s.shard_dim, s.shards(), s.shard->rank()};
    // A tensor-parallel piece: its rows split again, inside the piece's box of the global tensor.
    c10::optional<ShardSpec> piece = parameter_spec(p.param);
    ShardSpec spec = piece ? split_further(*piece, 0, rows) : make_shard_spec(shape, {{rows}});
    out.push_back(ShardedTensor{p.name, p.sharded, p.shape, p.plan.row_offset, std::move(spec)});
  }
  return out;
}

const GroupDtypes& FSDPModule::dtypes() const { return state_->dt; }

std::vector<at::Tensor> FSDPModule::main_grads() const {
  std::vector<at::Tensor> out;
  for (const auto& p : state_->params) out.push_back(p.main_grad);
  return out;
}
torch::nn::Module& FSDPModule::module() const { return *state_->module; }

namespace {
template <typename F>
void for_self_and_nested(FSDPModule::State& s, bool recurse, F f) {
  f(s);
  if (recurse) {
    for (auto* n : s.nested) f(*n);
  }
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.requires_sync = on; });
}
void FSDPModule::set_requires_all_reduce(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.requires_all_reduce = on; });
}
void FSDPModule::set_reshard_after_backward(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.reshard_after_backward = on; });
}
void FSDPModule::set_reshard_after_forward(bool on, bool recurse) {
  for_self_and_nested(*state_, recurse, [&](State& s) { s.reshard_after_forward = on; });
}
void FSDPModule::set_is_last_backward(bool last) {
  for_self_and_nested(*state_, true, [&](State& s) { s.is_last_backward = last; });
}
void FSDPModule::set_gradient_divide_factor(double factor) {
  HP_CHECK(factor >= 0, "gradient divide factor ", factor, " must be positive (0 = average)");
  for_self_and_nested(*state_, true, [&](State& s) { s.divide_factor = factor; });
}
void FSDPModule::set_reduce_op(ReduceOp op) {
  HP_CHECK(op == ReduceOp::AVG || op == ReduceOp::SUM, "fully_shard reduces gradients with avg or sum, not ",
           to_string(op));
  for_self_and_nested(*state_, true, [&](State& s) { s.reduce_op = op; });
}
void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPHandle>& modules) {
  state_->fwd_prefetch.assign(modules.begin(), modules.end());
}
void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPHandle>& modules) {
  state_->bwd_prefetch.assign(modules.begin(), modules.end());
}
void FSDPModule::unshard(bool async) {
  state_->begin_unshard();
  if (!async) state_->finish_unshard();
}
void FSDPModule::wait_for_unshard() { state_->finish_unshard(); }
void FSDPModule::reshard() { state_->do_reshard(); }
bool FSDPModule::is_unsharded() const { return state_->unsharded; }
bool FSDPModule::unshard_in_flight() const { return state_->unshard_pending; }
bool FSDPModule::gradients_in_flight() const { return !state_->pending.empty(); }

void FSDPModule::reduce_grads() {
  State& s = *state_;
  HP_CHECK(s.pass == nullptr || !s.pass->callback_queued, "reduce_grads() on ", s.label,
           " inside a backward of its forward; call it after backward() returns (its gradient hooks reduce ",
           "during backward when gradient sync is on)");
  const bool sync = s.requires_sync;
  s.requires_sync = true;
  s.post_backward_done = false;
  try {
    s.post_backward();
  } catch (...) {
    s.requires_sync = sync;
    throw;
  }
  s.requires_sync = sync;
}

void FSDPModule::finalize_backward() {
  HP_CHECK(state_->pass == nullptr || !state_->pass->callback_queued, "finalize_backward() on ", state_->label,
           " inside a backward of its forward; the end of backward finalizes by itself");
  finish_reductions();
}

// ---- fully_shard ------------------------------------------------------------------------

namespace {

// "ClassName (fully_shard #k)": k counts fully_shard calls, so equal blocks differ in
// errors and traces.
std::string describe(const torch::nn::Module& m) {
  static std::atomic<int> count{0};
  return detail::str_cat(m.name(), " (fully_shard #", ++count, ")");
}

// Every rank must shard the same parameters: compare (count, then per parameter dtype,
// ndim and dims) across `comm` before anything is sharded.
void check_same_shapes(const CommPtr& comm, const std::vector<std::pair<std::string, at::Tensor>>& ps,
                       const std::string& label, c10::Device dev) {
  std::vector<int64_t> sig{static_cast<int64_t>(ps.size())};
  for (const auto& [name, t] : ps) {
    sig.push_back(static_cast<int64_t>(t.scalar_type()));
    sig.push_back(t.dim());
    for (int64_t d : t.sizes()) sig.push_back(d);
  }
  const auto opts = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor len = at::full({1}, static_cast<int64_t>(sig.size()), opts);
  comm->all_reduce(len, {ReduceOp::MAX}).wait();
  const int64_t L = len.item<int64_t>();
  at::Tensor mine = at::full({L}, -1, at::kLong);
  for (size_t i = 0; i < sig.size(); ++i) mine[i] = sig[i];
  mine = mine.to(dev);
  at::Tensor mx = mine.clone(), mn = mine.clone();
  Work a = comm->all_reduce(mx, {ReduceOp::MAX});
  Work b = comm->all_reduce(mn, {ReduceOp::MIN});
  a.wait();
  b.wait();
  if (at::equal(mx, mn)) return;
  // Name the first parameter whose signature differs.
  int64_t pos = 1;
  for (const auto& [name, t] : ps) {
    int64_t end = pos + 2 + t.dim();
    if (!at::equal(mx.narrow(0, pos, end - pos), mn.narrow(0, pos, end - pos))) {
      HP_CHECK(false, "fully_shard(", label, "): parameter '", name, "' is ", t.scalar_type(), t.sizes(),
               " on rank ", comm->rank(), " but differs on other ranks of group '", comm->name(),
               "': every rank must build the same model");
    }
    pos = end;
  }
  HP_CHECK(false, "fully_shard(", label, "): ranks of group '", comm->name(), "' have different ",
           "parameter lists (", ps.size(), " parameters on rank ", comm->rank(), ")");
}

// The communicator of this rank's group of `g` consecutive ranks of `shard`, made once per
// (communicator, size) and shared by every module that asks (a split is collective: every
// rank of `shard` reaches it in the same fully_shard call).
CommPtr post_forward_group(const CommPtr& shard, int g) {
  static std::mutex mu;
  // Weak both ways: the modules using a group keep it alive, and nothing outlives them.
  static std::map<std::pair<const Communicator*, int>, std::pair<std::weak_ptr<Communicator>, std::weak_ptr<Communicator>>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (auto e = cache.begin(); e != cache.end();) {
    e = (e->second.first.expired() || e->second.second.expired()) ? cache.erase(e) : std::next(e);
  }
  auto key = std::make_pair(shard.get(), g);
  auto it = cache.find(key);
  if (it != cache.end() && it->second.first.lock() == shard) {
    if (CommPtr sub = it->second.second.lock()) return sub;
  }
  CommOptions co;
  co.name = detail::str_cat(shard->name(), "/post-forward", g);
  CommPtr sub = shard->split(shard->rank() / g, shard->rank(), co);
  cache[key] = {shard, sub};
  return sub;
}

}  // namespace

FSDPHandle fully_shard(torch::nn::Module& module, const FullyShardOptions& o) {
  const std::string label = describe(module);
  purge_expired_forward_hooks();  // releases the handles of destroyed modules
  static std::once_flag translator_once;
  std::call_once(translator_once, [] { register_error_translator(translate_unallocated); });
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_handles.find(&module);
    // A handle outliving its module (the address reused by a new module) does not count.
    bool applied = false;
    if (it != g_handles.end()) {
      if (auto h = it->second.lock()) applied = !h->state().owner_gone();
    }
    HP_CHECK(!applied, "fully_shard was already applied to module ", label, "; apply it once per module");
  }
  HP_CHECK(o.reshard_after_forward_group_size >= 0, "fully_shard(", label, "): reshard_after_forward_group_size=",
           o.reshard_after_forward_group_size, " must be positive (0: not set)");
  HP_CHECK(o.reshard_after_forward_group_size == 0 || o.reshard_after_forward, "fully_shard(", label,
           "): reshard_after_forward_group_size=", o.reshard_after_forward_group_size,
           " with reshard_after_forward=false: the group size says how to reshard after forward, so it needs true");
  auto st = std::make_unique<FSDPModule::State>();
  st->module = &module;
  try {
    st->owner = module.shared_from_this();
    st->owned = true;
  } catch (const std::bad_weak_ptr&) {
    // Not held by a shared_ptr: no liveness check.
  }
  st->label = label;
  st->opts = o;
  CommPtr world;
  if (!o.mesh) {
    world = hp::world();
    st->shard = world;
  } else {
    const auto& names = o.mesh->names();
    auto has = [&](const char* d) { return std::find(names.begin(), names.end(), d) != names.end(); };
    if (has("dp_shard")) {
      // Named dims: shard over dp_shard, replicate over dp_replicate when there is one; other
      // dims (tp, pp) are not data-parallel, and fully_shard works within each of their groups.
      st->shard_dim = "dp_shard";
      st->shard = o.mesh->group("dp_shard");
      if (has("dp_replicate")) st->replicate = o.mesh->group("dp_replicate");
      world = has("dp_replicate") ? o.mesh->group({"dp_replicate", "dp_shard"}) : st->shard;
    } else {
      HP_CHECK(o.mesh->ndim() == 1 || o.mesh->ndim() == 2, "fully_shard(", label,
               ") takes a mesh with a dp_shard dim (and optionally dp_replicate, tp, ...), or a 1-D mesh (the "
               "shard dim) or a 2-D mesh (replicate, shard); got ", o.mesh->ndim(), " dims without a dp_shard");
      if (o.mesh->ndim() == 1) {
        st->shard = o.mesh->group(names[0]);
      } else {
        st->replicate = o.mesh->group(names[0]);
        st->shard = o.mesh->group(names[1]);
      }
      st->shard_dim = names.back();
      world = o.mesh->group(names);
    }
  }

  // The parameters this call manages: not ignored, not already managed by a nested call,
  // each tensor once (shared parameters appear under several names).
  std::set<const c10::TensorImpl*> ignored;
  for (const auto& t : o.ignored_params) ignored.insert(t.unsafeGetTensorImpl());
  std::vector<std::pair<std::string, at::Tensor>> mine;
  {
    std::lock_guard<std::mutex> g(g_mu);
    std::set<const c10::TensorImpl*> seen;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
      auto managed = g_managed.find(impl);
      bool taken = managed != g_managed.end() && !managed->second.expired();
      if (ignored.count(impl) || taken || !seen.insert(impl).second) continue;
      mine.emplace_back(item.key(), item.value());
    }
  }
  // The signature check runs on the CPU, or on the parameters' device for a backend that
  // moves only device tensors (nccl).
  c10::Device sig_dev = c10::kCPU;
  if (!world->supports_device(sig_dev)) {
    auto all = module.parameters(/*recurse=*/true);
    HP_CHECK(!all.empty(), "fully_shard(", label, "): a module without parameters on a ", world->backend(),
             " communicator");
    sig_dev = all[0].device();
  }
  check_same_shapes(world, mine, label, sig_dev);
  at::ScalarType pdt = mine.empty() ? at::kFloat : mine[0].second.scalar_type();
  for (const auto& [name, t] : mine) {
    HP_CHECK(t.scalar_type() == pdt, "not supported yet: parameters of different dtypes in one fully_shard ",
             "group (", label, ": '", mine[0].first, "' is ", pdt, ", '", name, "' is ", t.scalar_type(),
             "); apply fully_shard to a submodule so each group has one dtype");
    HP_CHECK(t.device() == mine[0].second.device(), "not supported yet: parameters on different devices in one ",
             "fully_shard group (", label, ": '", mine[0].first, "' is on ", mine[0].second.device(), ", '", name,
             "' on ", t.device(), ")");
  }
  if (!mine.empty()) st->device = mine[0].second.device();
  HP_CHECK(st->shard->supports_device(st->device) && (!st->replicate || st->replicate->supports_device(st->device)),
           "fully_shard(", label, "): parameter '", mine.empty() ? std::string() : mine[0].first, "' is on ",
           st->device, ", which the ", st->shard->backend(), " backend of communicator '", st->shard->name(),
           "' does not support");
  st->dt = resolve_dtypes(o.mp_policy, pdt);
  if (o.reshard_after_forward_group_size > 0) {
    const int g = o.reshard_after_forward_group_size, ns = st->shard->size();
    HP_CHECK(ns % g == 0, "fully_shard(", label, "): reshard_after_forward_group_size=", g, " does not divide the ",
             ns, " ranks of group '", st->shard->name(), "'");
    if (g == 1) {
      st->opts.reshard_after_forward = false;  // each rank keeps all of it: no resharding
    } else if (!st->aliased()) {
      st->post_group = post_forward_group(st->shard, g);
    }
  }

  const int n = st->shard->size(), k = st->shard->rank();
  at::NoGradGuard no_grad;
  HP_CHECK(!memory::deferring(), "fully_shard(", label, ") inside a DeferredAllocation scope: end the scope ",
           "(the model is built) before sharding, so the shards get real memory");
  for (const auto& t : o.ignored_params) {
    HP_CHECK(!memory::is_deferred(t.storage().data()), "fully_shard(", label, "): an ignored parameter ",
             t.sizes(), " was built under a DeferredAllocation; ignored parameters are not materialized");
  }
  for (auto& [name, t] : mine) {
    ParamInfo p;
    p.name = name;
    p.param = t;
    p.shape = t.sizes().vec();
    p.plan = plan_shard(p.shape, n, k);
    p.requires_grad = t.requires_grad();
    std::vector<int64_t> shard_shape = p.shape.empty() ? std::vector<int64_t>{1} : p.shape;
    shard_shape[0] = p.plan.rows_per_shard;
    p.padded = at::zeros(shard_shape, at::TensorOptions().dtype(pdt).device(st->device));
    at::Tensor full = t.detach();
    if (memory::is_deferred(t.storage().data())) {
      // Built without storage: this parameter's whole value, made on the scratch block that
      // already holds the model's deferred tensors, then only this rank's rows are kept.
      HP_CHECK(o.param_init, "fully_shard(", label, "): parameter '", name, "' was built under a ",
               "DeferredAllocation (no storage); give FullyShardOptions::param_init to initialize it");
      {
        memory::DeferredAllocation on_scratch;
        full = at::empty(p.shape, at::TensorOptions().dtype(pdt));
      }
      o.param_init(t, full);
      HP_CHECK(full.sizes() == t.sizes() && full.scalar_type() == pdt, "fully_shard(", label,
               "): param_init changed the shape or dtype of '", name, "'");
    }
    if (p.plan.rows > 0) {
      at::Tensor src = full.reshape({p.plan.dim0, p.plan.row_numel});
      p.padded.view({p.plan.rows_per_shard, p.plan.row_numel})
          .narrow(0, 0, p.plan.rows)
          .copy_(src.narrow(0, p.plan.row_offset, p.plan.rows));
    }
    p.sharded = p.padded.narrow(0, 0, p.plan.rows).detach();
    p.sharded.set_requires_grad(p.requires_grad);
    if (st->dt.main_grad) p.main_grad = at::zeros(p.sharded.sizes(), at::TensorOptions().dtype(at::kFloat).device(st->device));
    // The module's tensor becomes the unsharded parameter: compute dtype, global shape,
    // no storage until unshard. Its identity (module fields, autograd meta) is kept.
    // With one shard in the parameters' dtype it simply aliases the shard.
    if (st->aliased()) {
      t.set_data(p.padded.view(p.shape));
    } else {
      // Made with no storage at all (not allocated whole, then freed: a rank never holds
      // the whole parameter here).
      at::Tensor unsharded = at::empty({0}, at::TensorOptions().dtype(st->dt.compute).device(st->device));
      unsharded.storage().set_data_ptr(c10::DataPtr(nullptr, unsharded.device()));  // as a resharded one
      unsharded.unsafeGetTensorImpl()->set_sizes_contiguous(p.shape);
      t.set_data(unsharded);
    }
    if (t.grad().defined()) t.mutable_grad() = at::Tensor();
    st->params.push_back(std::move(p));
  }
  if (st->post_group) {
    for (const auto& p : st->params) {
      st->post_offsets.push_back(st->post_total);
      st->post_total += p.plan.padded_numel() / st->post_group->size();
    }
  }
  std::vector<ShardPlan> plans;
  for (const auto& p : st->params) plans.push_back(p.plan);
  st->layout = plan_fused(plans, std::max<int64_t>(1, kFusedAlignBytes / static_cast<int64_t>(c10::elementSize(st->dt.reduce))));
  // The all-gather buffer uses the same layout in its own dtype; offsets are in elements.

  auto handle = std::shared_ptr<FSDPModule>(new FSDPModule(std::move(st)));
  FSDPModule::State* s = &handle->state();
  for (size_t i = 0; i < s->params.size(); ++i) {
    auto& p = s->params[i];
    if (!p.requires_grad) continue;
    // Held here so the same accumulator (and its hook) serves every backward.
    p.accumulator = torch::autograd::impl::grad_accumulator(p.param);
    p.accumulator->add_post_hook(std::make_unique<GradReadyHook>(s, i));
  }
  {
    std::lock_guard<std::mutex> g(g_mu);
    for (const auto& p : s->params) g_managed[p.param.unsafeGetTensorImpl()] = handle;
    for (const auto& sub : module.modules(/*include_self=*/false)) {
      auto it = g_handles.find(sub.get());
      if (it != g_handles.end()) {
        if (auto h = it->second.lock()) s->nested.push_back(&h->state());
      }
    }
    g_handles[&module] = handle;
  }
  ForwardHooks hooks;
  hooks.pre = [handle](torch::nn::Module&) { handle->state().pre_forward(); };
  if (s->dt.input) {
    at::ScalarType in_dt = *s->dt.input;
    hooks.cast_input = [in_dt](torch::nn::Module&, const at::Tensor& x, size_t) {
      return x.is_floating_point() && x.scalar_type() != in_dt ? x.to(in_dt) : x;
    };
  }
  hooks.cast_output = [handle](torch::nn::Module&, const at::Tensor& out) {
    return handle->state().on_output(out, handle);
  };
  hooks.post = [handle](torch::nn::Module&) { handle->state().post_forward(); };
  hooks.on_error = [handle](torch::nn::Module&, const std::exception&) {
    FSDPModule::State& s = handle->state();
    if (in_recompute()) return;
    if (s.pass != nullptr && s.pass == t_forward && --s.pass->forward_depth == 0) t_forward = nullptr;
  };
  register_forward_hooks(module, std::move(hooks));
  return handle;
}

void materialize_deferred_buffers(torch::nn::Module& module) {
  HP_CHECK(!memory::deferring(), "materialize_deferred_buffers inside a DeferredAllocation scope");
  at::NoGradGuard no_grad;
  for (auto& b : module.buffers(/*recurse=*/true)) {
    if (b.defined() && memory::is_deferred(b.storage().data())) b.set_data(at::zeros(b.sizes(), b.options()));
  }
}

FSDPHandle fsdp_handle(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_handles.find(&module);
  if (it == g_handles.end()) return nullptr;
  // A handle outliving its module (the address reused by a new module) is not this one's.
  auto h = it->second.lock();
  return h && !detail::FsdpAccess::state(*h).owner_gone() ? h : nullptr;
}

}  // namespace hp
