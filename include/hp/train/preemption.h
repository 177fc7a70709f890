// Preemption: a run asked to stop by its scheduler saves and exits instead of losing the
// steps since its last checkpoint.
//
// SIGTERM (what SLURM, Kubernetes and most schedulers send before they kill) and SIGUSR1
// (SLURM's `--signal=USR1@<seconds>`) are caught while a PreemptionSignals object lives.
// The first asks for a stop: Trainer::train (through TrainCallbacks::stop_requested) agrees
// with every rank after the step in flight, whichever rank received it, saves a checkpoint
// synchronously and returns; hp-train then exits with kPreemptedExit on every rank. A
// second signal within the grace (kStopGraceS) is the same notice again (a scheduler that
// signals the ranks and the launcher together, which passes it on) and changes nothing; one
// after it ends the process at once with status 128 + its number: a save in progress then
// never commits, and `latest` still names the previous checkpoint.
#pragma once

#include <string>

#include "hp/train/exit_status.h"  // kPreemptedExit

namespace hp::train {

// Seconds after the first stop signal in which another is the same notice.
constexpr double kStopGraceS = 5.0;

class PreemptionSignals {
 public:
  // Installs the handlers; one object at a time. `grace_s` in [0, 3600].
  explicit PreemptionSignals(double grace_s = kStopGraceS);
  ~PreemptionSignals();  // restores the handlers it replaced
  PreemptionSignals(const PreemptionSignals&) = delete;
  PreemptionSignals& operator=(const PreemptionSignals&) = delete;

  // The first signal's number since construction, 0 when none. Async-signal-safe to set,
  // cheap to read.
  static int received();
};

// "SIGTERM", "SIGUSR1", or "signal N".
std::string signal_name(int signo);

}  // namespace hp::train
