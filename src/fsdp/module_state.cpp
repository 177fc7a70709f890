// A module's side of fully_shard: the hooks (forward, output, gradients, end of backward)
// and the training-state machine they drive, with each root's pass (forward order,
// end-of-backward callback) and the prefetch targets.
//
// Per module (one parameter group):
//   forward   pre hook: all-gather (unless already unsharded or prefetched); explicit
//             forward prefetch of the listed modules. With wait_per_submodule, each
//             parameter is waited for by the pre hook of the submodule owning it, the rest
//             at the post hook. post hook: reshard if configured,
//             put off until the next module's forward starts; the last module to finish
//             (and the root over children) keep their parameters for the backward when
//             one follows. A hook on the output tensor runs pre_backward.
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
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>

#include "comm_context.h"
#include "group.h"
#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/hooks/recompute.h"

namespace hp {

using detail::FsdpPass;
using detail::TrainingState;

namespace detail {
const char* to_string(TrainingState s) {
  switch (s) {
    case TrainingState::kIdle: return "idle";
    case TrainingState::kForward: return "forward";
    case TrainingState::kPreBackward: return "pre-backward";
    case TrainingState::kPostBackward: return "post-backward";
  }
  return "?";
}
}  // namespace detail

namespace {

// The pass whose forward is running on this thread (CPU autograd and the call boundary
// run hooks on the caller's thread); null outside any sharded module's forward.
thread_local FsdpPass* t_forward = nullptr;
std::atomic<uint64_t> g_pass_ids{0};

void finish_backward(FsdpPass& pass);

// A new forward of `root`'s (not inside a backward): what its last forward kept for a
// backward that never came (the forward raised, or no backward followed with grad mode
// on) reshards, since an optimizer step or a load may have changed the shards since.
void release_kept(detail::GroupState& root) {
  detail::FsdpPass& it = root.own_pass;
  if (it.kept != nullptr && it.kept->training != TrainingState::kForward) it.kept->do_reshard();
  it.kept = nullptr;
  if (root.kept_for_backward) root.do_reshard();
  for (detail::GroupState* n : root.nested) {
    if (n->kept_for_backward) n->do_reshard();
  }
}

// Queues `pass`'s end-of-backward callback on the backward now running (once per pass;
// two passes whose losses were summed into one backward each get theirs).
void ensure_backward_callback(FsdpPass* pass) {
  if (pass == nullptr || pass->callback_queued) return;
  pass->callback_queued = true;
  torch::autograd::Engine::get_default_engine().queue_callback([pass] { finish_backward(*pass); });
}

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(detail::GroupState* s, size_t i) : s_(s), i_(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    s_->on_grad(i_);
    return outputs;
  }

 private:
  detail::GroupState* s_;
  size_t i_;
};

}  // namespace

// A forward may start in any state (a new pass, or again within one); the backward of an
// output, and the reduction of the gradients, may not start while the module's forward is
// running.
void FSDPModule::State::check_enter(TrainingState to) const {
  bool legal = true;
  switch (to) {
    case TrainingState::kForward: break;
    case TrainingState::kIdle: legal = training == TrainingState::kForward; break;
    case TrainingState::kPreBackward:
      legal = training == TrainingState::kIdle || training == TrainingState::kPreBackward;
      break;
    case TrainingState::kPostBackward: legal = training != TrainingState::kForward; break;
  }
  if (legal) return;
  const char* hint = training == TrainingState::kForward
                         ? ": its forward is still running (reduce_grads() or backward() called from inside it?)"
                         : "";
  HP_CHECK(false, "fully_shard(", label, "): cannot go from training state ", detail::to_string(training), " to ",
           detail::to_string(to), hint);
}

void FSDPModule::State::enter(TrainingState to) {
  check_enter(to);
  training = to;
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
    detail::issue_deferred_prefetches(/*wait=*/true, /*backward=*/it.callback_queued);
    if (!it.callback_queued) {
      it.id = ++g_pass_ids;
      release_kept(*this);
      // Left by a backward that raised before its end (their modules may be gone since).
      detail::comm_context().backward_prefetched.clear();
    }
    it.forward_order.clear();
    it.forward_end_order.clear();
    it.forward_depth = 0;
    t_forward = &it;
  }
  pass = t_forward;
  FsdpPass& it = *pass;
  // A forward starts after the kept module's ended: that one reshards now, before this one
  // gathers, as it would have at the end of its own forward.
  if (it.kept != nullptr && it.kept != this) it.kept->reshard_after_forward_now();
  it.kept = nullptr;
  ++it.forward_depth;
  it.forward_order.push_back(this);
  enter(TrainingState::kForward);
  grads_pending = 0;
  for (auto& p : params) {
    p.grad_ready = false;
    if (p.requires_grad) ++grads_pending;
  }
  begin_unshard();
  if (lazy_gather && at::GradMode::is_enabled()) {
    // wait_per_submodule: only what no single submodule owns is waited for now; the rest
    // when its submodule is called (finish_submodule), or at the end of this forward.
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].submodule < 0) finish_param(i);
    }
  } else {
    finish_unshard();
  }
  if (!overlap()) return;
  for (auto& w : fwd_prefetch) {
    if (auto h = w.lock()) h->state().begin_unshard();
  }
}

void FSDPModule::State::post_forward() {
  if (in_recompute()) return;  // keep the parameters for the backward that follows
  if (lazy_gather && gathering()) {
    // wait_per_submodule: the parameters no submodule call asked for (or read without one).
    const std::string read = read_before_gather();
    finish_unshard();
    check_not_read_early(read);
  }
  FsdpPass& it = *pass;
  const bool root = --it.forward_depth == 0;
  if (root) t_forward = nullptr;
  it.forward_end_order.push_back(this);
  enter(TrainingState::kIdle);
  // Without grad mode no backward follows: nothing is kept for one.
  const bool backward_follows = at::GradMode::is_enabled();
  if (root && it.kept != nullptr) {
    // The last module to finish forward is the first the backward reaches after the root's
    // own part (the head, typically): it keeps its parameters for it rather than gathering
    // them again at once, exposed.
    if (backward_follows) {
      it.kept->kept_for_backward = true;
    } else {
      it.kept->reshard_after_forward_now();
    }
    it.kept = nullptr;
  }
  if (!opts.reshard_after_forward || !reshard_after_forward) return;
  if (!root) {
    // Put off until the next forward starts (pre_forward) or the root's ends (above).
    if (it.kept != nullptr && it.kept != this) it.kept->reshard_after_forward_now();
    it.kept = this;
    return;
  }
  // The root of a forward that a backward follows, over fully_shard children, keeps its
  // parameters (the embedding and the head, typically): its backward starts first and would
  // gather them again at once (FSDP2 does the same). A root alone is the whole model and
  // reshards as asked.
  if (!nested.empty() && backward_follows) {
    kept_for_backward = true;
    return;
  }
  reshard_after_forward_now();
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
      if (later->training == TrainingState::kPostBackward) continue;
      if (std::find(later->nested.begin(), later->nested.end(), this) != later->nested.end()) continue;
      const size_t first_end = static_cast<size_t>(std::find(ends.begin(), ends.end(), later) - ends.begin());
      if (first_end <= end_index) continue;
      later->post_backward();
    }
  }
  if (training == TrainingState::kPreBackward || training == TrainingState::kPostBackward) return;
  enter(TrainingState::kPreBackward);
  kept_for_backward = false;  // the backward it was kept for is here
  if (trace::enabled()) backward_start_us = trace::now_us();
  begin_unshard(/*backward=*/true);
  finish_unshard();
  if (!overlap()) return;
  // Prefetch: the listed modules, else the module that ran just before this one. Its
  // output and a reduce-scatter's input (a block of gradients each) are never allocated
  // together: behind reduce-scatters on its own communicator the all-gather is queued now
  // and allocates as it starts; otherwise it is held back while a reduce-scatter is in
  // flight, and issued at the first gradient hook that finds them done (see on_grad), or
  // else before the next collective (comm_context.h).
  std::vector<State*> targets;
  for (auto& w : bwd_prefetch) {
    if (auto h = w.lock()) targets.push_back(&h->state());
  }
  if (targets.empty()) {
    // The module that started just before this one's last run.
    auto& order = pass->forward_order;
    for (size_t i = order.size(); i-- > 1;) {
      if (order[i] != this) continue;
      if (order[i - 1]->training != TrainingState::kPostBackward && order[i - 1] != this) targets.push_back(order[i - 1]);
      break;
    }
  }
  auto& deferred = detail::comm_context().deferred_prefetch;
  auto& prefetched = detail::comm_context().backward_prefetched;
  for (State* t : targets) {
    if (t->unsharded() || t->gathering()) continue;
    if (std::find(deferred.begin(), deferred.end(), t) == deferred.end()) deferred.push_back(t);
    if (std::find(prefetched.begin(), prefetched.end(), t) == prefetched.end()) prefetched.push_back(t);
  }
  detail::issue_deferred_prefetches(/*wait=*/false);
}

void FSDPModule::State::on_grad(size_t i) {
  ensure_backward_callback(pass);
  // Between modules' backward, the gradient hooks are where the training thread can see
  // reductions complete: their outputs are applied and freed, and held-back prefetches go.
  detail::drain_reductions(/*keep=*/SIZE_MAX, /*finish=*/false);
  detail::issue_deferred_prefetches(/*wait=*/false);
  if (params[i].grad_ready) return;
  params[i].grad_ready = true;
  // Autograd accumulates a parameter's gradient only after every node that used it has
  // run its backward, so nothing reads the unsharded values any more: free them now
  // rather than with the rest of the module, when the module reshards after this backward.
  if (unsharded() && !aliased() && reshard_after_backward && is_last_backward) params[i].param.free();
  if (--grads_pending == 0) post_backward();
}

void FSDPModule::State::post_backward(bool again) {
  if (training == TrainingState::kPostBackward && !again) return;
  check_enter(TrainingState::kPostBackward);
  // Held-back prefetches go before this module's reduce-scatter, on every rank.
  detail::issue_deferred_prefetches(/*wait=*/true);
  const bool started = training == TrainingState::kPreBackward;
  enter(TrainingState::kPostBackward);
  if (trace::enabled() && started) {
    int64_t now = trace::now_us();
    trace::record(trace::Event{"backward " + label, "compute", backward_start_us, now - backward_start_us,
                               trace::current_tid(), false, 0, ""});
  }
  reduce_and_reshard();
}

void FSDPModule::State::on_forward_error() {
  if (in_recompute()) return;
  // wait_per_submodule: the gathers the failed forward did not wait for are waited for
  // now, so that no later forward skips the check of a parameter already waited for.
  if (lazy_gather) finish_unshard();
  if (pass != nullptr && pass == t_forward && --pass->forward_depth == 0) t_forward = nullptr;
  if (training == TrainingState::kForward) enter(TrainingState::kIdle);
}

void FSDPModule::State::watch_gradients() {
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if (!p.requires_grad) continue;
    // Held here so the same accumulator (and its hook) serves every backward.
    p.accumulator = torch::autograd::impl::grad_accumulator(p.param.tensor());
    p.accumulator->add_post_hook(std::make_unique<GradReadyHook>(this, i));
  }
}

namespace {

void finish_backward(FsdpPass& it) {
  detail::CommContext& cc = detail::comm_context();
  it.callback_queued = false;
  // Prefetches still held back go out now, as on a rank that issued them at a gradient
  // hook: the all-gathers must match. A module a prefetch gathered whose backward never
  // started (its output got no gradient) is resharded by its post_backward below, or, if it
  // did not run in this forward at all (an explicit prefetch target), right after.
  std::vector<detail::GroupState*> gathered;
  gathered.swap(cc.backward_prefetched);
  detail::issue_deferred_prefetches(/*wait=*/true);
  // Groups some of whose gradients never arrived reduce now (zeros for the missing), in
  // reverse forward order: the same order on every rank.
  for (auto r = it.forward_order.rbegin(); r != it.forward_order.rend(); ++r) {
    detail::GroupState* s = *r;
    if (s->training != TrainingState::kPostBackward) s->post_backward();
  }
  for (detail::GroupState* s : gathered) {
    // Not in this forward, and no backward of another pass reached it (that one reduced
    // and resharded it as configured).
    if (s->training == TrainingState::kIdle &&
        std::find(it.forward_order.begin(), it.forward_order.end(), s) == it.forward_order.end()) {
      s->do_reshard();
    }
  }
  detail::finish_reductions();
}

}  // namespace

}  // namespace hp
