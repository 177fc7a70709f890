#include "hp/comm/simulated_network.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "hp/core/error.h"
#include "transport.h"

namespace hp {
namespace {

std::vector<std::string> split_on(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

double number(const std::string& spec, const std::string& part, const char* what, bool positive) {
  char* end = nullptr;
  const double x = std::strtod(part.c_str(), &end);
  HP_CHECK(!part.empty() && end == part.c_str() + part.size() && std::isfinite(x) && (positive ? x > 0 : x >= 0),
           "simulated network '", spec, "': ", what, " '", part, "' is not a ", positive ? "positive" : "non-negative",
           " number (expected ALPHA_US:GB_PER_S[,INTER_ALPHA_US:INTER_GB_PER_S:RANKS_PER_NODE])");
  return x;
}

// A link no machine has (a latency of days, a bandwidth of bytes per hour or beyond any
// wire) is a typo, not a model: it would only print step times hundreds of digits long.
constexpr double kMaxLatencyUs = 1e7;                 // 10 s
constexpr double kMinGBps = 1e-6, kMaxGBps = 1e6;     // 1 kB/s .. 1 PB/s

LinkModel link(const std::string& spec, const std::string& latency, const std::string& bandwidth) {
  const LinkModel l{number(spec, latency, "latency", false), number(spec, bandwidth, "bandwidth", true)};
  HP_CHECK(l.alpha_us <= kMaxLatencyUs, "simulated network '", spec, "': latency '", latency,
           "' us is beyond the ", kMaxLatencyUs, " us (10 s) a link is modelled up to");
  HP_CHECK(l.gbytes_per_s >= kMinGBps && l.gbytes_per_s <= kMaxGBps, "simulated network '", spec, "': bandwidth '",
           bandwidth, "' GB/s is outside the range a link is modelled in, [", kMinGBps, ", ", kMaxGBps, "] GB/s");
  return l;
}

}  // namespace

SimulatedNetwork SimulatedNetwork::parse(const std::string& spec) {
  const auto links = split_on(spec, ',');
  HP_CHECK(links.size() <= 2, "simulated network '", spec,
           "': expected ALPHA_US:GB_PER_S[,INTER_ALPHA_US:INTER_GB_PER_S:RANKS_PER_NODE]");
  SimulatedNetwork n;
  const auto intra = split_on(links[0], ':');
  HP_CHECK(intra.size() == 2, "simulated network '", spec, "': the intra-node link '", links[0],
           "' is not ALPHA_US:GB_PER_S");
  n.intra = link(spec, intra[0], intra[1]);
  if (links.size() == 2) {
    const auto inter = split_on(links[1], ':');
    HP_CHECK(inter.size() == 3, "simulated network '", spec, "': the inter-node link '", links[1],
             "' is not INTER_ALPHA_US:INTER_GB_PER_S:RANKS_PER_NODE");
    n.inter = link(spec, inter[0], inter[1]);
    const double k = number(spec, inter[2], "ranks per node", true);
    HP_CHECK(k == std::floor(k) && k <= 1 << 24, "simulated network '", spec, "': ranks per node '", inter[2],
             "' is not a whole number");
    n.ranks_per_node = static_cast<int>(k);
  } else {
    n.inter = n.intra;
  }
  return n;
}

std::string SimulatedNetwork::to_string() const {
  std::ostringstream os;
  os << "intra-node " << intra.alpha_us << " us + bytes / " << intra.gbytes_per_s << " GB/s";
  if (ranks_per_node > 0) {
    os << ", inter-node " << inter.alpha_us << " us + bytes / " << inter.gbytes_per_s << " GB/s, " << ranks_per_node
       << " ranks per node";
  }
  return os.str();
}

bool SimulatedNetwork::spans_nodes(const std::vector<int>& world_ranks) const {
  if (ranks_per_node <= 0 || world_ranks.empty()) return false;
  for (int r : world_ranks) {
    if (r / ranks_per_node != world_ranks[0] / ranks_per_node) return true;
  }
  return false;
}

double SimulatedNetwork::seconds(CommOp op, int64_t bytes, int n, const LinkModel& link) {
  double factor = 1;  // broadcast and point-to-point: the bytes once
  switch (op) {
    case CommOp::kAllGather:
    case CommOp::kReduceScatter:
    case CommOp::kAllToAll:
      factor = (n - 1.0) / n;
      break;
    case CommOp::kAllReduce:
      factor = 2.0 * (n - 1.0) / n;
      break;
    case CommOp::kBarrier:
      factor = 0;
      break;
    case CommOp::kBroadcast:
    case CommOp::kSend:
    case CommOp::kRecv:
    case CommOp::kBatchSendRecv:
      break;
    case CommOp::kSplit:
    case CommOp::kNewGroup:
      throw Error(detail::str_cat("simulated network: no model for the op '", hp::to_string(op), "'"));
  }
  if (n <= 1 && is_collective(op)) return 0;
  return link.alpha_us * 1e-6 + factor * static_cast<double>(bytes) / (link.gbytes_per_s * 1e9);
}

double bytes_sent(const CollectiveCost& c) {
  const double n = c.ranks;
  switch (c.op) {
    case CommOp::kAllGather:
    case CommOp::kReduceScatter:
    case CommOp::kAllToAll:
    case CommOp::kBroadcast:
      return c.count * c.bytes * (n - 1) / n;
    case CommOp::kAllReduce:
      return c.count * c.bytes * 2 * (n - 1) / n;
    case CommOp::kSend:
      return c.count * c.bytes;
    default:
      throw Error(detail::str_cat("bytes_sent: no per-rank share for the op '", hp::to_string(c.op), "'"));
  }
}

double bytes_sent(const std::vector<CollectiveCost>& cs) {
  double b = 0;
  for (const CollectiveCost& c : cs) b += bytes_sent(c);
  return b;
}

double op_count(const std::vector<CollectiveCost>& cs) {
  double n = 0;
  for (const CollectiveCost& c : cs) n += c.count;
  return n;
}

double seconds(const std::vector<CollectiveCost>& cs, const LinkModel& link) {
  double s = 0;
  for (const CollectiveCost& c : cs) {
    s += c.count * SimulatedNetwork::seconds(c.op, static_cast<int64_t>(c.bytes), c.ranks, link);
  }
  return s;
}

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

// Runs every op on the wrapped transport, then holds its completion until the modelled
// time since it started has passed. Methods are called on the communicator's worker: the
// op's body (inside run_op) calls one of the op methods, which notes the model's time.
class SimulatedTransport final : public TransportDecorator {
 public:
  SimulatedTransport(std::unique_ptr<Transport> inner, const SimulatedNetwork& net)
      : TransportDecorator(std::move(inner)), net_(net),
        link_(net.spans_nodes(inner_->world_ranks()) ? net.inter : net.intra) {}

  void run_op(const std::function<void()>& body) override {
    const Clock::time_point start = Clock::now();
    model_s_ = 0;
    inner_->run_op(body);
    const double real = std::chrono::duration<double>(Clock::now() - start).count();
    if (model_s_ > real) std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                                   std::chrono::duration<double>(model_s_)));
    real_us_ = static_cast<int64_t>(real * 1e6);
    model_us_ = static_cast<int64_t>(model_s_ * 1e6);
  }
  std::string trace_note() const override {
    return ",\"model_us\":" + std::to_string(model_us_) + ",\"real_us\":" + std::to_string(real_us_);
  }

 private:
  // The op's modelled time (split and new_group: none; they are local here).
  void before(CommOp op, int64_t bytes) override {
    if (op == CommOp::kSplit || op == CommOp::kNewGroup) return;
    model_s_ = SimulatedNetwork::seconds(op, bytes, size(), link_);
  }
  // Groups made from it are under the same network.
  std::unique_ptr<Transport> wrap_child(std::unique_ptr<Transport> child) override {
    return std::make_unique<SimulatedTransport>(std::move(child), net_);
  }

  SimulatedNetwork net_;
  LinkModel link_;
  double model_s_ = 0;
  int64_t model_us_ = 0, real_us_ = 0;
};

}  // namespace

std::unique_ptr<Transport> make_simulated_transport(std::unique_ptr<Transport> inner, const SimulatedNetwork& net) {
  return std::make_unique<SimulatedTransport>(std::move(inner), net);
}

}  // namespace detail
}  // namespace hp
