// Pipeline schedules as data: per rank, the list of actions it runs in order. Pure: built,
// printed, parsed, validated and simulated without ranks (the runtime that executes them is
// not built yet).
//
// An action names a stage, a kind and (for compute) a micro-batch. Text form, one token
// per action: "0F1" (stage 0, forward of micro-batch 1), "1B0" (full backward), "2I3"
// (input-gradient backward), "2W3" (weight-gradient backward), "1UNSHARD", "1RESHARD",
// "1REDUCE_GRAD" (fully_shard's verbs for a stage). A schedule prints as one line per rank,
// "rank 0: 0F0 0F1 0B0 ...", and parses back to the same schedule.
//
// Stages are placed on ranks in a loop: stage s on rank s % ranks (with v stages per rank,
// rank r holds stages r, r + ranks, ...).
//
// validate() checks what every schedule must satisfy and raises hp::Error naming the rank
// and the action: every micro-batch forwarded once per stage and backwarded once (B, or I
// and then W), a backward only after its forward, actions only on stages the rank holds, at
// most one REDUCE_GRAD per stage and after its last backward, and that the order can
// complete: the simulator replays every rank's list and a list that waits forever on
// another rank (a cycle) is an error naming the waiting actions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp::pp {

enum class ActionKind { kForward, kBackward, kBackwardInput, kBackwardWeight, kUnshard, kReshard, kReduceGrad };

struct Action {
  int stage = 0;
  ActionKind kind = ActionKind::kForward;
  int microbatch = -1;  // compute actions only

  bool is_compute() const;
  std::string to_string() const;
  // Raises hp::Error naming the token for text that is not an action.
  static Action parse(const std::string& token);
  bool operator==(const Action& o) const {
    return stage == o.stage && kind == o.kind && microbatch == o.microbatch;
  }
};

struct Schedule {
  int ranks = 1;
  int stages = 1;        // ranks x stages per rank
  int microbatches = 1;
  std::vector<std::vector<Action>> actions;  // per rank, in order

  int rank_of(int stage) const { return stage % ranks; }
  std::string to_string() const;
  static Schedule parse(const std::string& text, int stages, int microbatches);
};

// Built-in schedules over `ranks` ranks, `m` micro-batches.
Schedule gpipe(int ranks, int m);
Schedule one_f_one_b(int ranks, int m);
// v > 1 stages per rank, in a loop; m must be a multiple of ranks (others: "not supported yet").
Schedule interleaved_1f1b(int ranks, int v, int m);

// Raises hp::Error (see the file comment).
void validate(const Schedule& s);

struct Costs {
  double forward = 1, backward = 2;  // a full backward (I + W)
  double backward_input = 1, backward_weight = 1;
};

struct SimResult {
  double makespan = 0;
  std::vector<double> busy;         // per rank, compute time
  std::vector<double> bubble;       // per rank, 1 - busy / makespan
  std::vector<int> peak_in_flight;  // per rank, micro-batch forwards whose backward has not finished
};

// Replays the schedule with the given costs (communication free): each rank runs its list in
// order, an action starting once the rank is free and its inputs are ready. Raises like
// validate() for an order that cannot complete.
SimResult simulate(const Schedule& s, const Costs& c = {});

}  // namespace hp::pp
