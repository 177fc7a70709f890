// hp-train's exit statuses: what scripts/launch.sh (and an operator reading a job's status)
// decides by. Only a failure that another launch could get past is relaunched.
#pragma once

namespace hp::train {

// The run finished (or had nothing left to train).
constexpr int kFinishedExit = 0;
// A failure while training (a rank's error, a lost peer, a full disk): relaunched from the
// last committed checkpoint.
constexpr int kFailedExit = 1;
// The command line is wrong: never relaunched.
constexpr int kUsageExit = 2;
// The loss, the gradient norm or the weights stopped being finite (or, under --strict, the
// model collapsed): the same checkpoint would diverge again, so never relaunched.
constexpr int kDivergedExit = 3;
// The run stopped on a signal and saved: EX_TEMPFAIL ("try again later"), passed on without
// counting as a failure.
constexpr int kPreemptedExit = 75;
// The config, its data or the run's folders were refused before training: EX_CONFIG; the same
// command cannot succeed, so never relaunched.
constexpr int kConfigExit = 78;

}  // namespace hp::train
