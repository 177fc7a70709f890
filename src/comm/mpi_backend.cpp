// The mpi backend: CPU tensors over MPI (OpenMPI), one duplicated MPI communicator per
// hp::Communicator, driven only by that communicator's worker thread.
//
// all_gather, broadcast, all_to_all, barrier and all_reduce call MPI's own collectives;
// bfloat16 / float16 reductions go through MPI user ops running our float32 kernels.
// reduce_scatter (every dtype), and the bf16/fp16 all_reduce of large buffers, run our
// ring: n-1 steps over point-to-point on a private duplicate communicator; each step
// receives its chunk in segments, two ahead, into cache-sized slots and reduces each
// segment as it lands, so the peer's data crosses main memory once. The ring fixes the
// reduction order
// (chunk c is accumulated from rank c+1 around to rank c), so its all_reduce (ring
// reduce-scatter + MPI_Allgatherv) is bitwise identical on every rank. OpenMPI's
// MPI_Reduce_scatter_block is not used: measured 3x slower here (BENCHMARKS.md).
// MPI's blocking calls spin. Each collective first waits, without spinning, until its
// peers on this node have started it (await_peers), so that a late peer costs no core.
#include "hp/config.h"

#include "hp/comm/communicator.h"
#include "hp/core/error.h"
#include "hp/core/hash.h"

#if HP_HAVE_MPI
#include <mpi.h>
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <map>
#include <tuple>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "hp/core/env.h"
#include "mpi_progress.h"
#include "reduce_kernels.h"
#include "transport.h"

namespace hp {
namespace detail {
namespace {

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  throw Error(str_cat(call, " failed: ", std::string(buf, len)));
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_C_BOOL;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;  // moved as bits; reduced by our kernels
    default: HP_INTERNAL_ASSERT(false, "no MPI type for ", t);
  }
  return MPI_DATATYPE_NULL;
}

bool reduced_by_mpi(at::ScalarType t) { return t != at::kBFloat16 && t != at::kHalf; }

MPI_Op mpi_op(ReduceOp op, at::ScalarType t) {
  bool b = t == at::kBool;
  switch (op) {
    case ReduceOp::SUM: return MPI_SUM;
    case ReduceOp::MAX: return b ? MPI_LOR : MPI_MAX;
    case ReduceOp::MIN: return b ? MPI_LAND : MPI_MIN;
    case ReduceOp::AVG: break;
  }
  HP_INTERNAL_ASSERT(false, "AVG reached the transport");
  return MPI_OP_NULL;
}

int as_count(int64_t n) {
  if (n > INT_MAX) HP_NOT_SUPPORTED("a message of ", n, " elements (MPI counts are int)");
  return static_cast<int>(n);
}

// MPI user ops for bfloat16 / float16 (moved as MPI_UINT16_T): inout = op(inout, in),
// computed by our kernels in float32 with round-to-nearest-even. Declared commutative:
// a + b and b + a round identically, so every rank of MPI_Allreduce gets the same bits.
template <at::ScalarType DT, ReduceOp OP>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_kernel(inout, inout, in, *len, DT, OP);
}

MPI_Op half_mpi_op(at::ScalarType dt, ReduceOp op) {
  static MPI_Op ops[2][3];
  static std::once_flag once;
  std::call_once(once, [] {
    mpi_check(MPI_Op_create(&half_op<at::kBFloat16, ReduceOp::SUM>, 1, &ops[0][0]), "MPI_Op_create");
    mpi_check(MPI_Op_create(&half_op<at::kBFloat16, ReduceOp::MAX>, 1, &ops[0][1]), "MPI_Op_create");
    mpi_check(MPI_Op_create(&half_op<at::kBFloat16, ReduceOp::MIN>, 1, &ops[0][2]), "MPI_Op_create");
    mpi_check(MPI_Op_create(&half_op<at::kHalf, ReduceOp::SUM>, 1, &ops[1][0]), "MPI_Op_create");
    mpi_check(MPI_Op_create(&half_op<at::kHalf, ReduceOp::MAX>, 1, &ops[1][1]), "MPI_Op_create");
    mpi_check(MPI_Op_create(&half_op<at::kHalf, ReduceOp::MIN>, 1, &ops[1][2]), "MPI_Op_create");
  });
  int i = dt == at::kBFloat16 ? 0 : 1;
  int j = op == ReduceOp::SUM ? 0 : op == ReduceOp::MAX ? 1 : 2;
  return ops[i][j];
}

bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

class MpiTransport final : public Transport {
 public:
  // Takes ownership of comm.
  explicit MpiTransport(MPI_Comm comm) : comm_(comm) {
    mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    mpi_check(MPI_Comm_dup(comm_, &ring_comm_), "MPI_Comm_dup");
    mpi_check(MPI_Comm_set_errhandler(ring_comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Group mine, world;
    mpi_check(MPI_Comm_group(comm_, &mine), "MPI_Comm_group");
    mpi_check(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group");
    std::vector<int> local(size_);
    world_ranks_.resize(size_);
    for (int i = 0; i < size_; ++i) local[i] = i;
    const int rc = MPI_Group_translate_ranks(mine, size_, local.data(), world, world_ranks_.data());
    MPI_Group_free(&mine);   // a failure to free a group handle leaks a handle, nothing more
    MPI_Group_free(&world);
    mpi_check(rc, "MPI_Group_translate_ranks");
    int64_t seg = env::get_int("HP_RS_SEGMENT_BYTES");
    HP_CHECK(seg >= 1024, "HP_RS_SEGMENT_BYTES=", seg, " must be at least 1024");
    segment_bytes_ = seg;
    std::tie(progress_slot_, progress_tag_) = ProgressTable::instance().slot_for(world_ranks_);
  }

  void note_started(uint64_t collective) override {
    collective_ = collective;
    ProgressTable::instance().started(progress_slot_, collective);
  }
  std::vector<int> behind(uint64_t collective, int* unknown) const override {
    std::vector<int> out;
    *unknown = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const int64_t c = ProgressTable::instance().count_of(world_ranks_[r], progress_slot_, progress_tag_);
      if (c < 0) {
        ++*unknown;
      } else if (static_cast<uint64_t>(c) < collective) {
        out.push_back(r);
      }
    }
    return out;
  }

  ~MpiTransport() override {
    std::free(scratch_);
    if (abandoned_ || mpi_finalized()) return;  // a stuck call may still use the comms
    MPI_Comm_free(&ring_comm_);
    MPI_Comm_free(&comm_);
  }

  std::string backend() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<int> world_ranks() const override { return world_ranks_; }
  bool supports_device(const c10::Device& d) const override { return d.is_cpu(); }
  void abandon() override { abandoned_ = true; }

  void all_gather(const at::Tensor& out, const at::Tensor& in) override {
    if (in.numel() == 0) return;
    MPI_Datatype t = mpi_type(in.scalar_type());
    int c = as_count(in.numel());
    await_peers();
    mpi_check(MPI_Allgather(in.data_ptr(), c, t, out.data_ptr(), c, t, comm_), "MPI_Allgather");
  }

  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    if (out.numel() == 0) return;
    await_peers();
    std::vector<int64_t> counts(size_, out.numel()), displs(size_);
    for (int i = 0; i < size_; ++i) displs[i] = i * out.numel();
    ring_reduce_scatter(static_cast<const char*>(in.data_ptr()),
                        static_cast<char*>(out.data_ptr()), counts, displs, in.scalar_type(),
                        op);
  }

  void all_reduce(const at::Tensor& x, ReduceOp op) override {
    if (x.numel() == 0 || size_ == 1) return;
    await_peers();
    at::ScalarType dt = x.scalar_type();
    const int64_t ring_from = size_ == 2 ? kHalfRingAllReduceBytesTwoRanks : kHalfRingAllReduceBytes;
    if (reduced_by_mpi(dt) || static_cast<int64_t>(x.nbytes()) < ring_from) {
      MPI_Op mop = reduced_by_mpi(dt) ? mpi_op(op, dt) : half_mpi_op(dt, op);
      mpi_check(MPI_Allreduce(MPI_IN_PLACE, x.data_ptr(), as_count(x.numel()), mpi_type(dt), mop,
                              comm_),
                "MPI_Allreduce");
      return;
    }
    // Ring reduce-scatter in place over near-equal chunks, then gather the chunks.
    std::vector<int64_t> counts(size_), displs(size_);
    int64_t base = x.numel() / size_, extra = x.numel() % size_, off = 0;
    for (int i = 0; i < size_; ++i) {
      counts[i] = base + (i < extra ? 1 : 0);
      displs[i] = off;
      off += counts[i];
    }
    char* p = static_cast<char*>(x.data_ptr());
    const size_t es = x.element_size();
    ring_reduce_scatter(p, p + displs[rank_] * es, counts, displs, dt, op);
    std::vector<int> ic(size_), id(size_);
    for (int i = 0; i < size_; ++i) {
      ic[i] = as_count(counts[i]);
      id[i] = as_count(displs[i]);
    }
    mpi_check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, p, ic.data(), id.data(),
                             mpi_type(dt), comm_),
              "MPI_Allgatherv");
  }

  void broadcast(const at::Tensor& x, int root) override {
    if (x.numel() == 0) return;
    await_peers();
    mpi_check(MPI_Bcast(x.data_ptr(), as_count(x.numel()), mpi_type(x.scalar_type()), root, comm_),
              "MPI_Bcast");
  }

  void all_to_all(const at::Tensor& out, const at::Tensor& in,
                  const std::vector<int64_t>& out_counts,
                  const std::vector<int64_t>& in_counts, bool equal_splits) override {
    await_peers();
    MPI_Datatype t = mpi_type(in.scalar_type());
    // MPI_Alltoall only when every rank takes this branch (the caller's equal splits):
    // counts that happen to be even on this rank alone would pair its MPI_Alltoall with the
    // others' MPI_Alltoallv and hang.
    if (equal_splits) {
      if (in_counts[0] == 0) return;
      int c = as_count(in_counts[0]);
      mpi_check(MPI_Alltoall(in.data_ptr(), c, t, out.data_ptr(), c, t, comm_), "MPI_Alltoall");
      return;
    }
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    int64_t so = 0, ro = 0;
    for (int i = 0; i < size_; ++i) {
      sc[i] = as_count(in_counts[i]);
      sd[i] = as_count(so);
      rc[i] = as_count(out_counts[i]);
      rd[i] = as_count(ro);
      so += in_counts[i];
      ro += out_counts[i];
    }
    mpi_check(MPI_Alltoallv(in.data_ptr(), sc.data(), sd.data(), t, out.data_ptr(), rc.data(),
                            rd.data(), t, comm_),
              "MPI_Alltoallv");
  }

  // Point-to-point ops are posted nonblocking and polled (poll_until): a receive posted
  // early (a pipeline's) waits on the communicator's thread without spinning on the core
  // the rank computes on, as MPI_Recv would.
  void send(const at::Tensor& x, int dst, int tag) override {
    MPI_Request req;
    mpi_check(MPI_Isend(x.data_ptr(), as_count(x.numel()), mpi_type(x.scalar_type()), dst, tag, comm_, &req),
              "MPI_Isend");
    poll(&req, nullptr);
  }

  void recv(const at::Tensor& x, int src, int tag) override {
    MPI_Status st;
    MPI_Datatype t = mpi_type(x.scalar_type());
    MPI_Request req;
    mpi_check(MPI_Irecv(x.data_ptr(), as_count(x.numel()), t, src, tag, comm_, &req), "MPI_Irecv");
    poll(&req, &st);
    int got = 0;
    mpi_check(MPI_Get_count(&st, t, &got), "MPI_Get_count");
    HP_CHECK(got == x.numel(), "received ", got, " elements from rank ", src,
             " but the receive tensor has ", x.numel());
  }

  // Cuts this thread's timer slack to 1 us (once), so that its short sleeps end when asked
  // rather than up to 50 us later.
  static void fine_sleeps() {
    static thread_local const bool done = prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
    (void)done;
  }
  // Polls `req` until it completes (poll_until).
  void poll(MPI_Request* req, MPI_Status* st) const {
    poll_until([&] {
      int done = 0;
      mpi_check(MPI_Test(req, &done, st ? st : MPI_STATUS_IGNORE), "MPI_Test");
      return done != 0;
    });
  }
  // Calls `done` until it returns true. Between calls it sleeps (growing from
  // kFirstPollSleep to kLastPollSleep), except while a thread of this process is blocked in
  // Work::wait on a node with a core per rank: the rank then has nothing else to run, and a
  // sleep would only add to the waiter's latency (up to kLastPollSleep per receive of a
  // pipeline schedule). Where ranks outnumber cores it always sleeps: a test without pause
  // would take the core of a rank that computes; and so does an op abandoned after a
  // timeout, for good.
  template <typename Done>
  void poll_until(Done done) const {
    fine_sleeps();
    const bool may_spin = !ProgressTable::instance().ranks_share_cores();
    auto sleep = kFirstPollSleep;
    while (!done()) {
      if (may_spin && !abandoned_ && threads_in_wait() > 0) {
        sleep = kFirstPollSleep;
        continue;
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, kLastPollSleep);
    }
  }
  static constexpr std::chrono::microseconds kFirstPollSleep{5}, kLastPollSleep{500};

  // Returns once every peer on this node has started the collective now running, per the
  // node's progress table; at once for a peer the table cannot see (on another node).
  // MPI's blocking calls spin, and a worker spinning on a peer that is still computing
  // takes a core from this rank's training thread, or from that peer, wherever a node has
  // fewer cores than threads. So the table is checked without pause only for the first
  // kSpin or while a thread of this process is blocked in Work::wait (the rank has nothing
  // else to run), otherwise between sleeps growing to kLastAwaitSleep; the worker's timer
  // slack is cut to 1 us so that those sleeps end when asked. The call that follows spins
  // only while the data moves. This relies on every rank of a communicator counting the
  // same collectives (the worker does not count new_group, which only its members call).
  void await_peers() const {
    fine_sleeps();
    // More ranks than cores: left to MPI's own wait, as before (OpenMPI yields in it on
    // such a node). A spin on the table there took the late peer's core, and sleeping on
    // it showed no gain (BENCHMARKS.md).
    if (ProgressTable::instance().ranks_share_cores()) return;
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    auto sleep = kFirstPollSleep;
    while (peer_behind()) {
      // An abandoned op (it timed out) waits here for good, sleeping, rather than spin.
      if (!abandoned_ && (threads_in_wait() > 0 || std::chrono::steady_clock::now() < spin_until)) continue;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, kLastAwaitSleep);
    }
  }
  // Whether a peer on this node is seen not to have started the collective now running.
  bool peer_behind() const {
    int unknown = 0;
    return collective_ > 0 && !behind(collective_, &unknown).empty();
  }
  static constexpr std::chrono::microseconds kSpin{100}, kLastAwaitSleep{200};
  uint64_t collective_ = 0;  // the collective now running (set by its worker thread)

  // Every op posted nonblocking, then polled as send and recv are.
  void batch_send_recv(const std::vector<P2POp>& ops) override {
    std::vector<MPI_Request> reqs(ops.size(), MPI_REQUEST_NULL);
    for (size_t i = 0; i < ops.size(); ++i) {
      const auto& o = ops[i];
      MPI_Datatype t = mpi_type(o.tensor.scalar_type());
      if (o.kind == P2POp::kSend) {
        mpi_check(MPI_Isend(o.tensor.data_ptr(), as_count(o.tensor.numel()), t, o.peer, o.tag, comm_, &reqs[i]),
                  "MPI_Isend");
      } else {
        mpi_check(MPI_Irecv(o.tensor.data_ptr(), as_count(o.tensor.numel()), t, o.peer, o.tag, comm_, &reqs[i]),
                  "MPI_Irecv");
      }
    }
    std::vector<MPI_Status> st(ops.size());
    poll_until([&] {
      int done = 0;
      mpi_check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, st.data()), "MPI_Testall");
      return done != 0;
    });
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind != P2POp::kRecv) continue;
      int got = 0;
      mpi_check(MPI_Get_count(&st[i], mpi_type(ops[i].tensor.scalar_type()), &got), "MPI_Get_count");
      HP_CHECK(got == ops[i].tensor.numel(), "received ", got, " elements from rank ", ops[i].peer, " (tag ",
               ops[i].tag, ") but the receive tensor has ", ops[i].tensor.numel());
    }
  }

  // Nonblocking and polled with growing sleeps: a rank that waits long at a barrier (for
  // another rank's single-process work, say) leaves the cores to the ranks that compute,
  // where MPI_Barrier would spin.
  void barrier() override {
    MPI_Request req;
    mpi_check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    auto sleep = std::chrono::microseconds(20);
    for (int done = 0;;) {
      mpi_check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(2000));
    }
  }

  std::unique_ptr<Transport> split(int color, int key) override {
    MPI_Comm nc = MPI_COMM_NULL;
    mpi_check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &nc),
              "MPI_Comm_split");
    if (nc == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiTransport>(nc);
  }

  std::unique_ptr<Transport> create_group(const std::vector<int>& ranks) override {
    MPI_Group g, ng;
    mpi_check(MPI_Comm_group(comm_, &g), "MPI_Comm_group");
    const int incl = MPI_Group_incl(g, static_cast<int>(ranks.size()), ranks.data(), &ng);
    if (incl != MPI_SUCCESS) MPI_Group_free(&g);
    mpi_check(incl, "MPI_Group_incl");
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = MPI_Comm_create_group(comm_, ng, /*tag=*/7301, &nc);
    MPI_Group_free(&ng);
    MPI_Group_free(&g);
    mpi_check(rc, "MPI_Comm_create_group");
    return std::make_unique<MpiTransport>(nc);
  }

 private:
  char* scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      std::free(scratch_);
      scratch_ = nullptr;
      HP_CHECK(posix_memalign(reinterpret_cast<void**>(&scratch_), 64, bytes) == 0,
               "cannot allocate ", bytes, " bytes of reduce-scatter scratch");
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  // Chunk c of `in` (counts[c] elements at displs[c]) is reduced over all ranks; rank r's
  // result lands in `out`. `out` may alias chunk r of `in`; `in` is otherwise not written.
  void ring_reduce_scatter(const char* in, char* out, const std::vector<int64_t>& counts,
                           const std::vector<int64_t>& displs, at::ScalarType dt, ReduceOp op) {
    const int n = size_, r = rank_;
    const int64_t es = static_cast<int64_t>(c10::elementSize(dt));
    if (n == 1) {
      if (out != in + displs[0] * es) std::memcpy(out, in + displs[0] * es, counts[0] * es);
      return;
    }
    const int64_t maxc = *std::max_element(counts.begin(), counts.end());
    int64_t seg = std::max<int64_t>(1, segment_bytes_ / es);
    seg = std::max<int64_t>(seg, (maxc + kMaxSegments - 1) / kMaxSegments);
    // Scratch: kWindow receive slots of one segment each, then (three ranks or more) two
    // chunk-sized accumulators that alternate as the partial sum travels the ring.
    const int64_t slot_bytes = seg * es;
    const int64_t acc_bytes = n > 2 ? maxc * es : 0;
    char* buf = scratch(kWindow * slot_bytes + 2 * acc_bytes);
    char* acc[2] = {buf + kWindow * slot_bytes, buf + kWindow * slot_bytes + acc_bytes};
    auto slot = [&](int64_t k) { return buf + (k % kWindow) * slot_bytes; };
    const int right = (r + 1) % n, left = (r - 1 + n) % n;
    const MPI_Datatype t = mpi_type(dt);
    std::vector<MPI_Request> sreq, rreq(kWindow);
    for (int s = 0; s < n - 1; ++s) {
      const int sc = ((r - s - 1) % n + n) % n;
      const int rc = ((r - s - 2) % n + n) % n;
      const char* sendp = s == 0 ? in + displs[sc] * es : acc[(s - 1) & 1];
      const char* own = in + displs[rc] * es;
      char* dst = (s == n - 2) ? out : acc[s & 1];
      sreq.clear();
      int tag = 0;
      for (int64_t off = 0; off < counts[sc]; off += seg, ++tag) {
        sreq.emplace_back();
        mpi_check(MPI_Isend(sendp + off * es, static_cast<int>(std::min(seg, counts[sc] - off)), t,
                            right, tag, ring_comm_, &sreq.back()),
                  "MPI_Isend");
      }
      // Receive at most kWindow segments ahead into cache-sized slots and reduce each as
      // soon as it lands, so the peer's data crosses main memory once.
      const int64_t nseg = (counts[rc] + seg - 1) / seg;
      auto post = [&](int64_t k) {
        int64_t cnt = std::min(seg, counts[rc] - k * seg);
        mpi_check(MPI_Irecv(slot(k), static_cast<int>(cnt), t, left, static_cast<int>(k),
                            ring_comm_, &rreq[k % kWindow]),
                  "MPI_Irecv");
      };
      for (int64_t k = 0; k < std::min<int64_t>(kWindow, nseg); ++k) post(k);
      for (int64_t k = 0; k < nseg; ++k) {
        mpi_check(MPI_Wait(&rreq[k % kWindow], MPI_STATUS_IGNORE), "MPI_Wait");
        int64_t off = k * seg, cnt = std::min(seg, counts[rc] - off);
        // partial from the ranks before us, then our own contribution
        // The final sum of a large chunk goes past the caches: its lines would only be read
        // in to be overwritten (16 MiB fp32 on 2 ranks: the reduction 1.6 -> 1.0 ms).
        reduce_kernel(dst + off * es, slot(k), own + off * es, cnt, dt, op,
                      /*streaming=*/s == n - 2 && counts[rc] * es >= kStreamingBytes);
        if (k + kWindow < nseg) post(k + kWindow);
      }
      if (!sreq.empty()) {
        mpi_check(MPI_Waitall(static_cast<int>(sreq.size()), sreq.data(), MPI_STATUSES_IGNORE),
                  "MPI_Waitall");
      }
    }
  }

  static constexpr int64_t kWindow = 2;  // receive segments in flight per ring step
  static constexpr int64_t kStreamingBytes = 4 << 20;  // chunks from which the sum is streamed
  // bf16/fp16 all_reduce: MPI_Allreduce with our op below this size, our ring above
  // (measured in comm_bench, BENCHMARKS.md). On two ranks MPI exchanges the whole buffer
  // once and each rank reduces all of it, which the ring does not beat below 32 MiB; from
  // three ranks MPI reduces the whole buffer in each of several rounds, and the ring, which
  // reduces (n-1)/n of it once, wins from 1 MiB (3 ranks, against the fp32 raw call: 1 MiB
  // 1.03x vs 0.95x, 4 MiB 1.14x vs 0.99x, 16 MiB 1.13x vs 0.73x; BENCHMARKS.md).
  static constexpr int64_t kHalfRingAllReduceBytesTwoRanks = 32 << 20;
  static constexpr int64_t kHalfRingAllReduceBytes = 1 << 20;
  static constexpr int64_t kMaxSegments = 8192;  // stays below MPI_TAG_UB (>= 32767)

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm ring_comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;
  int progress_slot_ = 0;         // this communicator in the ProgressTable
  uint64_t progress_tag_ = 0;
  int64_t segment_bytes_ = 0;
  char* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  std::atomic<bool> abandoned_{false};
};

}  // namespace

std::unique_ptr<Transport> make_mpi_world_transport() {
  int init = 0;
  mpi_check(MPI_Initialized(&init), "MPI_Initialized");
  HP_CHECK(init, "the mpi backend needs MPI initialized (call hp::init first)");
  int provided = 0;
  mpi_check(MPI_Query_thread(&provided), "MPI_Query_thread");
  HP_CHECK(provided == MPI_THREAD_MULTIPLE,
           "the mpi backend needs MPI_THREAD_MULTIPLE (MPI was initialized with level ",
           provided, ")");
  ProgressTable::create();
  MPI_Comm c;
  mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &c), "MPI_Comm_dup");
  return std::make_unique<MpiTransport>(c);
}

void free_mpi_progress_table() { ProgressTable::destroy(); }

}  // namespace detail

bool mpi_available() { return true; }

CommPtr make_mpi_world_communicator(const CommOptions& o) {
  return detail::make_queued_communicator(detail::make_mpi_world_transport(),
                                          o.name.empty() ? "world" : o.name, o);
}

}  // namespace hp

#else  // !HP_HAVE_MPI

namespace hp {
bool mpi_available() { return false; }
CommPtr make_mpi_world_communicator(const CommOptions&) {
  HP_NOT_SUPPORTED("the mpi backend: this build of hyperparallel has no MPI (HP_WITH_MPI=OFF "
                   "or no MPI found at configure time)");
}
}  // namespace hp

#endif
