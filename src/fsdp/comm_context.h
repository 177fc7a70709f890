// Private: the order of fully_shard's collectives across groups and roots.
//
// Roots may share communicators, and the collectives of all of them must reach each
// communicator in one order on every rank, so the reductions in flight and the prefetches
// held back are kept here, once per process, not per root (each root's forward order and
// end-of-backward callback are its pass's: group.h).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "group.h"

namespace hp::detail {

struct CommContext {
  std::vector<detail::GroupState*> reduce_order;  // states in reduce-scatter issue order
  // Backward prefetches held back while a reduce-scatter is in flight, in the order they
  // were asked for, so that a block's gathered parameters and a block's reduce-scatter
  // input never exist together. A prefetch whose gather can queue on the reduce-scatters'
  // own communicator (on the CPU, which runs its ops in order on one thread) is issued at
  // once instead, its ops allocating their outputs as they start, after the reduce-scatters
  // ahead of them freed their inputs (begin_unshard's `behind_reductions`). The others wait
  // here: everything of fully_shard's that issues a collective (begin_unshard,
  // post_backward, the end of backward, the next forward) issues them first, waiting for
  // the reduce-scatters; a gradient hook, or the end of pre_backward, may issue them
  // earlier, once the reduce-scatters are done. Either way they reach the communicator
  // between the same two of fully_shard's collectives on every rank. A module in
  // post-backward is skipped (it enters that state only after post_backward's own flush,
  // so every rank sees the same states at any flush).
  std::vector<detail::GroupState*> deferred_prefetch;
  // Every module a backward prefetch asked for since the last end of backward, however its
  // gather went (held back, queued behind reductions, or at once: which one differs between
  // ranks): one that did not run in the pass's forward is resharded at the end of backward
  // on every rank.
  std::vector<detail::GroupState*> backward_prefetched;
};
CommContext& comm_context();

// Moves every group's reductions forward, in reduce-scatter issue order (the same on
// every rank): a completed reduce-scatter (whose input the op itself has dropped) gets
// its dp_replicate all-reduce issued; a completed reduction leaves its gradients on the
// shards and frees its output. Waits for the oldest reduce-scatters until at most `keep`
// are in flight: when communication falls behind backward, their inputs (one module's
// gradients each) would otherwise pile up. `finish` (at the end of backward) also waits
// for every all-reduce and applies everything.
void drain_reductions(size_t keep, bool finish);
// Issues the held-back backward prefetches: those that can queue behind the reduce-scatters
// in flight at once, the rest once no reduce-scatter is in flight; with `wait`, waits for
// those in flight first (the caller is about to issue a collective, which must not overtake
// the prefetches on any rank).
void issue_deferred_prefetches(bool wait, bool backward = true);
// Before a group goes (its module destroyed, perhaps after an error left a gather or a
// reduction in flight): waits for its collectives, their errors ignored (whatever left them
// in flight has raised already), so that none writes into its storage or calls back into it
// afterwards (a gather's output may be allocated only when its op starts, through the
// group), and removes it from the process-wide order.
void forget_group(GroupState& s) noexcept;
// Waits for every reduction issued so far (of any pass, or an explicit reduce_grads()) and
// applies it.
void finish_reductions();

}  // namespace hp::detail
