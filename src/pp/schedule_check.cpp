// Pipeline schedules checked and lowered: simulate() (the lists replayed with costs),
// lower() (the transfers inserted between stages on different ranks, with their tags) and
// validate() (every dependency and transfer accounted for).
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"
#include "timeline.h"

namespace hp::pp {

using internal::is_backward;
using internal::Key;
using internal::Timeline;

namespace {

// Replays the lists with the given costs (Timeline's rule); raises when stuck.
SimResult replay(const Schedule& s, const Costs& all) {
  HP_CHECK(all.per_stage.empty() || static_cast<int>(all.per_stage.size()) == s.stages, "simulate: ",
           all.per_stage.size(), " per-stage costs for a schedule of ", s.stages, " stages");
  const int R = static_cast<int>(s.actions.size());
  Timeline timeline(s.stages);
  SimResult out;
  out.busy.assign(R, 0);
  out.peak_in_flight.assign(R, 0);
  std::vector<double> free_at(R, 0);
  std::vector<size_t> next(R, 0);
  std::vector<int> in_flight(R, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      while (next[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][next[r]];
        const Costs& c = all.per_stage.empty() || a.stage < 0 ? all : all.per_stage[static_cast<size_t>(a.stage)];
        double start = free_at[r];
        if (!timeline.ready(a, &start)) break;
        // A forward paired with the backward right after it, with a cost for the pair (a
        // device overlapping the two): one unit, once both are ready. Without one (hp's
        // runtime runs the two in turn), or with transfers between them (lowered), the two
        // replay as they come.
        if (a.paired && c.forward_backward > 0 && next[r] + 1 < s.actions[r].size() &&
            s.actions[r][next[r] + 1].is_compute()) {
          const Action& b = s.actions[r][next[r] + 1];
          if (!timeline.ready(b, &start)) break;
          const double cost = c.forward_backward;
          timeline.finish(a, start + cost);
          timeline.finish(b, start + cost);
          free_at[r] = start + cost;
          out.busy[r] += cost;
          out.peak_in_flight[r] = std::max(out.peak_in_flight[r], ++in_flight[r]);
          if (b.kind == ActionKind::kBackward) --in_flight[r];
          next[r] += 2;
          progress = true;
          continue;
        }
        double cost = 0;
        switch (a.kind) {
          case ActionKind::kForward: cost = c.forward; break;
          case ActionKind::kBackward: cost = c.backward; break;
          case ActionKind::kBackwardInput: cost = c.backward_input; break;
          case ActionKind::kBackwardWeight: cost = c.backward_weight; break;
          default: break;
        }
        const double end = start + cost;
        if (a.is_compute()) timeline.finish(a, end);
        free_at[r] = end;
        out.busy[r] += cost;
        if (a.kind == ActionKind::kForward) ++in_flight[r];
        if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --in_flight[r];
        out.peak_in_flight[r] = std::max(out.peak_in_flight[r], in_flight[r]);
        ++next[r];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < R; ++r) {
    if (next[r] < s.actions[r].size()) {
      stuck += detail::str_cat(stuck.empty() ? "" : ", ", "rank ", r, " at ", s.actions[r][next[r]].to_string(),
                               " (action ", next[r], ")");
    }
  }
  HP_CHECK(stuck.empty(), "pipeline schedule cannot complete: every rank waits on another: ", stuck);
  for (double t : free_at) out.makespan = std::max(out.makespan, t);
  for (int r = 0; r < R; ++r) out.bubble.push_back(out.makespan > 0 ? 1.0 - out.busy[r] / out.makespan : 0.0);
  return out;
}

}  // namespace

namespace {

bool is_send(ActionKind k) { return k == ActionKind::kSendForward || k == ActionKind::kSendBackward; }

int peer_stage(const Action& a) { return a.peer_stage(); }

// The other end of a transfer.
Action counterpart(const Action& a) {
  const ActionKind k = a.kind == ActionKind::kSendForward    ? ActionKind::kRecvForward
                       : a.kind == ActionKind::kRecvForward  ? ActionKind::kSendForward
                       : a.kind == ActionKind::kSendBackward ? ActionKind::kRecvBackward
                                                             : ActionKind::kSendBackward;
  return Action{peer_stage(a), k, a.microbatch};
}

// Replays the transfers as the runtime moves them: each ordered pair of ranks has its own
// link (a communicator), on which the sender's sends and the receiver's receives are each
// handled one at a time in the order they were posted, every send waiting until its receive
// is posted (the strictest transport). Posting never blocks a rank; a compute action waits
// until the transfer it reads has completed. A transfer completes when it heads both its
// link's send queue and its receive queue. So the receives on a link must be posted in the
// order the sender sends, and early enough. A stage's first receive of an activation also
// blocks its rank until the transfer went through (the runtime waits there for the shape
// header). With `fix`, a link whose head send has no
// matching head receive gets that receive moved up in the receiver's list (to the receiver's
// current position, or before the first receive already posted on the link that has not
// completed): a receive may always be posted earlier. Without, the wait is an error.
void replay_transfers(Schedule& s, bool fix) {
  const int R = s.ranks;
  auto key_of = [](const Action& a) {  // a transfer, by its sending end
    const Action send = is_send(a.kind) ? a : counterpart(a);
    return Key{send.stage, static_cast<int>(send.kind), send.microbatch};
  };
  auto reads = [](const Action& a) -> std::optional<Action> {  // the receive a compute action reads
    if (a.kind == ActionKind::kForward) return Action{a.stage, ActionKind::kRecvForward, a.microbatch};
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
      return Action{a.stage, ActionKind::kRecvBackward, a.microbatch};
    }
    return std::nullopt;
  };
  for (;;) {
    std::vector<size_t> at(R, 0);
    std::set<Key> done;
    std::set<std::string> posted;  // comm actions posted (their text is unique)
    // Per link (sender, receiver): what was posted, in order, not yet completed.
    std::map<std::pair<int, int>, std::vector<Action>> sends, recvs;
    std::set<Key> received_somewhere;  // transfers whose receive is in some list
    std::set<int> headed;              // stages whose first receive (with the header) completed
    for (const auto& list : s.actions) {
      for (const auto& a : list) {
        if (a.is_comm() && !is_send(a.kind)) received_somewhere.insert(key_of(a));
      }
    }
    bool all_done = false;
    for (bool progress = true; progress;) {
      progress = false;
      all_done = true;
      for (int r = 0; r < R; ++r) {
        while (at[r] < s.actions[r].size()) {
          const Action& a = s.actions[r][at[r]];
          if (a.is_comm()) {
            const int q = s.rank_of(peer_stage(a));
            if (posted.insert(a.to_string()).second) (is_send(a.kind) ? sends[{r, q}] : recvs[{q, r}]).push_back(a);
            // A stage's first activation received comes after a header the receiver waits
            // for (it sizes the buffer): that receive blocks until the transfer went through.
            if (a.kind == ActionKind::kRecvForward && !headed.count(a.stage)) {
              if (!done.count(key_of(a))) break;
              headed.insert(a.stage);
            }
          } else if (a.is_compute()) {
            // A remote input must have arrived (a local one, or none, needs nothing).
            // (The first stage's forward and the last stage's backward read no stage: their
            // peer is outside [0, stages), and has no rank.) A paired forward with its
            // backward right after it starts once both inputs are there (the runtime runs
            // the two as one unit, taking turns).
            auto waits = [&](const Action& c) {
              auto in = reads(c);
              if (!in) return false;
              const int ps = peer_stage(*in);
              const bool remote = ps >= 0 && ps < s.stages && s.rank_of(ps) != r;
              return remote && received_somewhere.count(key_of(*in)) && !done.count(key_of(*in));
            };
            if (waits(a)) break;
            const auto& list = s.actions[r];
            if (a.paired && at[r] + 1 < list.size() && list[at[r] + 1].is_compute() && waits(list[at[r] + 1])) break;
          }
          ++at[r];
          progress = true;
        }
        all_done = all_done && at[r] == s.actions[r].size();
      }
      for (auto& [link, q] : sends) {
        auto& rq = recvs[link];
        while (!q.empty() && !rq.empty() && key_of(q.front()) == key_of(rq.front())) {
          done.insert(key_of(q.front()));
          q.erase(q.begin());
          rq.erase(rq.begin());
          progress = true;
        }
      }
    }
    bool links_empty = true;
    for (auto& [link, q] : sends) links_empty = links_empty && q.empty() && recvs[link].empty();
    if (all_done && links_empty) return;
    bool moved = false;
    if (fix) {
      for (auto& [link, q] : sends) {
        if (q.empty()) continue;
        const Action want = counterpart(q.front());
        auto& rq = recvs[link];
        if (!rq.empty() && key_of(rq.front()) == key_of(want)) continue;
        auto& list = s.actions[static_cast<size_t>(link.second)];
        auto it = std::find(list.begin(), list.end(), want);
        if (it == list.end()) continue;
        // Before the first receive posted on this link that has not completed, else at the
        // receiver's current position.
        size_t to = at[static_cast<size_t>(link.second)];
        if (!rq.empty()) to = static_cast<size_t>(std::find(list.begin(), list.end(), rq.front()) - list.begin());
        const size_t from = static_cast<size_t>(it - list.begin());
        if (from <= to) continue;  // already posted in place: not this link's problem
        list.erase(it);
        list.insert(list.begin() + static_cast<std::ptrdiff_t>(to), want);
        moved = true;
        break;
      }
    }
    if (moved) continue;  // replay again from the start with the new order
    std::string stuck;
    for (int r = 0; r < R; ++r) {
      if (at[r] == s.actions[r].size()) continue;
      stuck += detail::str_cat(stuck.empty() ? "" : ", ", "rank ", r, " at ", s.actions[r][at[r]].to_string(),
                               " (action ", at[r], ")");
    }
    for (auto& [link, q] : sends) {
      if (q.empty()) continue;
      auto& rq = recvs[link];
      stuck += detail::str_cat(stuck.empty() ? "" : ", ", "link ", link.first, "->", link.second, " sends ",
                               q.front().to_string(), " first but rank ", link.second,
                               rq.empty() ? std::string(" has not posted its receive")
                                          : " posted " + rq.front().to_string() + " first");
    }
    HP_CHECK(false, "pipeline schedule: its transfers cannot complete (a link's receives are posted out of the ",
             "order its sends go, or too late): ", stuck);
  }
}

void validate_transfers(const Schedule& s) {
  bool lowered = false;
  for (const auto& list : s.actions) {
    for (const auto& a : list) lowered = lowered || a.is_comm();
  }
  if (!lowered) return;
  std::map<Key, int> count;
  for (int r = 0; r < s.ranks; ++r) {
    std::map<Key, size_t> pos;  // of every action on this rank
    const auto& list = s.actions[r];
    for (size_t i = 0; i < list.size(); ++i) pos[Key{list[i].stage, static_cast<int>(list[i].kind), list[i].microbatch}] = i;
    auto find = [&](int stage, ActionKind k, int mb) -> long {
      auto it = pos.find(Key{stage, static_cast<int>(k), mb});
      return it == pos.end() ? -1 : static_cast<long>(it->second);
    };
    auto bwd = [&](int stage, int mb) {
      const long b = find(stage, ActionKind::kBackward, mb);
      return b >= 0 ? b : find(stage, ActionKind::kBackwardInput, mb);
    };
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      const std::string where = detail::str_cat("rank ", r, ", action ", i, " (", a.to_string(), ")");
      if (a.is_compute() && a.kind != ActionKind::kBackwardWeight) {
        // Every transfer a compute action needs is there.
        const bool fwd = a.kind == ActionKind::kForward;
        const int in_stage = fwd ? a.stage - 1 : a.stage + 1;
        if (in_stage >= 0 && in_stage < s.stages && s.rank_of(in_stage) != r) {
          const ActionKind k = fwd ? ActionKind::kRecvForward : ActionKind::kRecvBackward;
          HP_CHECK(find(a.stage, k, a.microbatch) >= 0, "pipeline schedule: ", where, " has no ",
                   Action{a.stage, k, a.microbatch}.to_string(), " (a lowered schedule receives what it reads)");
        }
        const int out_stage = fwd ? a.stage + 1 : a.stage - 1;
        if (out_stage >= 0 && out_stage < s.stages && s.rank_of(out_stage) != r) {
          const ActionKind k = fwd ? ActionKind::kSendForward : ActionKind::kSendBackward;
          HP_CHECK(find(a.stage, k, a.microbatch) >= 0, "pipeline schedule: ", where, " has no ",
                   Action{a.stage, k, a.microbatch}.to_string(), " (a lowered schedule sends what it produces)");
        }
        continue;
      }
      if (!a.is_comm()) continue;
      HP_CHECK(a.microbatch >= 0 && a.microbatch < s.microbatches, "pipeline schedule: ", where, ": micro-batch ",
               a.microbatch, " is not one of the ", s.microbatches);
      const int peer = peer_stage(a);
      HP_CHECK(peer >= 0 && peer < s.stages, "pipeline schedule: ", where, ": stage ", a.stage,
               " has no neighbour stage ", peer);
      HP_CHECK(s.rank_of(peer) != r, "pipeline schedule: ", where, ": stage ", peer,
               " is on this rank too (neighbours on one rank pass tensors without a transfer)");
      const Key key{a.stage, static_cast<int>(a.kind), a.microbatch};
      HP_CHECK(++count[key] == 1, "pipeline schedule: ", where, ": runs twice");
      const bool forward = a.kind == ActionKind::kSendForward || a.kind == ActionKind::kRecvForward;
      const long user = forward ? find(a.stage, ActionKind::kForward, a.microbatch) : bwd(a.stage, a.microbatch);
      HP_CHECK(user >= 0, "pipeline schedule: ", where, ": stage ", a.stage, " never ",
               forward ? "forwards" : "backwards", " micro-batch ", a.microbatch);
      if (is_send(a.kind)) {
        HP_CHECK(static_cast<long>(i) > user, "pipeline schedule: ", where, ": sent before ",
                 list[static_cast<size_t>(user)].to_string(), " produced it");
      } else {
        HP_CHECK(static_cast<long>(i) < user, "pipeline schedule: ", where, ": received after ",
                 list[static_cast<size_t>(user)].to_string(), " read it");
      }
    }
  }
  for (const auto& [k, n] : count) {
    const Action a{std::get<0>(k), static_cast<ActionKind>(std::get<1>(k)), std::get<2>(k)};
    const Action c = counterpart(a);
    const Key ck{c.stage, static_cast<int>(c.kind), c.microbatch};
    HP_CHECK(count.count(ck), "pipeline schedule: ", a.to_string(),
             " on rank ", s.rank_of(a.stage), " has no matching ", c.to_string(), " on rank ", s.rank_of(c.stage));
  }
  Schedule copy = s;
  replay_transfers(copy, /*fix=*/false);
}

}  // namespace

int transfer_tag(const Schedule& s, const Action& a) {
  HP_CHECK(a.is_comm(), "transfer_tag of ", a.to_string(), ", which is not a transfer");
  const bool grad = a.kind == ActionKind::kSendBackward || a.kind == ActionKind::kRecvBackward;
  const int sender = is_send(a.kind) ? a.stage : peer_stage(a);
  const int64_t t = ((grad ? 1 : 0) * static_cast<int64_t>(s.stages) + sender) * s.microbatches + a.microbatch;
  return static_cast<int>(t % 32768);
}

namespace {

// A paired forward and its backward made adjacent in a rank's lowered list: the transfers
// between them move out, the receives before the forward (a receive may always be posted
// earlier) and the sends after the backward. The runtime runs the pair as one unit.
void keep_pairs_adjacent(std::vector<Action>& list) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].paired) continue;
    size_t j = i + 1;
    while (j < list.size() && list[j].is_comm()) ++j;
    if (j == list.size() || !list[j].is_compute() || j == i + 1) continue;
    std::vector<Action> recvs, sends;
    for (size_t k = i + 1; k < j; ++k) (is_send(list[k].kind) ? sends : recvs).push_back(list[k]);
    std::vector<Action> pair{list[i], list[j]};
    std::vector<Action> out(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(i));
    out.insert(out.end(), recvs.begin(), recvs.end());
    out.insert(out.end(), pair.begin(), pair.end());
    out.insert(out.end(), sends.begin(), sends.end());
    out.insert(out.end(), list.begin() + static_cast<std::ptrdiff_t>(j) + 1, list.end());
    i += recvs.size() + 1;  // at the backward
    list = std::move(out);
  }
}

}  // namespace

Schedule lower(const Schedule& in, const LowerOptions& o) {
  validate(in);
  bool lowered = false, has_fsdp = false;
  for (const auto& list : in.actions) {
    for (const auto& a : list) {
      lowered = lowered || a.is_comm();
      has_fsdp = has_fsdp || (!a.is_comm() && !a.is_compute());
    }
  }
  if (lowered) return in;
  Schedule s = in;
  for (int r = 0; r < s.ranks; ++r) {
    auto remote = [&](int stage) { return stage >= 0 && stage < s.stages && s.rank_of(stage) != r; };
    std::vector<Action> out;
    for (const Action& a : in.actions[r]) {
      const bool fwd = a.kind == ActionKind::kForward;
      const bool bwd = a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput;
      if (fwd && remote(a.stage - 1)) out.push_back(Action{a.stage, ActionKind::kRecvForward, a.microbatch});
      if (bwd && remote(a.stage + 1)) out.push_back(Action{a.stage, ActionKind::kRecvBackward, a.microbatch});
      out.push_back(a);
      if (fwd && remote(a.stage + 1)) out.push_back(Action{a.stage, ActionKind::kSendForward, a.microbatch});
      if (bwd && remote(a.stage - 1)) out.push_back(Action{a.stage, ActionKind::kSendBackward, a.microbatch});
    }
    keep_pairs_adjacent(out);
    if (o.fully_shard && !has_fsdp) {
      std::map<int, size_t> first, last_bwd;
      for (size_t i = 0; i < out.size(); ++i) {
        if (!first.count(out[i].stage)) first[out[i].stage] = i;
        if (is_backward(out[i].kind) || out[i].kind == ActionKind::kSendBackward) last_bwd[out[i].stage] = i;
      }
      std::vector<Action> with;
      for (size_t i = 0; i < out.size(); ++i) {
        const int st = out[i].stage;
        if (first[st] == i) with.push_back(Action{st, ActionKind::kUnshard, -1});
        with.push_back(out[i]);
        if (last_bwd.count(st) && last_bwd[st] == i) {
          with.push_back(Action{st, ActionKind::kReduceGrad, -1});
          with.push_back(Action{st, ActionKind::kReshard, -1});
        }
      }
      out = std::move(with);
    }
    s.actions[r] = std::move(out);
  }
  replay_transfers(s, /*fix=*/true);
  for (auto& list : s.actions) keep_pairs_adjacent(list);  // a receive moved up between a pair
  validate(s);
  return s;
}

void validate(const Schedule& s) {
  HP_CHECK(s.ranks >= 1 && static_cast<int>(s.actions.size()) == s.ranks, "pipeline schedule: ", s.actions.size(),
           " rank lists for ", s.ranks, " ranks");
  HP_CHECK(s.stages >= s.ranks && s.stages % s.ranks == 0, "pipeline schedule: ", s.stages,
           " stages do not divide over ", s.ranks, " ranks");
  HP_CHECK(s.placement.empty() || static_cast<int>(s.placement.size()) == s.stages, "pipeline schedule: a placement of ",
           s.placement.size(), " stages for ", s.stages);
  for (int r = 0; r < s.ranks; ++r) {
    HP_CHECK(static_cast<int>(s.stages_of(r).size()) == s.stages / s.ranks, "pipeline schedule: rank ", r, " holds ",
             s.stages_of(r).size(), " stages; every rank holds ", s.stages / s.ranks);
  }
  std::map<Key, int> count;
  std::map<int, int> reduce_grads;
  std::map<int, bool> unsharded;  // stages with UNSHARD actions: whether unsharded now
  for (const auto& list : s.actions) {
    for (const auto& a : list) {
      if (a.kind == ActionKind::kUnshard) unsharded[a.stage] = false;
    }
  }
  for (int r = 0; r < s.ranks; ++r) {
    std::map<Key, bool> seen;  // compute actions so far on this rank
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const std::string where = detail::str_cat("rank ", r, ", action ", i, " (", a.to_string(), ")");
      HP_CHECK(a.stage >= 0 && a.stage < s.stages, "pipeline schedule: ", where, ": stage ", a.stage,
               " is not one of the ", s.stages, " stages");
      HP_CHECK(s.rank_of(a.stage) == r, "pipeline schedule: ", where, ": stage ", a.stage, " runs on rank ",
               s.rank_of(a.stage), ", not ", r);
      if (a.kind == ActionKind::kUnshard || a.kind == ActionKind::kReshard) {
        unsharded[a.stage] = a.kind == ActionKind::kUnshard;
        continue;
      }
      HP_CHECK(!a.is_compute() || !unsharded.count(a.stage) || unsharded[a.stage], "pipeline schedule: ", where,
               ": compute on stage ", a.stage, " while it is sharded (outside its UNSHARD ... RESHARD)");
      if (a.kind == ActionKind::kReduceGrad) {
        HP_CHECK(++reduce_grads[a.stage] == 1, "pipeline schedule: ", where, ": a second REDUCE_GRAD of stage ",
                 a.stage);
        continue;
      }
      if (!a.is_compute()) continue;
      HP_CHECK(a.microbatch >= 0 && a.microbatch < s.microbatches, "pipeline schedule: ", where, ": micro-batch ",
               a.microbatch, " is not one of the ", s.microbatches);
      if (a.paired) {
        HP_CHECK(a.kind == ActionKind::kForward, "pipeline schedule: ", where, ": only a forward pairs ('+')");
        size_t j = i + 1;
        while (j < s.actions[r].size() && !s.actions[r][j].is_compute()) ++j;
        HP_CHECK(j < s.actions[r].size() &&
                     (s.actions[r][j].kind == ActionKind::kBackward ||
                      s.actions[r][j].kind == ActionKind::kBackwardInput) &&
                     s.actions[r][j].stage != a.stage,
                 "pipeline schedule: ", where, ": a paired forward ('+') needs the rank's next compute action to be ",
                 "a backward (B or I) of another stage");
      }
      HP_CHECK(reduce_grads[a.stage] == 0 || a.kind == ActionKind::kForward, "pipeline schedule: ", where,
               ": a backward after stage ", a.stage, "'s REDUCE_GRAD");
      const Key k{a.stage, static_cast<int>(a.kind), a.microbatch};
      HP_CHECK(++count[k] == 1, "pipeline schedule: ", where, ": runs twice");
      if (is_backward(a.kind)) {
        HP_CHECK(seen.count(Key{a.stage, static_cast<int>(ActionKind::kForward), a.microbatch}), "pipeline schedule: ",
                 where, ": a backward before its forward");
      }
      if (a.kind == ActionKind::kBackwardWeight) {
        HP_CHECK(seen.count(Key{a.stage, static_cast<int>(ActionKind::kBackwardInput), a.microbatch}),
                 "pipeline schedule: ", where, ": W before its I");
      }
      seen[k] = true;
    }
  }
  for (int st = 0; st < s.stages; ++st) {
    for (int mb = 0; mb < s.microbatches; ++mb) {
      auto n = [&](ActionKind k) { return count[Key{st, static_cast<int>(k), mb}]; };
      HP_CHECK(n(ActionKind::kForward) == 1, "pipeline schedule: stage ", st, " never forwards micro-batch ", mb);
      const bool full = n(ActionKind::kBackward) == 1;
      const bool split = n(ActionKind::kBackwardInput) == 1 && n(ActionKind::kBackwardWeight) == 1;
      HP_CHECK(full != split, "pipeline schedule: stage ", st, " micro-batch ", mb,
               full ? " has both a full and a split backward" : " is never backwarded (B, or I and W)");
    }
  }
  replay(s, Costs{});
  validate_transfers(s);
}

SimResult simulate(const Schedule& s, const Costs& c) { return replay(s, c); }

}  // namespace hp::pp
