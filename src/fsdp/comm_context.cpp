// The order of fully_shard's collectives across groups and roots (comm_context.h), and
// the overlap setting.
#include "comm_context.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "hp/core/env.h"
#include "hp/core/trace.h"
#include "hp/runtime.h"

namespace hp {

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
bool fsdp_overlap_for(bool copies_without_cpu) {
  const int v = overlap_setting();
  if (v != 2) return v == 1;
  // The collectives overlap compute for free where a device moves the bytes (nccl), or
  // where the communication thread has a core of its own; otherwise its copies take the
  // core compute needs, and waiting where each collective is issued is faster. (Not a
  // simulated network: its link is modelled, but the real copies still take the core.)
  return fsdp_overlap_auto(copies_without_cpu, usable_cores(), local_world_size(), at::get_num_threads());
}
}  // namespace detail

bool fsdp_overlap_auto(bool copies_without_cpu, int cores, int ranks_per_node, int threads_per_rank) {
  return copies_without_cpu || spare_core_per_rank(cores, ranks_per_node, threads_per_rank);
}

void set_fsdp_overlap(bool on) { g_overlap.store(on ? 1 : 0); }
void reset_fsdp_overlap() { g_overlap.store(-1); }
bool fsdp_overlap() { return detail::fsdp_overlap_for(false); }

namespace detail {

CommContext& comm_context() {
  static CommContext c;
  return c;
}

void drain_reductions(size_t keep, bool finish) {
  auto& order = comm_context().reduce_order;
  size_t in_flight = 0;
  for (detail::GroupState* s : order) {
    for (auto& pr : s->pending) in_flight += pr.rs_done ? 0 : 1;
  }
  bool blocked = false;
  for (detail::GroupState* s : order) {
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
  for (detail::GroupState* s : order) {
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

namespace {

bool reduce_scatter_in_flight() {
  for (detail::GroupState* s : comm_context().reduce_order) {
    for (auto& pr : s->pending) {
      if (!pr.rs_done && !pr.rs.is_completed()) return true;
    }
  }
  return false;
}

// Whether `t`'s gather can be queued behind the reduce-scatters not yet waited for: every
// one of them is on t's own communicator, which runs its ops in order on its thread (not a
// device's stream), and t gathers from its real shards (not a post-forward share, over
// another group).
bool can_follow_reductions(const detail::GroupState& t) {
  if (t.storage != ShardState::kSharded || t.post_group || !t.device.is_cpu() || t.shard->copies_without_cpu()) {
    return false;
  }
  for (detail::GroupState* s : comm_context().reduce_order) {
    for (auto& pr : s->pending) {
      if (!pr.rs_done && s->shard.get() != t.shard.get()) return false;
    }
  }
  return true;
}

}  // namespace

void issue_deferred_prefetches(bool wait, bool backward) {
  CommContext& it = comm_context();
  if (it.deferred_prefetch.empty()) return;
  if (reduce_scatter_in_flight()) {
    if (!wait) {
      // Those that can go behind the reduce-scatters go now, in order: their ops allocate
      // as they start, after the reduce-scatters have freed their inputs. The first that
      // cannot, and all after it, stay held back.
      auto& held = it.deferred_prefetch;
      size_t k = 0;
      while (k < held.size() && can_follow_reductions(*held[k])) ++k;
      std::vector<detail::GroupState*> now(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(k));
      held.erase(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(k));
      for (detail::GroupState* s : now) {
        if (s->training != TrainingState::kPostBackward) s->begin_unshard(backward, /*behind_reductions=*/true);
      }
      return;
    }
    trace::Span span("wait reduce_scatter before prefetch", "wait");
    drain_reductions(/*keep=*/0, /*finish=*/false);
  }
  std::vector<detail::GroupState*> ready;
  ready.swap(it.deferred_prefetch);
  for (detail::GroupState* s : ready) {
    if (s->training != TrainingState::kPostBackward) s->begin_unshard(backward);
  }
}

void forget_group(GroupState& s) noexcept {
  auto settle = [](Work& w) {
    try {
      w.wait();
    } catch (...) {  // reported where it was raised, or by the ranks still running
    }
  };
  for (Work& w : s.ag_works) settle(w);
  s.ag_works.clear();
  for (PendingReduce& pr : s.pending) {
    settle(pr.rs);
    settle(pr.ar);
  }
  CommContext& cc = comm_context();
  for (auto* list : {&cc.reduce_order, &cc.deferred_prefetch, &cc.backward_prefetched}) {
    list->erase(std::remove(list->begin(), list->end(), &s), list->end());
  }
}

void finish_reductions() {
  CommContext& cc = comm_context();
  issue_deferred_prefetches(/*wait=*/true);
  {
    trace::Span wait("wait reductions", "wait");
    drain_reductions(/*keep=*/0, /*finish=*/true);
  }
  for (detail::GroupState* s : cc.reduce_order) s->pending.clear();
  cc.reduce_order.clear();
}

}  // namespace detail
}  // namespace hp
