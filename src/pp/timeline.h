// The pipeline schedules' replay engine (private to pp): the finish time of each compute
// action and the one dependency rule that the zero-bubble builders (unit costs, in slots)
// and simulate() (given costs) follow.
#pragma once

#include <algorithm>
#include <map>
#include <tuple>

#include "hp/pp/schedule.h"

namespace hp::pp::internal {

inline bool is_backward(ActionKind k) {
  return k == ActionKind::kBackward || k == ActionKind::kBackwardInput || k == ActionKind::kBackwardWeight;
}

using Key = std::tuple<int, int, int>;  // stage, kind, micro-batch

// A forward needs the previous stage's forward of its micro-batch; a backward or
// input-gradient backward needs its own forward and the next stage's backward or
// input-gradient backward; a weight-gradient backward needs its input-gradient backward.
class Timeline {
 public:
  explicit Timeline(int stages) : stages_(stages) {}

  // Whether the inputs of compute action `a` have finished; `*start` is raised to the
  // latest of their finish times.
  bool ready(const Action& a, double* start) const {
    switch (a.kind) {
      case ActionKind::kForward:
        return a.stage == 0 || finished(a.stage - 1, ActionKind::kForward, a.microbatch, start);
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (!finished(a.stage, ActionKind::kForward, a.microbatch, start)) return false;
        return a.stage + 1 >= stages_ || finished(a.stage + 1, ActionKind::kBackward, a.microbatch, start) ||
               finished(a.stage + 1, ActionKind::kBackwardInput, a.microbatch, start);
      case ActionKind::kBackwardWeight:
        return finished(a.stage, ActionKind::kBackwardInput, a.microbatch, start);
      default:
        return true;
    }
  }
  // Whether they finished by time t.
  bool ready_by(const Action& a, double t) const {
    double start = 0;
    return ready(a, &start) && start <= t;
  }
  void finish(const Action& a, double end) { done_[Key{a.stage, static_cast<int>(a.kind), a.microbatch}] = end; }

 private:
  bool finished(int stage, ActionKind k, int mb, double* t) const {
    auto it = done_.find(Key{stage, static_cast<int>(k), mb});
    if (it == done_.end()) return false;
    *t = std::max(*t, it->second);
    return true;
  }
  int stages_;
  std::map<Key, double> done_;
};

}  // namespace hp::pp::internal
