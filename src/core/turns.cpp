#include "hp/core/turns.h"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace hp {
namespace {

struct Turns {
  std::mutex mutex;
  std::condition_variable changed;
  int turn = 0;                  // whose turn: 0 (first) or 1 (second)
  bool done[2] = {false, false};
};

// The take_turns this thread runs in, and which of its two computations it is.
thread_local Turns* t_turns = nullptr;
thread_local int t_side = 0;

std::atomic<int64_t> g_taken{0};

// Runs `fn` as computation `side` of `t`: waits for its first turn, and hands the turn over
// for good when it ends (returning, or throwing into `error`).
void run_side(Turns& t, int side, const std::function<void()>& fn, std::exception_ptr& error) {
  {
    std::unique_lock<std::mutex> lock(t.mutex);
    t.changed.wait(lock, [&] { return t.turn == side; });
  }
  t_turns = &t;
  t_side = side;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  t_turns = nullptr;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    t.done[side] = true;
    t.turn = 1 - side;
  }
  t.changed.notify_all();
}

}  // namespace

void take_turns(const std::function<void()>& first, const std::function<void()>& second) {
  Turns t;
  std::exception_ptr first_error, second_error;
  std::thread helper([&] { run_side(t, 1, second, second_error); });
  run_side(t, 0, first, first_error);
  helper.join();
  if (first_error) std::rethrow_exception(first_error);
  if (second_error) std::rethrow_exception(second_error);
}

void yield_turn() {
  Turns* t = t_turns;
  if (t == nullptr) return;
  const int me = t_side, other = 1 - me;
  std::unique_lock<std::mutex> lock(t->mutex);
  if (t->done[other]) return;
  t->turn = other;
  g_taken.fetch_add(1, std::memory_order_relaxed);
  t->changed.notify_all();
  t->changed.wait(lock, [&] { return t->turn == me; });
}

int64_t turns_taken() { return g_taken.load(std::memory_order_relaxed); }

}  // namespace hp
