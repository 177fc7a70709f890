// Private: the state shared by a queued communicator, its worker thread and its Works.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hp/comm/communicator.h"
#include "transport.h"

namespace hp::detail {

struct CommShared;
using Clock = std::chrono::steady_clock;

struct WorkState {
  CommOp op = CommOp::kBarrier;
  uint64_t seq = 0;
  uint64_t collective = 0;  // its index among the communicator's collectives (0: send/recv)
  Timeout timeout{0};
  int64_t issue_us = 0;
  int64_t bytes = 0;
  std::shared_ptr<CommShared> comm;
  // Guarded by comm->mu.
  bool started = false;
  bool done = false;
  // Mirrors `done` for the short lock-free spin in Work::wait.
  std::atomic<bool> finished{false};
  Clock::time_point start;
  std::exception_ptr error;
  // The op itself; it holds the op's tensors and is released when the op completes.
  std::function<void()> run;
};

struct CommShared {
  std::mutex mu;
  std::condition_variable work_cv;  // the worker waits here for ops
  std::condition_variable done_cv;  // waiters wait here for completions
  std::deque<std::shared_ptr<WorkState>> queue;
  std::shared_ptr<WorkState> running;
  // Set once an op timed out or failed: every later op raises this.
  std::exception_ptr broken;
  bool stop = false;
  std::thread worker;
  uint64_t next_seq = 1;
  // Ops queued, for the worker's short lock-free spin before it sleeps.
  std::atomic<uint64_t> enqueued{0};
  uint64_t collectives_started = 0;  // worker thread only

  // Immutable after construction.
  std::unique_ptr<Transport> transport;  // used by the worker thread only
  std::string name;
  int rank = 0;
  int size = 1;
  int world_rank = 0;             // this process's rank in the world
  std::vector<int> world_ranks;   // of every rank of the group
  int64_t lane = 0;

  // Raises the CommError that `ws` ends with when the communicator broke before or while
  // it ran. Call with mu held.
  [[noreturn]] void raise_broken(const WorkState& ws) const;
  // "3 (world 7), 5 (world 9)": group ranks with their world ranks.
  std::string describe_ranks(const std::vector<int>& group_ranks) const;
};

// Waking a sleeping thread costs several microseconds per op, a visible share of a
// millisecond collective. The worker (for the next op) and a waiter (for completion)
// first spin this long, yielding the core, before they block.
constexpr std::chrono::microseconds kSpinBeforeSleep{50};

template <typename Pred>
bool spin_until(Pred ready) {
  auto until = Clock::now() + kSpinBeforeSleep;
  do {
    if (ready()) return true;
    std::this_thread::yield();
  } while (Clock::now() < until);
  return ready();
}

}  // namespace hp::detail
