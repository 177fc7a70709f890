// Two computations taking turns on two threads, one running at a time: the pipeline runs a
// paired forward and backward this way (hp/pp/pipeline.h), so that while one waits for an
// exchange it has issued (an expert all-to-all), the other computes.
//
//   hp::take_turns([&] { forward(); }, [&] { backward(); });
//
// `first` runs on the calling thread, `second` on a helper thread. `first` starts; a
// computation hands the turn to the other at hp::yield_turn() (called on its own thread,
// typically right after issuing work it will wait for) and goes on when the turn comes back;
// a computation that ends hands it over for good. Only one of the two runs at any time, and
// each handover orders everything before it before everything after it, so they share state
// as one thread would; what differs from running them one after the other is only where each
// is interrupted. Thread-local state (grad mode, a recording) is each computation's own.
//
// Where the turns fall must be the same on every rank that exchanges with this one (the
// exchanges are collectives issued in turn order): yield at points every rank reaches
// alike. yield_turn() outside take_turns, or once the other has ended, returns at once.
//
// An exception ends its computation (handing the turn over); the other runs to its end, and
// take_turns then rethrows the first's exception, else the second's.
#pragma once

#include <cstdint>
#include <functional>

namespace hp {

void take_turns(const std::function<void()>& first, const std::function<void()>& second);

// Hands the turn to the other computation of the take_turns running on this thread, if
// any, and returns when it comes back.
void yield_turn();

// Handovers made by yield_turn() on any thread since the process started (the pipeline's
// tests check that turns were taken).
int64_t turns_taken();

}  // namespace hp
