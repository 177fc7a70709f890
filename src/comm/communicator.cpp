// The queued Communicator: validation, sequencing, the worker thread, AVG, timeouts and
// trace spans, shared by every synchronous transport (local, mpi).
#include "hp/comm/communicator.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <tuple>
#include <numeric>

#include "hp/core/env.h"
#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "../core/tsan.h"
#include "bootstrap.h"
#include "work_state.h"

namespace hp {

const char* to_string(CommOp op) {
  switch (op) {
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kAllToAll: return "all_to_all";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kBatchSendRecv: return "batch_send_recv";
    case CommOp::kBarrier: return "barrier";
    case CommOp::kSplit: return "split";
    case CommOp::kNewGroup: return "new_group";
  }
  return "?";
}

bool is_collective(CommOp op) {
  return op != CommOp::kSend && op != CommOp::kRecv && op != CommOp::kBatchSendRecv && op != CommOp::kNewGroup;
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return "sum";
    case ReduceOp::AVG: return "avg";
    case ReduceOp::MAX: return "max";
    case ReduceOp::MIN: return "min";
  }
  return "?";
}

namespace detail {
namespace {

std::mutex g_registry_mu;
std::vector<std::weak_ptr<CommShared>> g_registry;

// set_transport_wrapper's (tests only). Function-local statics: a test binary may set the
// wrapper from a static initializer of another file, before this file's globals exist.
std::mutex& wrapper_mu() {
  static std::mutex mu;
  return mu;
}
TransportWrapper& wrapper() {
  static TransportWrapper w;
  return w;
}

bool supported_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kByte: case at::kBool:
      return true;
    default:
      return false;
  }
}

bool is_integral_or_bool(at::ScalarType t) {
  return t == at::kInt || t == at::kLong || t == at::kByte || t == at::kBool;
}

std::string describe(const at::Tensor& t) {
  return str_cat(t.scalar_type(), t.sizes(), " on ", t.device());
}

void worker_loop(std::shared_ptr<CommShared> cs) {
  for (;;) {
    std::shared_ptr<WorkState> ws;
    {
      std::unique_lock<std::mutex> lk(cs->mu);
      if (cs->queue.empty() && !cs->stop) {
        uint64_t seen = cs->enqueued.load();
        lk.unlock();
        spin_until([&] { return cs->enqueued.load() != seen; });
        lk.lock();
      }
      cs->work_cv.wait(lk, [&] { return cs->stop || !cs->queue.empty(); });
      if (cs->queue.empty()) return;
      ws = std::move(cs->queue.front());
      cs->queue.pop_front();
      if (cs->broken) {
        cs->transport->skip_op();
        try {
          cs->raise_broken(*ws);
        } catch (...) {
          ws->error = std::current_exception();
        }
        ws->done = true;
        ws->finished = true;
        ws->run = nullptr;
        cs->done_cv.notify_all();
        continue;
      }
      ws->started = true;
      ws->start = Clock::now();
      // Counted: the ops every rank of the communicator runs. Point-to-point ops, and
      // new_group (only the listed ranks call it), are not.
      if (is_collective(ws->op)) {
        ws->collective = ++cs->collectives_started;
      }
      cs->running = ws;
    }
    if (ws->collective > 0) cs->transport->note_started(ws->collective);
    std::exception_ptr err;
    try {
      cs->transport->run_op(ws->run);
    } catch (const CommError&) {
      err = std::current_exception();
    } catch (const std::exception& e) {
      err = std::make_exception_ptr(CommError(cs->rank, cs->name, to_string(ws->op), ws->seq, e.what(), cs->world_rank));
    } catch (...) {
      err = std::make_exception_ptr(
          CommError(cs->rank, cs->name, to_string(ws->op), ws->seq, "unknown exception", cs->world_rank));
    }
    // Recorded before the op is marked done: once wait() returns, the op's span is in the
    // trace.
    if (trace::enabled()) {
      int64_t end = trace::now_us();
      trace::record(trace::Event{
          to_string(ws->op), "comm", ws->issue_us, end - ws->issue_us, cs->lane, true,
          (static_cast<uint64_t>(cs->lane) << 40) | ws->seq,
          str_cat("{\"seq\":", ws->seq, ",\"group\":\"", cs->name, "\",\"bytes\":", ws->bytes,
                  cs->transport->trace_note(), "}")});
    }
    std::function<void()> release;
    {
      std::lock_guard<std::mutex> g(cs->mu);
      cs->running.reset();
      ws->done = true;
      ws->finished = true;
      ws->error = err;
      // A failed collective leaves the group out of step: nothing later can run on it.
      if (err && !cs->broken) cs->broken = err;
      release.swap(ws->run);
      cs->done_cv.notify_all();
    }
    tsan::tensors_dropped();
    release = nullptr;  // drops the op's tensors outside the lock
  }
}

// Stops the worker after the queued ops ran. An op still running past its timeout breaks
// the communicator as wait() would; a worker stuck in such an op (or, once broken, still
// stuck after `grace`) is detached, keeping its state alive, and false is returned.
bool stop_worker(CommShared& cs, std::chrono::milliseconds grace) {
  std::unique_lock<std::mutex> lk(cs.mu);
  cs.stop = true;
  cs.work_cv.notify_all();
  if (!cs.worker.joinable()) return true;
  for (;;) {
    if (!cs.running && (cs.queue.empty() || cs.broken)) break;
    Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(100);
    if (cs.broken) {
      if (!cs.done_cv.wait_for(lk, grace, [&] { return !cs.running; })) {
        cs.worker.detach();
        return false;
      }
      continue;
    }
    if (cs.running && cs.running->started) {
      deadline = cs.running->start + cs.running->timeout;
      if (Clock::now() >= deadline) {
        cs.broken = std::make_exception_ptr(TimeoutError(
            cs.rank, cs.name, to_string(cs.running->op), cs.running->seq,
            "timed out at shutdown (a peer never joined the op)", cs.world_rank));
        cs.transport->abandon();
        cs.done_cv.notify_all();
        continue;
      }
    }
    cs.done_cv.wait_until(lk, deadline);
  }
  lk.unlock();
  if (cs.worker.get_id() == std::this_thread::get_id()) {
    cs.worker.detach();
  } else {
    cs.worker.join();
  }
  return true;
}

int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }

class QueuedCommunicator final : public Communicator {
 public:
  QueuedCommunicator(std::unique_ptr<Transport> t, const std::string& name, Timeout timeout,
                     std::shared_ptr<TrafficAccount> account)
      : cs_(std::make_shared<CommShared>()), timeout_(timeout), account_(std::move(account)) {
    cs_->rank = t->rank();
    cs_->size = t->size();
    world_ranks_ = t->world_ranks();
    cs_->world_ranks = world_ranks_;
    cs_->world_rank = cs_->rank < static_cast<int>(world_ranks_.size()) ? world_ranks_[cs_->rank] : cs_->rank;
    backend_ = t->backend();
    cs_->transport = std::move(t);
    cs_->name = name;
    cs_->lane = trace::new_lane("comm " + name);
    std::lock_guard<std::mutex> g(g_registry_mu);
    g_registry.erase(std::remove_if(g_registry.begin(), g_registry.end(),
                                    [](const auto& w) { return w.expired(); }),
                     g_registry.end());
    g_registry.push_back(cs_);
  }
  ~QueuedCommunicator() override { stop_worker(*cs_, std::chrono::milliseconds(2000)); }

  int rank() const override { return cs_->rank; }
  int size() const override { return cs_->size; }
  const std::string& name() const override { return cs_->name; }
  std::string backend() const override { return backend_; }
  bool supports_device(const c10::Device& d) const override { return cs_->transport->supports_device(d); }
  c10::Device control_device() const override { return cs_->transport->control_device(); }
  bool copies_without_cpu() const override { return cs_->transport->copies_without_cpu(); }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  Timeout default_timeout() const override { return timeout_; }
  CommTraffic traffic() const override { return {account_->ops.load(), account_->bytes_sent.load()}; }

  Work all_gather(at::Tensor out, at::Tensor in, const CollectiveOptions& o) override {
    const CommOp op = CommOp::kAllGather;
    check_tensor(op, out, "output");
    check_tensor(op, in, "input");
    check_same_dtype(op, out, in);
    HP_CHECK(out.numel() == in.numel() * size(), where(op), "output has ", out.numel(),
             " elements but must have ", in.numel() * size(), " (input ", in.numel(), " x ",
             size(), " ranks)");
    return enqueue(op, o.timeout, in.nbytes(), nbytes(in) * (size() - 1), [t = transport(), out, in] {
      t->all_gather(out, in);
    });
  }

  Work all_gather_into_new(std::function<at::Tensor()> make_out, at::Tensor in, const CollectiveOptions& o) override {
    const CommOp op = CommOp::kAllGather;
    check_tensor(op, in, "input");
    HP_CHECK(make_out != nullptr, where(op), "no function to make the output");
    if (!in.device().is_cpu() || copies_without_cpu()) return all_gather(make_out(), in, o);
    return enqueue(op, o.timeout, in.nbytes(), nbytes(in) * (size() - 1),
                   [t = transport(), make_out = std::move(make_out), in, n = size()] {
      const at::Tensor out = make_out();
      HP_CHECK(out.defined() && out.scalar_type() == in.scalar_type() && out.device() == in.device() &&
                   out.is_contiguous() && out.numel() == in.numel() * n,
               "all_gather: the output made when the op started is ",
               out.defined() ? describe(out) : std::string("undefined"), ", not ", in.numel() * n, " contiguous ",
               in.scalar_type(), " elements on ", in.device(), " (input ", in.numel(), " x ", n, " ranks)");
      t->all_gather(out, in);
    });
  }

  Work reduce_scatter(at::Tensor out, at::Tensor in, const ReduceOptions& o) override {
    const CommOp op = CommOp::kReduceScatter;
    check_tensor(op, out, "output");
    check_tensor(op, in, "input");
    check_same_dtype(op, out, in);
    check_reduce_op(op, o.op, in);
    HP_CHECK(in.numel() == out.numel() * size(), where(op), "input has ", in.numel(),
             " elements but must have ", out.numel() * size(), " (output ", out.numel(),
             " x ", size(), " ranks)");
    ReduceOp rop = o.op;
    int n = size();
    return enqueue(op, o.timeout, in.nbytes(), nbytes(in) * (n - 1) / n, [t = transport(), out, in, rop, n] {
      t->reduce_scatter(out, in, rop == ReduceOp::AVG ? ReduceOp::SUM : rop);
      if (rop == ReduceOp::AVG) out.div_(n);
    });
  }

  Work all_reduce(at::Tensor x, const ReduceOptions& o) override {
    const CommOp op = CommOp::kAllReduce;
    check_tensor(op, x, "tensor");
    check_reduce_op(op, o.op, x);
    ReduceOp rop = o.op;
    int n = size();
    return enqueue(op, o.timeout, x.nbytes(), nbytes(x) * 2 * (n - 1) / n, [t = transport(), x, rop, n] {
      t->all_reduce(x, rop == ReduceOp::AVG ? ReduceOp::SUM : rop);
      if (rop == ReduceOp::AVG) x.div_(n);
    });
  }

  Work broadcast(at::Tensor x, int root, const CollectiveOptions& o) override {
    const CommOp op = CommOp::kBroadcast;
    check_tensor(op, x, "tensor");
    check_peer(op, root, "root", /*allow_self=*/true);
    return enqueue(op, o.timeout, x.nbytes(), nbytes(x) * (size() - 1) / size(), [t = transport(), x, root] {
      t->broadcast(x, root);
    });
  }

  Work all_to_all(at::Tensor out, at::Tensor in, const AllToAllOptions& o) override {
    const CommOp op = CommOp::kAllToAll;
    check_tensor(op, out, "output");
    check_tensor(op, in, "input");
    check_same_dtype(op, out, in);
    HP_CHECK(out.dim() >= 1 && in.dim() >= 1, where(op),
             "input and output need at least one dim, got ", describe(in), " and ",
             describe(out));
    HP_CHECK(out.sizes().slice(1) == in.sizes().slice(1), where(op),
             "input and output must match in all dims but the first, got ", in.sizes(),
             " and ", out.sizes());
    int64_t row = 1;
    for (int64_t d = 1; d < in.dim(); ++d) row *= in.size(d);
    std::vector<int64_t> out_counts, in_counts;
    const int n = size();
    const bool equal_splits = o.input_split_sizes.empty() && o.output_split_sizes.empty();
    if (equal_splits) {
      HP_CHECK(in.size(0) % n == 0 && out.size(0) % n == 0, where(op),
               "equal splits need dim 0 divisible by the group size ", n, ", got input ",
               in.size(0), " and output ", out.size(0), " (pass split sizes for uneven splits)");
      HP_CHECK(in.size(0) == out.size(0), where(op),
               "equal splits need input and output of the same dim 0, got ", in.size(0),
               " and ", out.size(0));
      in_counts.assign(n, in.size(0) / n * row);
      out_counts = in_counts;
    } else {
      check_splits(op, o.input_split_sizes, in, "input_split_sizes");
      check_splits(op, o.output_split_sizes, out, "output_split_sizes");
      for (int i = 0; i < n; ++i) {
        in_counts.push_back(o.input_split_sizes[i] * row);
        out_counts.push_back(o.output_split_sizes[i] * row);
      }
    }
    const int64_t to_others = (in.numel() - in_counts[static_cast<size_t>(rank())]) * in.element_size();
    return enqueue(op, o.timeout, in.nbytes(), to_others, [t = transport(), out, in, out_counts, in_counts, equal_splits] {
      t->all_to_all(out, in, out_counts, in_counts, equal_splits);
    });
  }

  Work send(at::Tensor x, int dst, const PointToPointOptions& o) override {
    const CommOp op = CommOp::kSend;
    check_tensor(op, x, "tensor");
    check_peer(op, dst, "destination", /*allow_self=*/false);
    HP_CHECK(o.tag >= 0 && o.tag < (1 << 20), where(op), "tag ", o.tag,
             " out of range [0, 1048576)");
    int tag = o.tag;
    return enqueue(op, o.timeout, x.nbytes(), nbytes(x), [t = transport(), x, dst, tag] {
      t->send(x, dst, tag);
    });
  }

  Work recv(at::Tensor x, int src, const PointToPointOptions& o) override {
    const CommOp op = CommOp::kRecv;
    check_tensor(op, x, "tensor");
    check_peer(op, src, "source", /*allow_self=*/false);
    HP_CHECK(o.tag >= 0 && o.tag < (1 << 20), where(op), "tag ", o.tag,
             " out of range [0, 1048576)");
    int tag = o.tag;
    return enqueue(op, o.timeout, x.nbytes(), 0, [t = transport(), x, src, tag] {
      t->recv(x, src, tag);
    });
  }

  Work batch_send_recv(std::vector<P2POp> ops, const CollectiveOptions& o) override {
    const CommOp op = CommOp::kBatchSendRecv;
    int64_t bytes = 0, sent = 0;
    for (const auto& x : ops) {
      const bool send = x.kind == P2POp::kSend;
      if (send) sent += nbytes(x.tensor);
      check_tensor(op, x.tensor, send ? "send tensor" : "receive tensor");
      check_peer(op, x.peer, send ? "destination" : "source", /*allow_self=*/false);
      HP_CHECK(x.tag >= 0 && x.tag < 32768, where(op), "tag ", x.tag, " out of range [0, 32768)");
      bytes += x.tensor.nbytes();
    }
    std::sort(ops.begin(), ops.end(), [](const P2POp& a, const P2POp& b) {
      return std::make_tuple(a.tag, static_cast<int>(a.kind), a.peer) < std::make_tuple(b.tag, static_cast<int>(b.kind), b.peer);
    });
    for (size_t i = 1; i < ops.size(); ++i) {
      HP_CHECK(ops[i].tag != ops[i - 1].tag || ops[i].kind != ops[i - 1].kind || ops[i].peer != ops[i - 1].peer,
               where(op), "two ", ops[i].kind == P2POp::kSend ? "sends to" : "receives from", " rank ", ops[i].peer,
               " with tag ", ops[i].tag, " in one batch (their matching would be ambiguous)");
    }
    return enqueue(op, o.timeout, bytes, sent, [t = transport(), ops = std::move(ops)] {
      if (!ops.empty()) t->batch_send_recv(ops);
    });
  }

  Work barrier(const CollectiveOptions& o) override {
    return enqueue(CommOp::kBarrier, o.timeout, 0, 0, [t = transport()] { t->barrier(); });
  }

  CommPtr split(int color, int key, const CommOptions& o) override {
    auto result = std::make_shared<std::unique_ptr<Transport>>();
    enqueue(CommOp::kSplit, o.timeout, 0, 0, [t = transport(), result, color, key] {
      *result = t->split(color, key);
    }).wait();
    if (!*result) return nullptr;
    std::string name = o.name.empty() ? str_cat(cs_->name, "/split", color) : o.name;
    return make_queued_communicator(std::move(*result), name,
                                    CommOptions{o.timeout.count() > 0 ? o.timeout : timeout_, name}, account_);
  }

  CommPtr new_group(const std::vector<int>& ranks, const CommOptions& o) override {
    const CommOp op = CommOp::kNewGroup;
    HP_CHECK(!ranks.empty(), where(op), "the rank list is empty");
    std::vector<int> seen(size(), 0);
    bool member = false;
    for (int r : ranks) {
      HP_CHECK(r >= 0 && r < size(), where(op), "rank ", r, " is not in [0, ", size(), ")");
      HP_CHECK(!seen[r]++, where(op), "rank ", r, " is listed twice");
      member |= (r == rank());
    }
    HP_CHECK(member, where(op), "this rank (", rank(),
             ") is not in the rank list: only the listed ranks call new_group");
    auto result = std::make_shared<std::unique_ptr<Transport>>();
    enqueue(op, o.timeout, 0, 0, [t = transport(), result, ranks] {
      *result = t->create_group(ranks);
    }).wait();
    std::string name = o.name;
    if (name.empty()) {
      name = cs_->name + "/group[";
      for (size_t i = 0; i < ranks.size(); ++i) name += (i ? "," : "") + std::to_string(ranks[i]);
      name += "]";
    }
    return make_queued_communicator(std::move(*result), name,
                                    CommOptions{o.timeout.count() > 0 ? o.timeout : timeout_, name}, account_);
  }

 private:
  Transport* transport() const { return cs_->transport.get(); }

  std::string where(CommOp op) const {
    return str_cat("[rank ", rank(), "] ", to_string(op), " on group '", cs_->name, "': ");
  }

  void check_tensor(CommOp op, const at::Tensor& t, const char* what) const {
    HP_CHECK(t.defined(), where(op), what, " is an undefined tensor");
    HP_CHECK(cs_->transport->supports_device(t.device()), where(op), what, " is on ",
             t.device(), ", which the ", backend_, " backend does not support");
    HP_CHECK(supported_dtype(t.scalar_type()), where(op), "not supported yet: ", what,
             " dtype ", t.scalar_type(),
             " (supported: float32, float64, bfloat16, float16, int32, int64, uint8, bool)");
    HP_CHECK(t.is_contiguous(), where(op), what, " is not contiguous (sizes ", t.sizes(),
             ", strides ", t.strides(), "); pass .contiguous()");
  }

  void check_same_dtype(CommOp op, const at::Tensor& out, const at::Tensor& in) const {
    HP_CHECK(out.scalar_type() == in.scalar_type(), where(op), "output dtype ",
             out.scalar_type(), " does not match input dtype ", in.scalar_type());
  }

  void check_reduce_op(CommOp op, ReduceOp r, const at::Tensor& t) const {
    auto dt = t.scalar_type();
    if (dt == at::kBool) {
      HP_CHECK(r == ReduceOp::MAX || r == ReduceOp::MIN, where(op), "reduce op ",
               to_string(r), " is not defined for bool tensors (use max = or, min = and)");
    }
    HP_CHECK(!(r == ReduceOp::AVG && is_integral_or_bool(dt)), where(op),
             "reduce op avg is not supported for ", dt,
             " tensors (the average would be truncated); use sum and divide in floating point");
  }

  void check_peer(CommOp op, int peer, const char* what, bool allow_self) const {
    HP_CHECK(peer >= 0 && peer < size(), where(op), what, " rank ", peer, " is not in [0, ",
             size(), ")");
    HP_CHECK(allow_self || peer != rank(), where(op), what, " rank ", peer,
             " is this rank: sending to itself is not supported");
  }

  void check_splits(CommOp op, const std::vector<int64_t>& s, const at::Tensor& t,
                    const char* what) const {
    HP_CHECK(static_cast<int>(s.size()) == size(), where(op), what, " has ", s.size(),
             " entries, the group has ", size(), " ranks");
    int64_t sum = 0;
    for (int64_t v : s) {
      HP_CHECK(v >= 0, where(op), what, " has a negative entry ", v);
      sum += v;
    }
    HP_CHECK(sum == t.size(0), where(op), what, " sum to ", sum, " rows but the tensor has ",
             t.size(0));
  }

  // `bytes`: the op's size for the trace; `sent`: what this rank sends (traffic()).
  Work enqueue(CommOp op, Timeout timeout, int64_t bytes, int64_t sent, std::function<void()> fn) {
    HP_CHECK(timeout.count() >= 0, where(op), "timeout ", timeout.count(), " ms is negative");
    auto ws = std::make_shared<WorkState>();
    ws->op = op;
    ws->timeout = timeout.count() > 0 ? timeout : timeout_;
    ws->issue_us = trace::enabled() ? trace::now_us() : 0;
    ws->bytes = bytes;
    ws->comm = cs_;
    ws->run = std::move(fn);
    std::lock_guard<std::mutex> g(cs_->mu);
    ws->seq = cs_->next_seq++;
    if (cs_->broken) cs_->raise_broken(*ws);
    HP_CHECK(!cs_->stop, where(op), "the communicator was shut down (hp::finalize ran)");
    if (!cs_->worker.joinable()) cs_->worker = std::thread(worker_loop, cs_);
    cs_->transport->on_enqueue();
    if (op != CommOp::kSplit && op != CommOp::kNewGroup) {
      account_->ops.fetch_add(1, std::memory_order_relaxed);
      account_->bytes_sent.fetch_add(sent, std::memory_order_relaxed);
    }
    cs_->queue.push_back(ws);
    cs_->enqueued.fetch_add(1);
    cs_->work_cv.notify_one();
    return Work(ws);
  }

  std::shared_ptr<CommShared> cs_;
  Timeout timeout_;
  std::shared_ptr<TrafficAccount> account_;
  std::vector<int> world_ranks_;
  std::string backend_;
};

}  // namespace

CommPtr make_queued_communicator(std::unique_ptr<Transport> t, const std::string& name,
                                 const CommOptions& o, std::shared_ptr<TrafficAccount> account) {
  Timeout timeout = o.timeout;
  if (timeout.count() <= 0) {
    double s = env::get_double("HP_COMM_TIMEOUT_S");
    HP_CHECK(s > 0, "HP_COMM_TIMEOUT_S=", s, " must be positive");
    timeout = Timeout(static_cast<int64_t>(s * 1000));
  }
  if (!o.simulated_network.empty()) t = make_simulated_transport(std::move(t), SimulatedNetwork::parse(o.simulated_network));
  {
    std::lock_guard<std::mutex> g(wrapper_mu());
    if (wrapper()) t = wrapper()(std::move(t), name);
  }
  if (!account) account = std::make_shared<TrafficAccount>();
  return std::make_shared<QueuedCommunicator>(std::move(t), name, timeout, std::move(account));
}

TransportWrapper set_transport_wrapper(TransportWrapper w) {
  std::lock_guard<std::mutex> g(wrapper_mu());
  std::swap(w, wrapper());
  return w;
}

bool shutdown_all_communicators(std::chrono::milliseconds grace) {
  std::vector<std::shared_ptr<CommShared>> live;
  {
    std::lock_guard<std::mutex> g(g_registry_mu);
    for (auto& w : g_registry) {
      if (auto s = w.lock()) live.push_back(std::move(s));
    }
    g_registry.clear();
  }
  bool clean = true;
  for (auto& cs : live) clean &= stop_worker(*cs, grace);
  return clean;
}

}  // namespace detail

CommPtr make_local_communicator(const CommOptions& o) {
  return detail::make_queued_communicator(detail::make_local_transport(),
                                          o.name.empty() ? "world" : o.name, o);
}

}  // namespace hp
