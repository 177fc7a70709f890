#include "hp/comm/work.h"

#include "hp/core/error.h"
#include "work_state.h"

namespace hp {
namespace detail {

void CommShared::raise_broken(const WorkState& ws) const {
  try {
    std::rethrow_exception(broken);
  } catch (const CommError& e) {
    if (e.op() == to_string(ws.op) && e.seq() == ws.seq) throw;
    throw CommError(rank, name, to_string(ws.op), ws.seq,
                    str_cat("not run: the communicator is unusable after an earlier failure (",
                            e.what(), ")"),
                    world_rank);
  }
}

std::string CommShared::describe_ranks(const std::vector<int>& group_ranks) const {
  std::string out;
  for (int r : group_ranks) {
    const int w = r < static_cast<int>(world_ranks.size()) ? world_ranks[r] : r;
    out += (out.empty() ? "" : ", ") + (w == r ? std::to_string(r) : str_cat(r, " (world ", w, ")"));
  }
  return out;
}

namespace {

// Why `run` timed out, as far as the transport's out-of-band progress tells: the group
// ranks that never started this collective, or that all visible ones did.
std::string timeout_cause(const CommShared& cs, const WorkState& run) {
  if (run.collective == 0) return "the peer did not join the op, or is far behind";
  int unknown = 0;
  std::vector<int> behind = cs.transport->behind(run.collective, &unknown);
  std::string out;
  if (!behind.empty()) {
    out = str_cat("rank", behind.size() > 1 ? "s " : " ", cs.describe_ranks(behind), " of group '", cs.name,
                  "' never started it");
  } else if (unknown == 0) {
    out = "every other rank of the group started it: one is stuck inside it, or far behind in its data";
  } else {
    out = "no rank of the group on this node is behind";
  }
  if (unknown > 0) out += str_cat("; ", unknown, " rank(s) on other nodes could not be checked");
  return out;
}

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
            cs.rank, cs.name, to_string(run.op), run.seq,
            str_cat("timed out after ", ms, " ms (", timeout_cause(cs, run), "); the communicator is now unusable"),
            cs.world_rank));
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

namespace detail {
namespace {

std::atomic<int> g_threads_in_wait{0};

struct InWait {
  InWait() { g_threads_in_wait.fetch_add(1, std::memory_order_relaxed); }
  ~InWait() { g_threads_in_wait.fetch_sub(1, std::memory_order_relaxed); }
  InWait(const InWait&) = delete;
  InWait& operator=(const InWait&) = delete;
};

}  // namespace

int threads_in_wait() { return g_threads_in_wait.load(std::memory_order_relaxed); }

}  // namespace detail

void Work::wait() const {
  if (!state_) return;
  detail::InWait in_wait;
  detail::spin_until([&] { return state_->finished.load(); });
  detail::wait_until(*state_, nullptr);
}

bool Work::wait_for(std::chrono::milliseconds d) const {
  if (!state_) return true;
  detail::InWait in_wait;
  auto until = detail::Clock::now() + d;
  return detail::wait_until(*state_, &until);
}

std::string Work::op() const { return state_ ? to_string(state_->op) : "none"; }
uint64_t Work::seq() const { return state_ ? state_->seq : 0; }

}  // namespace hp
