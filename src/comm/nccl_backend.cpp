// The nccl Transport: collectives on CUDA tensors through NCCL (builds with HP_HAVE_NCCL).
//
// Ordering and lifetimes: when an op is issued, on_enqueue records an event on the
// caller's current stream of the device (the stream that produced the inputs). The
// worker thread then makes the transport's own stream wait for that event, launches the
// NCCL call (and AVG's division) on that stream, records a completion event and polls it
// (with the communicator's async error state) until the GPU is done. Only then does the
// op complete and release its tensors, so no buffer is freed while a stream may still
// use it and the caching allocator's record_stream is never needed. A Work that
// completed is therefore also complete on the GPU: its outputs may be read on any stream.
//
// The op is ordered after the caller's *current* stream only: inputs produced on another
// stream must be synchronized with it by the caller first.
//
// Timeouts: Work::wait raises TimeoutError and calls abandon(); the polling worker then
// aborts the NCCL communicator (ncclCommAbort), which ends the stuck kernel, and the
// communicator refuses every later op. The aborted op's tensors are never released (the
// transport keeps them, and is itself leaked): its stream may still touch them.
// Communicators made by split/new_group are blocking NCCL communicators; their creation
// is not interruptible by a timeout.
#include "hp/config.h"

#if HP_HAVE_NCCL

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>

#include "hp/core/error.h"
#include "transport.h"

namespace hp::detail {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(str_cat(what, " failed: ", cudaGetErrorString(e)));
}

void nccl_check(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return;
  const char* detail = comm ? ncclGetLastError(comm) : nullptr;
  throw Error(str_cat(what, " failed: ", ncclGetErrorString(r),
                      detail && *detail ? str_cat(" (", detail, ")") : std::string()));
}

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kBool: return ncclUint8;  // 0/1 bytes: MAX is "or", MIN is "and"
    default: throw Error(str_cat("dtype ", t, " is not supported by the nccl backend"));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return ncclSum;
    case ReduceOp::MAX: return ncclMax;
    case ReduceOp::MIN: return ncclMin;
    default: throw Error(str_cat("reduce op ", to_string(op), " reached the nccl transport"));
  }
}

// Closes an NCCL group if a call inside it throws.
struct GroupGuard {
  bool open = true;
  ~GroupGuard() {
    if (open) ncclGroupEnd();
  }
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(ncclComm_t comm, std::vector<int> world_ranks, int device)
      : comm_(comm), world_ranks_(std::move(world_ranks)), device_(device) {
    nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", comm_);
    nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount", comm_);
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device_));
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    cuda_check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
  }

  ~NcclTransport() override {
    if (abandoned_) return;  // aborted: a stuck call may still hold these; leak them
    // No throwing here (CUDA may already be shutting down at exit): errors are ignored.
    // In reverse order of creation: the events (made after the stream, as ops needed
    // them), the completion event, the stream, then the NCCL communicator the transport
    // was built on. Every op completed before it released its tensors, so the stream is
    // idle; it is synchronized anyway before anything it used goes.
    if (cudaSetDevice(device_) != cudaSuccess) return;
    cudaStreamSynchronize(stream_);
    for (auto it = issued_.rbegin(); it != issued_.rend(); ++it) cudaEventDestroy(*it);
    for (auto it = free_events_.rbegin(); it != free_events_.rend(); ++it) cudaEventDestroy(*it);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
    ncclCommDestroy(comm_);
  }

  std::string backend() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<int> world_ranks() const override { return world_ranks_; }
  bool supports_device(const c10::Device& d) const override { return d.is_cuda() && d.index() == device_; }
  c10::Device control_device() const override { return {c10::kCUDA, static_cast<c10::DeviceIndex>(device_)}; }
  bool copies_without_cpu() const override { return true; }

  void on_enqueue() override {
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device_));
    cudaEvent_t ev = take_event();
    cuda_check(cudaEventRecord(ev, c10::cuda::getCurrentCUDAStream(device_).stream()), "cudaEventRecord");
    std::lock_guard<std::mutex> lk(mu_);
    issued_.push_back(ev);
  }

  void skip_op() override { give_back(pop_issued()); }

  void run_op(const std::function<void()>& body) override {
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device_));
    cudaEvent_t ready = pop_issued();
    HP_INTERNAL_ASSERT(ready != nullptr, "nccl: an op runs without the event of its issue");
    cuda_check(cudaStreamWaitEvent(stream_, ready, 0), "cudaStreamWaitEvent");
    give_back(ready);  // the wait captured the recorded state; the event may be reused
    try {
      {
        c10::cuda::CUDAStreamGuard sg(
            c10::cuda::getStreamFromExternal(stream_, static_cast<c10::DeviceIndex>(device_)));
        body();
      }
      sync_stream();
    } catch (...) {
      // The stream may still use the op's tensors: keep them (the body holds them) forever.
      kept_alive_.push_back(body);
      throw;
    }
  }

  void abandon() override { abandoned_ = true; }

  void all_gather(const at::Tensor& out, const at::Tensor& in) override {
    nccl_check(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in.scalar_type()), comm_, stream_),
               "ncclAllGather", comm_);
  }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    nccl_check(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in.scalar_type()),
                                 nccl_op(op), comm_, stream_),
               "ncclReduceScatter", comm_);
  }
  void all_reduce(const at::Tensor& t, ReduceOp op) override {
    nccl_check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), nccl_op(op), comm_,
                             stream_),
               "ncclAllReduce", comm_);
  }
  void broadcast(const at::Tensor& t, int root) override {
    nccl_check(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), root, comm_, stream_),
               "ncclBroadcast", comm_);
  }
  void all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_counts,
                  const std::vector<int64_t>& in_counts, bool /*equal_splits: send/recv pairs either way*/) override {
    const ncclDataType_t t = nccl_type(in.scalar_type());
    const int64_t es = static_cast<int64_t>(in.element_size());
    auto* src = static_cast<char*>(in.data_ptr());
    auto* dst = static_cast<char*>(out.data_ptr());
    nccl_check(ncclGroupStart(), "ncclGroupStart", comm_);
    GroupGuard guard;
    int64_t in_off = 0, out_off = 0;
    for (int p = 0; p < size_; ++p) {
      if (in_counts[p] > 0) {
        nccl_check(ncclSend(src + in_off * es, in_counts[p], t, p, comm_, stream_), "ncclSend", comm_);
      }
      if (out_counts[p] > 0) {
        nccl_check(ncclRecv(dst + out_off * es, out_counts[p], t, p, comm_, stream_), "ncclRecv", comm_);
      }
      in_off += in_counts[p];
      out_off += out_counts[p];
    }
    guard.open = false;
    nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm_);
  }
  void send(const at::Tensor& t, int dst, int tag) override {
    check_tag(tag);
    nccl_check(ncclSend(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), dst, comm_, stream_), "ncclSend", comm_);
  }
  void recv(const at::Tensor& t, int src, int tag) override {
    check_tag(tag);
    nccl_check(ncclRecv(t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), src, comm_, stream_), "ncclRecv", comm_);
  }
  // One group; the ops arrive sorted by tag, so both sides issue matching ops in one order.
  void batch_send_recv(const std::vector<P2POp>& ops) override {
    nccl_check(ncclGroupStart(), "ncclGroupStart", comm_);
    GroupGuard guard;
    for (const auto& o : ops) {
      auto t = nccl_type(o.tensor.scalar_type());
      if (o.kind == P2POp::kSend) {
        nccl_check(ncclSend(o.tensor.data_ptr(), o.tensor.numel(), t, o.peer, comm_, stream_), "ncclSend", comm_);
      } else {
        nccl_check(ncclRecv(o.tensor.data_ptr(), o.tensor.numel(), t, o.peer, comm_, stream_), "ncclRecv", comm_);
      }
    }
    guard.open = false;
    nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm_);
  }
  void barrier() override {
    if (!barrier_buf_.defined()) {
      barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
    }
    all_reduce(barrier_buf_, ReduceOp::SUM);
  }

  std::unique_ptr<Transport> split(int color, int key) override {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclComm_t nc = nullptr;
    nccl_check(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &nc, &cfg), "ncclCommSplit", comm_);
    if (nc == nullptr) return nullptr;  // this rank is in no group
    // Every member learns the world ranks of the new group from the others.
    at::Tensor mine = at::full({1}, world_ranks_[rank_], at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
    auto t = std::make_unique<NcclTransport>(nc, std::vector<int>{}, device_);
    at::Tensor all = at::empty({t->size_}, mine.options());
    nccl_check(ncclAllGather(mine.data_ptr(), all.data_ptr(), 1, ncclInt32, nc, stream_), "ncclAllGather", nc);
    sync_stream();
    at::Tensor host = all.cpu();
    t->world_ranks_.assign(host.data_ptr<int>(), host.data_ptr<int>() + t->size_);
    return t;
  }

  // Only the listed ranks call new_group, so ncclCommSplit (collective over the whole
  // parent) cannot serve: ranks[0] makes a unique id and sends it to the other members
  // over the parent (point-to-point involves only the two ranks), then the members
  // create the group's communicator together.
  std::unique_ptr<Transport> create_group(const std::vector<int>& ranks) override {
    int index = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == rank_) index = static_cast<int>(i);
    }
    HP_CHECK(index >= 0, "new_group: rank ", rank_, " is not in the group it creates");
    ncclUniqueId id;
    at::Tensor buf = at::empty({static_cast<int64_t>(sizeof id)},
                               at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_));
    if (index == 0) {
      nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      cuda_check(cudaMemcpyAsync(buf.data_ptr(), &id, sizeof id, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
      nccl_check(ncclGroupStart(), "ncclGroupStart", comm_);
      for (size_t i = 1; i < ranks.size(); ++i) {
        nccl_check(ncclSend(buf.data_ptr(), sizeof id, ncclUint8, ranks[i], comm_, stream_), "ncclSend", comm_);
      }
      nccl_check(ncclGroupEnd(), "ncclGroupEnd", comm_);
      sync_stream();
    } else {
      nccl_check(ncclRecv(buf.data_ptr(), sizeof id, ncclUint8, ranks[0], comm_, stream_), "ncclRecv", comm_);
      sync_stream();
      cuda_check(cudaMemcpy(&id, buf.data_ptr(), sizeof id, cudaMemcpyDeviceToHost), "cudaMemcpy");
    }
    ncclComm_t nc = nullptr;
    nccl_check(ncclCommInitRank(&nc, static_cast<int>(ranks.size()), id, index), "ncclCommInitRank");
    std::vector<int> world;
    for (int r : ranks) world.push_back(world_ranks_[r]);
    return std::make_unique<NcclTransport>(nc, std::move(world), device_);
  }

 private:
  static void check_tag(int tag) {
    if (tag != 0) {
      throw Error(str_cat("send/recv tag ", tag,
                          " is not supported yet by the nccl backend (NCCL matches point-to-point "
                          "messages by issue order; use tag 0)"));
    }
  }

  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_events_.empty()) {
        cudaEvent_t e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return e;
  }
  void give_back(cudaEvent_t e) {
    if (e == nullptr) return;
    std::lock_guard<std::mutex> lk(mu_);
    free_events_.push_back(e);
  }
  cudaEvent_t pop_issued() {
    std::lock_guard<std::mutex> lk(mu_);
    if (issued_.empty()) return nullptr;
    cudaEvent_t e = issued_.front();
    issued_.pop_front();
    return e;
  }

  // Records the completion event on the transport's stream and waits for it.
  void sync_stream() {
    cuda_check(cudaEventRecord(done_, stream_), "cudaEventRecord");
    wait_done();
  }

  // Polls the completion event: spins briefly, then sleeps up to 100 us between checks.
  void wait_done() {
    auto sleep = std::chrono::microseconds(1);
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    for (;;) {
      cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) cuda_check(q, "cudaEventQuery");
      ncclResult_t async = ncclSuccess;
      nccl_check(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError", comm_);
      if (async != ncclSuccess && async != ncclInProgress) {
        ncclCommAbort(comm_);
        abandoned_ = true;
        nccl_check(async, "NCCL (asynchronous error)");
      }
      if (abandoned_) {
        ncclCommAbort(comm_);
        throw Error("the op timed out and the NCCL communicator was aborted");
      }
      if (std::chrono::steady_clock::now() >= spin_until) {
        std::this_thread::sleep_for(sleep);
        sleep = std::min(sleep * 2, std::chrono::microseconds(100));
      }
    }
  }

  ncclComm_t comm_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  std::mutex mu_;
  std::deque<cudaEvent_t> issued_;
  std::vector<cudaEvent_t> free_events_;
  std::atomic<bool> abandoned_{false};
  at::Tensor barrier_buf_;
  std::vector<std::function<void()>> kept_alive_;  // ops that failed mid-stream (see run_op)
};

}  // namespace

std::unique_ptr<Transport> make_nccl_world_transport(int rank, int size, int device,
                                                     const std::function<void(void*, size_t)>& share_id) {
  HP_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl world: rank ", rank, " of ", size);
  c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
  ncclUniqueId id;
  if (rank == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  if (size > 1) share_id(&id, sizeof id);
  ncclComm_t comm = nullptr;
  nccl_check(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
  std::vector<int> ranks(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  return std::make_unique<NcclTransport>(comm, std::move(ranks), device);
}

}  // namespace hp::detail

#endif  // HP_HAVE_NCCL
