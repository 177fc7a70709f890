// Private: the synchronous transport under a queued Communicator.
//
// A Transport moves bytes for one group. Every method is called only from its
// communicator's worker thread, after the arguments were validated, and blocks until
// done. Reductions arrive as SUM, MAX or MIN (AVG is done above). Errors are raised as
// hp::Error; the caller adds rank, op, group and sequence number.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/comm/simulated_network.h"
#include "hp/config.h"

namespace hp::detail {

// The number of threads of this process blocked in Work::wait or wait_for (any
// communicator). While one is, the rank's training thread is not computing: a backend may
// spin on an op rather than leave the core.
int threads_in_wait();

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string backend() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::vector<int> world_ranks() const = 0;
  virtual bool supports_device(const c10::Device& d) const = 0;
  // Communicator::control_device.
  virtual c10::Device control_device() const { return c10::kCPU; }
  // Communicator::copies_without_cpu.
  virtual bool copies_without_cpu() const { return false; }

  virtual void all_gather(const at::Tensor& out, const at::Tensor& in) = 0;
  virtual void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) = 0;
  virtual void all_reduce(const at::Tensor& t, ReduceOp op) = 0;
  virtual void broadcast(const at::Tensor& t, int root) = 0;
  // Counts in elements, one per rank. `equal_splits`: the caller gave no split sizes, so
  // every rank of the group sends the same count to every rank (a property all ranks share;
  // uneven split sizes that happen to be equal on one rank are not, and a backend must not
  // pick a different collective there than on the others).
  virtual void all_to_all(const at::Tensor& out, const at::Tensor& in,
                          const std::vector<int64_t>& out_counts,
                          const std::vector<int64_t>& in_counts, bool equal_splits) = 0;
  virtual void send(const at::Tensor& t, int dst, int tag) = 0;
  virtual void recv(const at::Tensor& t, int src, int tag) = 0;
  // Ops already validated (distinct (peer, tag, kind), sorted by (tag, kind, peer)).
  virtual void batch_send_recv(const std::vector<P2POp>& ops) = 0;
  virtual void barrier() = 0;
  virtual std::unique_ptr<Transport> split(int color, int key) = 0;
  virtual std::unique_ptr<Transport> create_group(const std::vector<int>& ranks) = 0;
  // Called when an op timed out while inside this transport: its resources may be in use
  // by a call that never returns, so the destructor must not release them.
  virtual void abandon() {}

  // Out-of-band progress, to name the peers of a collective that timed out. The worker
  // calls note_started(k) as it starts the communicator's k-th collective (send/recv not
  // counted); behind(k, &unknown), called from any thread while a collective hangs,
  // returns the group ranks seen not to have started collective k, without any call
  // that could block, and sets `unknown` to the number of other ranks whose progress
  // cannot be seen. Defaults: nothing seen.
  virtual void note_started(uint64_t collective) {}
  virtual std::vector<int> behind(uint64_t collective, int* unknown) const {
    *unknown = size() - 1;
    return {};
  }

  // Stream-ordered backends (nccl) hook the op's life here; the defaults do nothing.
  // on_enqueue: on the caller's thread, under the queue's lock, once per op in issue
  // order (nccl records an event on the caller's current stream: the op must run after
  // the work that produced its inputs). run_op: on the worker thread, runs the op (its
  // body, AVG's division included) and returns once the op has completed (nccl: the
  // op's stream passed a completion event), so the op's tensors may then be dropped.
  // skip_op: an op dropped without running (the communicator broke before it).
  virtual void on_enqueue() {}
  virtual void run_op(const std::function<void()>& body) { body(); }
  virtual void skip_op() {}
  // Extra fields for the trace span of the op run_op last ran (",\"key\":value..."), or "".
  virtual std::string trace_note() const { return ""; }
};

// The base of decorators (the simulated network, tests' fault injection): runs every op on
// `inner` after calling before(op, bytes) (bytes: what the op moves, as the link model
// counts them; split and new_group call it with 0), and forwards the rest. A split or group
// is the inner transport's child, passed through wrap_child (default: returned as it is).
class TransportDecorator : public Transport {
 public:
  explicit TransportDecorator(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}

  std::string backend() const override { return inner_->backend(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::vector<int> world_ranks() const override { return inner_->world_ranks(); }
  bool supports_device(const c10::Device& d) const override { return inner_->supports_device(d); }
  c10::Device control_device() const override { return inner_->control_device(); }
  bool copies_without_cpu() const override { return inner_->copies_without_cpu(); }

  void all_gather(const at::Tensor& out, const at::Tensor& in) override {
    before(CommOp::kAllGather, static_cast<int64_t>(out.nbytes()));
    inner_->all_gather(out, in);
  }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    before(CommOp::kReduceScatter, static_cast<int64_t>(in.nbytes()));
    inner_->reduce_scatter(out, in, op);
  }
  void all_reduce(const at::Tensor& t, ReduceOp op) override {
    before(CommOp::kAllReduce, static_cast<int64_t>(t.nbytes()));
    inner_->all_reduce(t, op);
  }
  void broadcast(const at::Tensor& t, int root) override {
    before(CommOp::kBroadcast, static_cast<int64_t>(t.nbytes()));
    inner_->broadcast(t, root);
  }
  void all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_counts,
                  const std::vector<int64_t>& in_counts, bool equal_splits) override {
    before(CommOp::kAllToAll, static_cast<int64_t>(in.nbytes()));
    inner_->all_to_all(out, in, out_counts, in_counts, equal_splits);
  }
  void send(const at::Tensor& t, int dst, int tag) override {
    before(CommOp::kSend, static_cast<int64_t>(t.nbytes()));
    inner_->send(t, dst, tag);
  }
  void recv(const at::Tensor& t, int src, int tag) override {
    before(CommOp::kRecv, static_cast<int64_t>(t.nbytes()));
    inner_->recv(t, src, tag);
  }
  void batch_send_recv(const std::vector<P2POp>& ops) override {
    int64_t sent = 0, received = 0;
    for (const auto& o : ops) (o.kind == P2POp::kSend ? sent : received) += static_cast<int64_t>(o.tensor.nbytes());
    before(CommOp::kBatchSendRecv, std::max(sent, received));
    inner_->batch_send_recv(ops);
  }
  void barrier() override {
    before(CommOp::kBarrier, 0);
    inner_->barrier();
  }
  std::unique_ptr<Transport> split(int color, int key) override {
    before(CommOp::kSplit, 0);
    auto child = inner_->split(color, key);
    return child ? wrap_child(std::move(child)) : nullptr;
  }
  std::unique_ptr<Transport> create_group(const std::vector<int>& ranks) override {
    before(CommOp::kNewGroup, 0);
    return wrap_child(inner_->create_group(ranks));
  }
  void abandon() override { inner_->abandon(); }
  void note_started(uint64_t collective) override { inner_->note_started(collective); }
  std::vector<int> behind(uint64_t collective, int* unknown) const override {
    return inner_->behind(collective, unknown);
  }
  void on_enqueue() override { inner_->on_enqueue(); }
  void run_op(const std::function<void()>& body) override { inner_->run_op(body); }
  void skip_op() override { inner_->skip_op(); }
  std::string trace_note() const override { return inner_->trace_note(); }

 protected:
  virtual void before(CommOp op, int64_t bytes) {}
  virtual std::unique_ptr<Transport> wrap_child(std::unique_ptr<Transport> child) { return child; }

  std::unique_ptr<Transport> inner_;
};

// `inner` under a simulated network (hp/comm/simulated_network.h): every op, and every
// group split from it, held until the modelled link would have finished it.
std::unique_ptr<Transport> make_simulated_transport(std::unique_ptr<Transport> inner, const SimulatedNetwork& net);

// A test seam (the LevelDB fault-injection Env's idea): a function that wraps the
// transport of every communicator created after it is set, given the communicator's name
// (a group split from a wrapped one is wrapped again under its own name, once: a wrapper's
// split and create_group return the inner transport's child unwrapped). Tests install a
// fault-injecting decorator here (tests/comm/fault_injection.h); nothing in the library or
// hp-train sets it, and no environment variable reaches it. Set it while no communicator
// is being created (before the communicators it should see); returns the previous one.
using TransportWrapper = std::function<std::unique_ptr<Transport>(std::unique_ptr<Transport>, const std::string& name)>;
TransportWrapper set_transport_wrapper(TransportWrapper w);

// The account of a communicator's traffic (Communicator::traffic), shared with the groups
// split or made from it.
struct TrafficAccount {
  std::atomic<int64_t> ops{0};
  std::atomic<int64_t> bytes_sent{0};
};

// Wraps a transport in the queued, validated, traced Communicator. `account`: the parent's
// for a split or group; null for a world (a new account).
CommPtr make_queued_communicator(std::unique_ptr<Transport> t, const std::string& name,
                                 const CommOptions& o, std::shared_ptr<TrafficAccount> account = nullptr);

std::unique_ptr<Transport> make_local_transport();
#if HP_HAVE_MPI
std::unique_ptr<Transport> make_mpi_world_transport();
// Frees the mpi backend's progress table (collective over MPI_COMM_WORLD): at shutdown,
// after every communicator stopped and before MPI_Finalize.
void free_mpi_progress_table();
#endif
#if HP_HAVE_NCCL
// The world over NCCL for CUDA tensors. `share_id` gives every rank rank 0's 128-byte
// ncclUniqueId (an MPI broadcast, or a file store). The CUDA device is `device`.
std::unique_ptr<Transport> make_nccl_world_transport(int rank, int size, int device,
                                                     const std::function<void(void*, size_t)>& share_id);
#endif

// shutdown_all_communicators: comm/bootstrap.h.

}  // namespace hp::detail
