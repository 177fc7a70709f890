#include "hp/comm/work.h"

#include "hp/core/error.h"
#include "work_state.h"

namespace hp {
namespace detail {

void CommShared::raise_broken(const WorkState& ws) const {
  try {
    std::rethrow_exception(broken);
  } catch (const CommError& e) {
    if (e.op() == ws.op && e.seq() == ws.seq) throw;
    throw CommError(rank, name, ws.op, ws.seq,
                    str_cat("not run: the communicator is unusable after an earlier failure (",
                            e.what(), ")"));
  }
}

namespace {

// Waits for ws until `until` (nullopt = no limit of the caller's). Returns true when done.
bool wait_until(WorkState& ws, const Clock::time_point* until) {
  CommShared& cs = *ws.comm;
  std::unique_lock<std::mutex> lk(cs.mu);
  for (;;) {
    if (ws.done) {
      if (ws.error) std::rethrow_exception(ws.error);
      return true;
    }
    if (cs.broken) cs.raise_broken(ws);
    auto now = Clock::now();
    Clock::time_point deadline = now + std::chrono::milliseconds(100);
    if (cs.running && cs.running->started) {
      const WorkState& run = *cs.running;
      Clock::time_point op_deadline = run.start + run.timeout;
      if (now >= op_deadline) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(run.timeout).count();
        cs.broken = std::make_exception_ptr(TimeoutError(
            cs.rank, cs.name, run.op, run.seq,
            str_cat("timed out after ", ms,
                    " ms (a peer did not join the op, or is far behind); the communicator "
                    "is now unusable")));
        cs.transport->abandon();
        cs.done_cv.notify_all();
        cs.raise_broken(ws);
      }
      deadline = op_deadline;
    }
    if (until != nullptr) {
      if (now >= *until) return false;
      if (*until < deadline) deadline = *until;
    }
    cs.done_cv.wait_until(lk, deadline);
  }
}

}  // namespace
}  // namespace detail

bool Work::is_completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> g(state_->comm->mu);
  return state_->done;
}

void Work::wait() const {
  if (!state_) return;
  detail::spin_until([&] { return state_->finished.load(); });
  detail::wait_until(*state_, nullptr);
}

bool Work::wait_for(std::chrono::milliseconds d) const {
  if (!state_) return true;
  auto until = detail::Clock::now() + d;
  return detail::wait_until(*state_, &until);
}

std::string Work::op() const { return state_ ? state_->op : "none"; }
uint64_t Work::seq() const { return state_ ? state_->seq : 0; }

}  // namespace hp
