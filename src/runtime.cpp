#include "hp/runtime.h"

#include <ATen/Parallel.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <sched.h>
#include <thread>

#include "comm/transport.h"
#include "hp/config.h"
#include "hp/core/env.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/core/trace.h"

#if HP_HAVE_MPI
#include <mpi.h>
#endif
#if HP_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#endif

namespace hp {
namespace {

std::mutex g_mu;
CommPtr g_world;
bool g_we_initialized_mpi = false;
int g_local_size = 1;
bool g_atexit_registered = false;

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

#if HP_HAVE_MPI
// MPI_Init_thread(MPI_THREAD_MULTIPLE) unless the program did it; sets g_local_size.
void init_mpi() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    HP_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS,
             "MPI_Init_thread failed");
    g_we_initialized_mpi = true;
    HP_CHECK(provided == MPI_THREAD_MULTIPLE,
             "this MPI library does not provide MPI_THREAD_MULTIPLE (got level ", provided,
             "); hyperparallel runs collectives on their own threads and needs it");
  }
  MPI_Comm node;
  HP_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS,
           "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed: cannot count the ranks of this node");
  HP_CHECK(MPI_Comm_size(node, &g_local_size) == MPI_SUCCESS, "MPI_Comm_size failed on the node communicator");
  MPI_Comm_free(&node);
}
#endif

#if HP_HAVE_NCCL
// Rank 0 writes the id to <dir>/nccl_unique_id (through a rename, so readers never see
// half a file); the others wait for it, up to HP_COMM_TIMEOUT_S.
void share_through_file(const std::string& dir, int rank, void* id, size_t n) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / "nccl_unique_id";
  if (rank == 0) {
    HP_CHECK(!fs::exists(path), "HP_NCCL_STORE: ", path.string(), " already exists (from an earlier run?); ",
             "give each run a fresh directory");
    const fs::path tmp = path.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(static_cast<const char*>(id), static_cast<std::streamsize>(n));
      HP_CHECK(f.good(), "HP_NCCL_STORE: cannot write ", tmp.string());
    }
    fs::rename(tmp, path);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(env::get_double("HP_COMM_TIMEOUT_S") * 1000));
  while (!fs::exists(path)) {
    HP_CHECK(std::chrono::steady_clock::now() < deadline, "HP_NCCL_STORE: rank ", rank, " waited for ",
             path.string(), " from rank 0 until HP_COMM_TIMEOUT_S ran out");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream f(path, std::ios::binary);
  f.read(static_cast<char*>(id), static_cast<std::streamsize>(n));
  HP_CHECK(f.gcount() == static_cast<std::streamsize>(n), "HP_NCCL_STORE: ", path.string(), " is truncated");
}

int launcher_local_rank(int rank) {
  int64_t local = env::get_int("HP_LOCAL_RANK");
  if (local >= 0) return static_cast<int>(local);
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"}) {
    if (const char* s = std::getenv(v)) return std::atoi(s);
  }
  return rank;
}

CommPtr make_nccl_world(const CommOptions& o) {
  int rank = 0, size = 1;
  std::function<void(void*, size_t)> share;
#if HP_HAVE_MPI
  if (launched_by_mpi()) {
    init_mpi();
    HP_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank) == MPI_SUCCESS && MPI_Comm_size(MPI_COMM_WORLD, &size) == MPI_SUCCESS,
             "MPI_Comm_rank/MPI_Comm_size failed on MPI_COMM_WORLD");
    share = [](void* p, size_t n) {
      HP_CHECK(MPI_Bcast(p, static_cast<int>(n), MPI_BYTE, 0, MPI_COMM_WORLD) == MPI_SUCCESS,
               "MPI_Bcast of the NCCL unique id failed");
    };
  }
#endif
  if (!share) {
    rank = static_cast<int>(env::get_int("HP_RANK"));
    size = static_cast<int>(env::get_int("HP_WORLD_SIZE"));
    HP_CHECK(size >= 1 && rank >= 0 && rank < size, "HP_RANK=", rank, " must be in [0, HP_WORLD_SIZE=", size, ")");
    std::string dir = env::get_string("HP_NCCL_STORE");
    HP_CHECK(size == 1 || !dir.empty(), "the nccl backend with HP_WORLD_SIZE=", size,
             " and no MPI needs HP_NCCL_STORE (a fresh directory every rank sees)");
    share = [dir, rank](void* p, size_t n) { share_through_file(dir, rank, p, n); };
    g_local_size = size;  // one node: the file store serves a single machine
  }
  const int gpus = c10::cuda::device_count();
  HP_CHECK(gpus > 0, "the nccl backend needs a CUDA device, and this process sees none");
  const int device = launcher_local_rank(rank) % gpus;
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));  // the tensors' default CUDA device
  return detail::make_queued_communicator(detail::make_nccl_world_transport(rank, size, device, share),
                                          o.name.empty() ? "world" : o.name, o);
}
#endif

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

int set_compute_threads(int n) {
  HP_CHECK(n >= 1, "compute thread count must be at least 1, got ", n);
  at::set_num_threads(n);
  // OpenBLAS (pthreads build) keeps its own pool; its setter exists only when it is loaded.
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(n);
  return n;
}

int local_world_size() { return g_local_size; }

bool spare_core_per_rank() {
  return usable_cores() >= std::max(1, g_local_size) * (at::get_num_threads() + 1);
}

bool initialized() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_world != nullptr;
}

CommPtr world() {
  std::lock_guard<std::mutex> g(g_mu);
  HP_CHECK(g_world != nullptr, "hp::world() called before hp::init()");
  return g_world;
}

CommPtr init(const InitOptions& o) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_world) return g_world;
  env::check_all();  // a bad knob stops here, before any communicator or thread starts
  std::string backend = o.backend.empty() ? env::get_string("HP_BACKEND") : o.backend;
  HP_CHECK(backend == "auto" || backend == "mpi" || backend == "local" || backend == "nccl", "unknown backend '",
           backend, "' (HP_BACKEND / InitOptions::backend): expected auto, mpi, local or nccl");
  if (backend == "auto") backend = (mpi_available() && launched_by_mpi()) ? "mpi" : "local";
  InitOptions opts = o;
  if (opts.world.simulated_network.empty()) opts.world.simulated_network = env::get_string("HP_SIM_NET");
  if (!opts.world.simulated_network.empty()) SimulatedNetwork::parse(opts.world.simulated_network);  // names a bad spec

  if (backend == "mpi") {
#if HP_HAVE_MPI
    init_mpi();
    g_world = make_mpi_world_communicator(opts.world);
#else
    HP_NOT_SUPPORTED("backend 'mpi': this build has no MPI");
#endif
  } else if (backend == "nccl") {
#if HP_HAVE_NCCL
    g_world = make_nccl_world(opts.world);
#else
    HP_NOT_SUPPORTED("backend 'nccl': this build has no CUDA and NCCL (see the README's GPU build)");
#endif
  } else {
    if (launched_by_mpi()) {
      const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");
      if (n == nullptr) n = std::getenv("PMI_SIZE");
      HP_CHECK(n == nullptr || std::atoi(n) <= 1, "launched by mpirun with ", n == nullptr ? "" : n,
               " processes but using the local backend (HP_BACKEND=local, or no MPI in this build): every ",
               "process would train alone as a world of one rank; unset HP_BACKEND or use mpi");
    }
    g_local_size = 1;
    g_world = make_local_communicator(opts.world);
  }

  int threads = o.num_threads > 0 ? o.num_threads
                                  : static_cast<int>(env::get_int("HP_NUM_THREADS"));
  if (threads <= 0) threads = std::max(1, usable_cores() / std::max(1, g_local_size));
  const int node_cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // Only when fewer threads would help: more ranks than cores is the launcher's choice.
  if (threads > 1 && (threads > usable_cores() || threads * std::max(1, g_local_size) > node_cores) &&
      g_world->rank() == 0) {
    std::cerr << "hyperparallel: warning: " << threads << " compute threads per rank (x " << g_local_size
              << " rank(s) on this node, " << node_cores << " cores, " << usable_cores()
              << " usable by this rank): oversubscribed threads slow every rank down (HP_NUM_THREADS=0 picks "
                 "usable cores / ranks)\n";
  }
  set_compute_threads(threads);

  memory::install_counting_allocator();
  trace::set_rank(g_world->rank());
  std::string trace_dir = env::get_string("HP_TRACE");
  if (!trace_dir.empty()) {
    // Checked now, not at exit: a trace that cannot be written must not cost a whole run.
    std::error_code ec;
    std::filesystem::create_directories(trace_dir, ec);
    HP_CHECK(std::filesystem::is_directory(trace_dir), "HP_TRACE='", trace_dir,
             "' is not a directory that can be created", ec ? ": " + ec.message() : std::string());
    const std::string probe = trace_dir + "/.hp_trace_probe_rank" + std::to_string(g_world->rank());
    std::FILE* f = std::fopen(probe.c_str(), "w");
    HP_CHECK(f != nullptr, "HP_TRACE='", trace_dir, "' is not writable: ", std::strerror(errno));
    std::fclose(f);
    std::remove(probe.c_str());
    trace::enable(trace_dir);
  }
  if (!g_atexit_registered) {
    std::atexit([] { finalize(); });
    g_atexit_registered = true;
  }
  return g_world;
}

void finalize() {
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_world) return;
  g_world.reset();
  bool clean = detail::shutdown_all_communicators(std::chrono::milliseconds(5000));
  if (trace::enabled()) trace::flush();  // after the workers recorded their last spans
#if HP_HAVE_MPI
  if (g_we_initialized_mpi) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) {
      if (clean) {
        detail::free_mpi_progress_table();
        MPI_Finalize();
      } else {
        std::cerr << "hyperparallel: a communicator is stuck in an op that timed out; "
                     "not finalizing MPI\n";
      }
    }
  }
#else
  (void)clean;
#endif
}

}  // namespace hp
