// hp::Communicator: the one interface hyperparallel uses for collectives.
//
// Contract
// - Every op is asynchronous: it validates its arguments on the calling thread (raising
//   hp::Error before anything is sent), then queues the op and returns a Work. Ops on one
//   communicator run on that communicator's own thread and complete in issue order, so
//   the caller's compute overlaps with them. Different communicators run independently.
// - All ranks of a communicator must issue the same collectives in the same order with
//   matching sizes and dtypes (as in MPI). A rank that does not raises TimeoutError on
//   its peers after the op's timeout.
// - Tensors: contiguous, on a device the backend supports (mpi and local: CPU), of
//   dtype float32, float64, bfloat16, float16, int32, int64, uint8 or bool. The op holds
//   references to its tensors until it completes; the caller must not write to an input,
//   or read or write an output, before the Work completes.
// - Reductions: SUM, AVG, MAX, MIN. AVG is SUM followed by division by the group size,
//   done by the library for every backend; it is rejected for integer and bool tensors
//   (its result would be truncated). SUM and AVG are rejected for bool; MAX and MIN of
//   bool are logical or / and. bfloat16 and float16 reductions compute each pairwise step
//   in float32 and round to nearest-even; every rank ends with bitwise identical results.
// - Errors carry rank, op, group and sequence number (hp::CommError). After a timeout the
//   communicator is unusable: later ops raise at once.
// - Thread safety: ops may be issued from any thread; they are ordered by issue.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/comm/ops.h"
#include "hp/comm/work.h"

namespace hp {

// 0 ms means "the communicator's default timeout".
using Timeout = std::chrono::milliseconds;

struct CollectiveOptions {
  Timeout timeout{0};
};

struct ReduceOptions {
  ReduceOp op = ReduceOp::SUM;
  Timeout timeout{0};
};

struct AllToAllOptions {
  // Rows (dim-0 slices) sent to / received from each rank. Both empty: equal splits
  // (dim 0 divisible by the group size). Otherwise both must be given, one entry per rank.
  std::vector<int64_t> output_split_sizes;
  std::vector<int64_t> input_split_sizes;
  Timeout timeout{0};
};

struct PointToPointOptions {
  int tag = 0;
  Timeout timeout{0};
};

// One send or receive of a batch_send_recv.
struct P2POp {
  enum Kind { kSend, kRecv };
  Kind kind = kSend;
  at::Tensor tensor;  // send: read; receive: written (its numel must match the send's)
  int peer = 0;       // rank in this communicator
  int tag = 0;        // [0, 32768): matches a send to a receive together with the peer
};

struct CommOptions {
  // Default timeout of the communicator's ops; 0 = HP_COMM_TIMEOUT_S.
  Timeout timeout{0};
  // Group name used in errors and traces; empty = derived from the parent.
  std::string name;
  // A simulated network spec (hp/comm/simulated_network.h) for a world communicator made
  // by a factory or hp::init; groups made from it inherit it. Empty: none (hp::init reads
  // HP_SIM_NET). Ignored by split and new_group.
  std::string simulated_network = {};
};

// What one rank has sent over a communicator (Communicator::traffic).
struct CommTraffic {
  int64_t ops = 0;         // ops issued: collectives, point-to-point, barriers (not split, new_group)
  int64_t bytes_sent = 0;  // bytes this rank sends to other ranks (below)
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group's name in errors and traces ("world"; a mesh names its groups by their dims,
  // "dp_shard" or "dp_replicate+dp_shard"; see CommOptions::name).
  virtual const std::string& name() const = 0;
  virtual std::string backend() const = 0;
  // Whether this backend moves tensors on `d` (mpi and local: CPU only).
  virtual bool supports_device(const c10::Device& d) const = 0;
  // Where it moves small control values (a loss, a flag, a count): the CPU for mpi and
  // local, its GPU for nccl (the device it was made on, whatever the calling thread's
  // current one).
  virtual c10::Device control_device() const = 0;
  // Whether its ops move bytes on a device (its copy engines and streams: nccl), not on a
  // CPU thread: they take no core from compute, and they are ordered on the device's stream,
  // so an output must exist when the op is issued. Asked instead of the backend's name.
  virtual bool copies_without_cpu() const = 0;
  // The world rank of each member, indexed by rank in this communicator.
  virtual const std::vector<int>& world_ranks() const = 0;
  virtual Timeout default_timeout() const = 0;
  // What this rank has sent on this communicator and on every group split or made from it
  // (they share one account), counted as each op is issued (one that later fails counts
  // too). The bytes are those this rank puts on its links under the bandwidth-optimal
  // algorithms over a group of n: all_gather (n-1) x its input; reduce_scatter (n-1)/n of
  // its input; all_reduce 2 (n-1)/n of the tensor; broadcast (n-1)/n of it (a chain's n-1
  // forwards shared out over the ranks); all_to_all the rows it sends to other ranks; send
  // and batch_send_recv's sends their tensors; recv and barrier none. A group of one sends
  // nothing. A trainer reads it before and after a phase for that phase's bytes.
  virtual CommTraffic traffic() const = 0;

  // out (size() * in.numel() elements, rank i's input at offset i * in.numel()).
  virtual Work all_gather(at::Tensor out, at::Tensor in, const CollectiveOptions& o = {}) = 0;
  // As all_gather, with the output made by `make_out` when the op starts: on the CPU that
  // is on the communicator's thread, after every op queued before it here has completed and
  // dropped its tensors, so a buffer that must not coexist with an earlier op's input (a
  // backward prefetch behind a reduce-scatter) exists only once that input is freed. On a
  // device, or with nccl, `make_out` runs here, now. It must return size() * in.numel()
  // elements of in's dtype on in's device (else the op fails, naming them); it runs once,
  // or never if the communicator broke first.
  virtual Work all_gather_into_new(std::function<at::Tensor()> make_out, at::Tensor in,
                                   const CollectiveOptions& o = {}) = 0;
  // in holds size() * out.numel() elements; rank i receives the reduction of slice i.
  virtual Work reduce_scatter(at::Tensor out, at::Tensor in, const ReduceOptions& o = {}) = 0;
  // In place.
  virtual Work all_reduce(at::Tensor t, const ReduceOptions& o = {}) = 0;
  // In place: root's t is copied to every rank's t.
  virtual Work broadcast(at::Tensor t, int root, const CollectiveOptions& o = {}) = 0;
  // Rank i's input rows [off_j, off_j + in_split[j]) go to rank j, which places them at
  // its output rows for rank i. Trailing dims of out and in must match.
  virtual Work all_to_all(at::Tensor out, at::Tensor in, const AllToAllOptions& o = {}) = 0;
  // Point-to-point; matched by (peer, tag) in issue order. A send may complete only when
  // the peer receives it: pairs of ranks exchanging in both directions must order their
  // calls (even ranks send first) or use separate communicators.
  virtual Work send(at::Tensor t, int dst, const PointToPointOptions& o = {}) = 0;
  virtual Work recv(at::Tensor t, int src, const PointToPointOptions& o = {}) = 0;
  // Point-to-point ops posted together and completed together: a pair of ranks exchanging
  // in both directions puts both directions in one batch on each side (a pipeline's
  // activation out, gradient in). Each send must meet a receive on its peer with the same
  // tag in a batch that peer issues; within a batch, at most one op per (peer, tag, kind).
  // The mpi backend posts every op nonblocking; nccl issues them in one group, sorted by
  // tag (so both sides issue matching ops in the same order). Empty: completes at once.
  virtual Work batch_send_recv(std::vector<P2POp> ops, const CollectiveOptions& o = {}) = 0;
  virtual Work barrier(const CollectiveOptions& o = {}) = 0;

  // Collective over all ranks of this communicator (it waits for earlier ops): ranks
  // with the same color >= 0 form a new communicator, ordered by key (ties by rank).
  // Returns nullptr on ranks that pass a negative color.
  virtual std::shared_ptr<Communicator> split(int color, int key, const CommOptions& o = {}) = 0;
  // Called by the listed ranks only, all with the same list (ranks of this communicator,
  // no duplicates); the new communicator's rank i is ranks[i]. Groups sharing members
  // must be created in the same order on every member.
  virtual std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks,
                                                  const CommOptions& o = {}) = 0;

 protected:
  Communicator() = default;
};

using CommPtr = std::shared_ptr<Communicator>;

// Factories. The local backend is a world of one rank, always available.
CommPtr make_local_communicator(const CommOptions& o = {});
// The mpi backend over MPI_COMM_WORLD; MPI must be initialized with MPI_THREAD_MULTIPLE
// (hp::init does this). Raises when the build has no MPI.
CommPtr make_mpi_world_communicator(const CommOptions& o = {});
bool mpi_available();

}  // namespace hp
