// Pipeline schedules as data: per rank, the list of actions it runs in order. Pure: built,
// printed, parsed, lowered, validated and simulated without ranks; hp/pp/pipeline.h runs
// them.
//
// An action names a stage, a kind and (for compute) a micro-batch. Text form, one token
// per action: "0F1" (stage 0, forward of micro-batch 1), "1B0" (full backward), "2I3"
// (input-gradient backward), "2W3" (weight-gradient backward), "1UNSHARD", "1RESHARD",
// "1REDUCE_GRAD" (fully_shard's verbs for a stage), and the transfers lower() inserts:
// "0SEND_F1" / "1RECV_F1" (stage 0's activation of micro-batch 1 to stage 1),
// "1SEND_B1" / "0RECV_B1" (stage 1's input gradient back to stage 0). A forward ending in
// "+" ("0F3+") is paired with the rank's next compute action, a backward of another stage:
// the two form one overlapped unit (DualPipe's F&B). Given a cost for it
// (Costs::forward_backward), simulate() runs the pair as one unit starting once both are
// ready; without one it replays them in turn, as hp's runtime runs them.
// A schedule prints as one line per rank,
// "rank 0: 0F0 0F1 0B0 ...", and parses back to the same schedule.
//
// Stages are placed on ranks in a loop by default: stage s on rank s % ranks (with v stages
// per rank, rank r holds stages r, r + ranks, ...). A schedule may give another placement
// (ZBV's V: rank r holds stages r and 2 ranks - 1 - r); its text form then starts with a
// line "placement: <rank of stage 0> <rank of stage 1> ...".
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

enum class ActionKind {
  kForward,
  kBackward,
  kBackwardInput,
  kBackwardWeight,
  kUnshard,
  kReshard,
  kReduceGrad,
  // Inserted by lower(): the activation of a forward of `stage` sent to stage + 1 (SEND_F),
  // received by stage + 1 (RECV_F, its stage is the receiver); the input gradient of a
  // backward of `stage` sent to stage - 1 (SEND_B), received there (RECV_B).
  kSendForward,
  kRecvForward,
  kSendBackward,
  kRecvBackward,
};

struct Action {
  int stage = 0;
  ActionKind kind = ActionKind::kForward;
  int microbatch = -1;  // compute and transfer actions only
  bool paired = false;  // a forward overlapped with the next compute action (see above)

  bool is_compute() const;
  bool is_comm() const;  // SEND_F, RECV_F, SEND_B, RECV_B
  // A transfer's other end: stage + 1 for SEND_F and RECV_B, stage - 1 for RECV_F and SEND_B.
  int peer_stage() const;
  std::string to_string() const;
  // Raises hp::Error naming the token for text that is not an action.
  static Action parse(const std::string& token);
  bool operator==(const Action& o) const {
    return stage == o.stage && kind == o.kind && microbatch == o.microbatch && paired == o.paired;
  }
};

struct Schedule {
  int ranks = 1;
  int stages = 1;        // ranks x stages per rank
  int microbatches = 1;
  std::vector<std::vector<Action>> actions;  // per rank, in order

  std::vector<int> placement;  // the rank of each stage; empty: the loop (stage % ranks)

  // Raises hp::Error for a stage outside [0, stages) (an action of a malformed schedule).
  int rank_of(int stage) const;
  // The stages rank `r` holds, in increasing order.
  std::vector<int> stages_of(int r) const;
  std::string to_string() const;
  static Schedule parse(const std::string& text, int stages, int microbatches);
};

// Built-in schedules over `ranks` ranks, `m` micro-batches.
Schedule gpipe(int ranks, int m);
Schedule one_f_one_b(int ranks, int m);
// v > 1 stages per rank, in a loop. Micro-batches go through the chunks in rounds: of `ranks`
// when m is a multiple of it; otherwise max(1, m / ranks) rounds of m / rounds each, when
// that divides (others: "not supported yet").
Schedule interleaved_1f1b(int ranks, int v, int m);

// ZB-H1 (zero bubble, about the memory of 1F1B): 1F1B's order of forwards with each
// backward split into I (input gradient) and W (weight gradient), the W's deferred into what
// would be bubbles: a rank runs its oldest pending W when its next F or I is not ready, and
// before an F that would hold more than `ranks` micro-batches (held from F to W; 1F1B's
// first rank holds as many, from F to B). The order is fixed by replaying unit costs
// (F = I = W = 1); at those costs it takes 3m + p - 1 slots where 1F1B takes 3(m + p - 1).
Schedule zero_bubble_h1(int ranks, int m);

// ZBV (zero bubble in a V): two stages per rank placed as a V (rank r holds stages r and
// 2p - 1 - r, so the first and the last stage share rank 0 and the middle two rank p - 1,
// passing between them without a transfer), each backward split into I and W. A unit-cost
// replay orders each rank's actions: a ready I first (the later stage first), then a ready F
// (the later stage first) unless the rank would hold more than 2p stage-micro-batches (held
// from F to W: p of 1F1B's whole-rank micro-batches), then the oldest pending W. At unit
// costs per stage it takes 6m + p - 1 slots (within one slot), where ZB-H1 over p stages of
// twice the size takes 2(3m + p - 1).
Schedule zero_bubble_v(int ranks, int m);

// DualPipeV (DeepSeek's DualPipe cut in half): ZBV's V of two stages per rank, a rank's
// order fixed by phases rather than replayed. Warm-up: 2(p - r - 1) forwards of its first
// stage (chunk 0), then r + 1 pairs of a forward of each chunk; p - r - 1 rounds of chunk 1's
// input gradient, a weight gradient and a chunk-1 forward; the steady phase, m - 2p + r + 1
// rounds of (forward chunk 0, backward chunk 1, forward chunk 1, backward chunk 0), each
// forward paired ("+") with the other chunk's backward (on a device the pair overlaps one's
// compute with the other's communication; the runtime here runs them in turn); p - r - 1
// rounds of (backward 1, forward 1 paired, backward 0); r + 1 rounds of backward 1 and
// backward 0 (from the middle on split into I and W), p - r - 1 of a W and a split backward
// of chunk 0, and the W's left. Needs m >= 2p. Its bubble, DualPipe's (p - 1)(F&B + B - 3W)
// for p ranks of 2 stages, is the largest rank's in simulate() with the pairs as units
// (Costs::forward_backward set) where a stage's F, I and W cost the same; with other costs
// simulate() gives less.
Schedule dualpipev(int ranks, int m);

// Raises hp::Error (see the file comment). For a lowered schedule also: every compute
// action has the receive it reads and the send of what it produces, every send meets exactly
// one receive of the same micro-batch on the neighbouring stage's rank, a receive comes
// before the compute that reads it and a send after the compute that produces it, and the
// transfers complete as the runtime moves them: per ordered pair of ranks one link on which
// sends and receives are each handled in posting order, every send waiting for its receive
// (the strictest transport); posting never blocks, a compute action waits for what it reads,
// and the receive of micro-batch 0's activation waits for its shape header.
void validate(const Schedule& s);

struct LowerOptions {
  // Insert fully_shard's verbs: UNSHARD before a stage's first action, REDUCE_GRAD after
  // its last backward, RESHARD after that.
  bool fully_shard = false;
};

// Inserts the point-to-point transfers between stages on different ranks: a receive right
// before the compute that needs it, a send right after the compute that produced it; then
// replays them as validate() does and, where a link's receives are posted out of its sends'
// order or too late, moves the receive up in the receiver's list (a receive may always be
// posted earlier). The result validates; it raises for a schedule whose compute order itself
// cannot complete. A schedule already holding comm actions is returned unchanged
// (validated).
Schedule lower(const Schedule& s, const LowerOptions& o = {});

// The tag of a transfer (the same on both sides): distinct for the transfers of one step
// up to 32768 of them.
int transfer_tag(const Schedule& s, const Action& a);

struct Costs {
  double forward = 1, backward = 2;  // a full backward (I + W)
  double backward_input = 1, backward_weight = 1;
  // A paired forward and backward (F&B) run as one overlapped unit; 0: no overlap, the two
  // replayed in turn. Taken from the forward's stage's costs.
  double forward_backward = 0;
  // Stage k's costs when not empty (one per stage; their own per_stage unused): stages of
  // unequal size, such as a last stage with the head and the loss.
  std::vector<Costs> per_stage;
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
