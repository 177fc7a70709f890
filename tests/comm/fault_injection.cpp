#include "comm/fault_injection.h"

#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "comm/transport.h"
#include "hp/core/error.h"

namespace hp::test {
namespace {

constexpr CommOp kAllOps[] = {CommOp::kAllGather, CommOp::kReduceScatter, CommOp::kAllReduce, CommOp::kBroadcast,
                              CommOp::kAllToAll,  CommOp::kSend,          CommOp::kRecv,      CommOp::kBatchSendRecv,
                              CommOp::kBarrier,   CommOp::kSplit,         CommOp::kNewGroup};

constexpr std::pair<Fault::Action, const char*> kActions[] = {
    {Fault::Action::kError, "error"}, {Fault::Action::kDelay, "delay"},
    {Fault::Action::kHang, "hang"},   {Fault::Action::kKill, "kill"}};

// kHang's ops wait here until release_hangs().
std::mutex g_hang_mu;
std::condition_variable g_hang_cv;
bool g_released = false;

}  // namespace

const char* to_string(Fault::Action a) {
  for (const auto& [v, name] : kActions) {
    if (v == a) return name;
  }
  return "?";
}

Fault Fault::parse(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream ss(text);
  for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
  HP_CHECK(!parts.empty(), "fault '", text, "': empty (expected ACTION[:key=value...])");
  Fault f;
  bool known = false;
  for (const auto& [v, name] : kActions) {
    if (parts[0] == name) f.action = v, known = true;
  }
  HP_CHECK(known, "fault '", text, "': action '", parts[0], "' is not one of error, delay, hang, kill");
  for (size_t i = 1; i < parts.size(); ++i) {
    const auto eq = parts[i].find('=');
    HP_CHECK(eq != std::string::npos, "fault '", text, "': '", parts[i], "' is not key=value");
    const std::string key = parts[i].substr(0, eq), value = parts[i].substr(eq + 1);
    auto integer = [&] {
      char* end = nullptr;
      const long long v = std::strtoll(value.c_str(), &end, 10);
      HP_CHECK(!value.empty() && *end == '\0' && v >= 0, "fault '", text, "': ", key, "='", value,
               "' is not a non-negative integer");
      return v;
    };
    if (key == "rank") {
      f.world_rank = static_cast<int>(integer());
    } else if (key == "nth") {
      f.nth = static_cast<uint64_t>(integer());
      HP_CHECK(f.nth >= 1, "fault '", text, "': nth counts from 1");
    } else if (key == "delay_ms") {
      f.delay = std::chrono::milliseconds(integer());
    } else if (key == "group") {
      f.group = value;
    } else if (key == "op") {
      for (CommOp op : kAllOps) {
        if (value == hp::to_string(op)) f.op = op;
      }
      HP_CHECK(f.op.has_value(), "fault '", text, "': op '", value, "' is not an op's name (all_gather, send, ...)");
    } else {
      HP_CHECK(false, "fault '", text, "': unknown key '", key, "' (rank, op, nth, group, delay_ms)");
    }
  }
  return f;
}

std::string Fault::to_string() const {
  std::ostringstream os;
  os << hp::test::to_string(action);
  if (world_rank >= 0) os << ":rank=" << world_rank;
  if (op) os << ":op=" << hp::to_string(*op);
  os << ":nth=" << nth;
  if (!group.empty()) os << ":group=" << group;
  if (action == Action::kDelay) os << ":delay_ms=" << delay.count();
  return os.str();
}

struct FaultInjection::State {
  Fault fault;
  std::function<void(const FaultFired&)> on_fire;
  std::atomic<bool> fired{false};
  mutable std::mutex mu;
  FaultFired where;
};

namespace {

// The decorator: counts the communicator's ops as its worker runs them (run_op sees every
// op that runs, in sequence order) and acts at the fault's point. Every method is called on
// the communicator's worker, like the transport it wraps.
class FaultTransport final : public detail::TransportDecorator {
 public:
  FaultTransport(std::unique_ptr<Transport> inner, std::string name, std::shared_ptr<FaultInjection::State> s)
      : TransportDecorator(std::move(inner)), name_(std::move(name)), s_(std::move(s)) {
    const auto w = inner_->world_ranks();
    world_rank_ = inner_->rank() < static_cast<int>(w.size()) ? w[inner_->rank()] : inner_->rank();
    armed_ = (s_->fault.world_rank < 0 || s_->fault.world_rank == world_rank_) &&
             name_.find(s_->fault.group) != std::string::npos;
  }

  void skip_op() override {
    ++seq_;  // a skipped op had its number too
    inner_->skip_op();
  }
  void run_op(const std::function<void()>& body) override {
    ++seq_;
    inner_->run_op(body);
  }

 private:
  // Splits and groups are counted (make_queued_communicator wraps a child under its own
  // name, so it is returned unwrapped).
  void before(CommOp op, int64_t /*bytes*/) override {
    const uint64_t count = ++by_kind_[op];
    if (!armed_ || s_->fired.load()) return;
    const Fault& f = s_->fault;
    if (f.op ? (*f.op != op || count != f.nth) : seq_ != f.nth) return;
    if (s_->fired.exchange(true)) return;  // another communicator got there first
    FaultFired where{name_, inner_->rank(), op, seq_};
    {
      std::lock_guard<std::mutex> g(s_->mu);
      s_->where = where;
    }
    if (s_->on_fire) s_->on_fire(where);
    const std::string what = detail::str_cat("injected fault '", f.to_string(), "' at ", hp::to_string(op), " #",
                                             seq_, " of group '", name_, "' on world rank ", world_rank_);
    switch (f.action) {
      case Fault::Action::kError:
        throw Error(what + ": the transport failed");
      case Fault::Action::kDelay:
        std::this_thread::sleep_for(f.delay);
        return;
      case Fault::Action::kHang: {
        std::unique_lock<std::mutex> lk(g_hang_mu);
        g_hang_cv.wait(lk, [] { return g_released; });
        return;
      }
      case Fault::Action::kKill:
        std::fprintf(stderr, "%s: SIGKILL\n", what.c_str());
        std::fflush(nullptr);
        ::kill(::getpid(), SIGKILL);
        return;
    }
  }

  std::string name_;
  std::shared_ptr<FaultInjection::State> s_;
  int world_rank_ = 0;
  bool armed_ = false;
  uint64_t seq_ = 0;  // the communicator's sequence number of the op now running
  std::map<CommOp, uint64_t> by_kind_;
};

}  // namespace

FaultInjection::FaultInjection(Fault f, std::function<void(const FaultFired&)> on_fire)
    : state_(std::make_shared<State>()) {
  state_->fault = std::move(f);
  state_->on_fire = std::move(on_fire);
  previous_ = detail::set_transport_wrapper(
      [s = state_](std::unique_ptr<detail::Transport> t, const std::string& name) -> std::unique_ptr<detail::Transport> {
        return std::make_unique<FaultTransport>(std::move(t), name, s);
      });
}

FaultInjection::~FaultInjection() { detail::set_transport_wrapper(std::move(previous_)); }

bool FaultInjection::fired() const { return state_->fired.load(); }

FaultFired FaultInjection::where() const {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->where;
}

void release_hangs() {
  {
    std::lock_guard<std::mutex> g(g_hang_mu);
    g_released = true;
  }
  g_hang_cv.notify_all();
}

}  // namespace hp::test
