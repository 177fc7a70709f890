// Test support: faults injected into the communication seam (src/comm/transport.h).
//
// FaultInjection installs a decorator over the Transport of every communicator created
// while it lives (hp::detail::set_transport_wrapper). At the point a Fault names (a world
// rank, an op kind, the k-th such op of one communicator, a substring of the
// communicator's name) the decorator does what a broken network or host would do:
//   kError  raise hp::Error from the transport, as a failed MPI or NCCL call does (the
//           communicator turns it into a CommError naming rank, op, group and seq);
//   kDelay  hold the op for `delay` (a straggler: longer than the op's timeout makes its
//           peers, and this rank's waiter, time out), then run it;
//   kHang   never return (until release_hangs(), which tests call to let the process end);
//   kKill   raise SIGKILL in this process (for the launcher's tests).
// A fault fires once per process, at the first communicator to reach it; the communicator's
// k-th op is its op of sequence number k (ops counted as the Communicator numbers them:
// from 1, split and new_group included), or with `op` set its k-th op of that kind.
//
// Nothing here is reachable from the library or hp-train: tests link this file and install
// it (or, for hp-train under the launcher, a test-only build of it: tests/train/fault_env.cpp).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "hp/comm/communicator.h"

namespace hp::detail {
class Transport;
}

namespace hp::test {

struct Fault {
  enum class Action { kError, kDelay, kHang, kKill };
  Action action = Action::kError;
  int world_rank = -1;        // the process it fires in (its world rank); -1: any
  std::optional<CommOp> op;   // the op kind counted; unset: every op counts
  uint64_t nth = 1;           // fires at the communicator's nth counted op (1-based)
  std::string group;          // a substring of the communicator's name; "": any
  std::chrono::milliseconds delay{0};  // kDelay's hold

  // The text form: ACTION[:key=value...], keys rank, op, nth, group, delay_ms; e.g.
  // "hang:rank=1:op=all_gather:nth=3:group=dp_shard". Raises hp::Error naming the part.
  static Fault parse(const std::string& text);
  std::string to_string() const;
};

const char* to_string(Fault::Action a);

// What a fired fault saw: the communicator's name and rank, the op and its number.
struct FaultFired {
  std::string group;
  int rank = 0;
  CommOp op = CommOp::kBarrier;
  uint64_t seq = 0;  // the communicator's sequence number of the op
};

// Installs the decorator for communicators created while it lives; uninstalls (restoring
// the previous wrapper) when destroyed. Communicators already wrapped keep their decorator
// (it holds the fault's state), and a fault fires at most once. Non-copyable.
class FaultInjection {
 public:
  explicit FaultInjection(Fault f, std::function<void(const FaultFired&)> on_fire = nullptr);
  ~FaultInjection();
  FaultInjection(const FaultInjection&) = delete;
  FaultInjection& operator=(const FaultInjection&) = delete;

  bool fired() const;
  // Where it fired (valid once fired()).
  FaultFired where() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::function<std::unique_ptr<detail::Transport>(std::unique_ptr<detail::Transport>, const std::string&)> previous_;
};

// Lets every op held by a kHang fault return (then run), so that a test process whose
// peers timed out on it can still end cleanly.
void release_hangs();

}  // namespace hp::test
