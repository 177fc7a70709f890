// hp::Work: the handle of one asynchronous communication op.
//
// Every Communicator op returns a Work at once; the op runs on the communicator's own
// thread, in issue order. The Work keeps the op's tensors alive until it completes.
//
// Errors: an op that fails raises its CommError from wait(). An op still running when its
// timeout (from the op's options, else the communicator's default) has elapsed since it
// started raises TimeoutError from wait() on this rank instead of hanging; the
// communicator is then unusable and every later op on it raises at once, naming the op
// that timed out. Copyable; copies share the same op.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace hp {

namespace detail {
struct WorkState;
}

class Work {
 public:
  // A default-constructed Work is an op that has already completed successfully.
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  // True once the op has finished, successfully or not. Never blocks.
  bool is_completed() const;
  // Blocks until the op has completed; rethrows its error, or raises TimeoutError once
  // it has run longer than its timeout.
  void wait() const;
  // Like wait() but gives up after `d`: returns false if the op is still running then.
  bool wait_for(std::chrono::milliseconds d) const;

  // The op's name ("all_reduce") and its sequence number on its communicator (from 1).
  std::string op() const;
  uint64_t seq() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace hp
