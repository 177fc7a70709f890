#include "hp/runtime.h"

#include <ATen/Parallel.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <unistd.h>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <sched.h>
#include <thread>

#include "comm/bootstrap.h"
#include "hp/comm/simulated_network.h"
#include "hp/config.h"
#include "hp/core/env.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/core/trace.h"

namespace hp {
namespace {

std::mutex g_mu;
CommPtr g_world;
bool g_we_initialized_mpi = false;
int g_local_size = 1;
bool g_atexit_registered = false;

enum class Backend { kMpi, kLocal, kNccl };

// HP_BACKEND / InitOptions::backend, parsed once: auto is mpi under a launcher (when this
// build has MPI), else local.
Backend parse_backend(const std::string& name) {
  if (name == "mpi") return Backend::kMpi;
  if (name == "local") return Backend::kLocal;
  if (name == "nccl") return Backend::kNccl;
  HP_CHECK(name == "auto", "unknown backend '", name,
           "' (HP_BACKEND / InitOptions::backend): expected auto, mpi, local or nccl");
  return mpi_available() && detail::launched_by_mpi() ? Backend::kMpi : Backend::kLocal;
}

}  // namespace

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int set_compute_threads(int n) {
  HP_CHECK(n >= 1, "compute thread count must be at least 1, got ", n);
  at::set_num_threads(n);
  // OpenBLAS (pthreads build) keeps its own pool; its setter exists only when it is loaded.
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(n);
  return n;
}

int local_world_size() { return g_local_size; }

bool spare_core_per_rank(int cores, int ranks_per_node, int threads_per_rank) {
  return cores >= std::max(1, ranks_per_node) * (threads_per_rank + 1);
}

bool spare_core_per_rank() { return spare_core_per_rank(usable_cores(), g_local_size, at::get_num_threads()); }

void prefer_passive_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || argv == nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: the program goes on with the policy OpenMP already read.
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
  const Backend backend = parse_backend(o.backend.empty() ? env::get_string("HP_BACKEND") : o.backend);
  InitOptions opts = o;
  if (opts.world.simulated_network.empty()) opts.world.simulated_network = env::get_string("HP_SIM_NET");
  if (!opts.world.simulated_network.empty()) SimulatedNetwork::parse(opts.world.simulated_network);  // names a bad spec

  if (backend == Backend::kMpi) {
#if HP_HAVE_MPI
    g_local_size = detail::init_mpi(&g_we_initialized_mpi);
    g_world = make_mpi_world_communicator(opts.world);
#else
    HP_NOT_SUPPORTED("backend 'mpi': this build has no MPI");
#endif
  } else if (backend == Backend::kNccl) {
#if HP_HAVE_NCCL
    g_world = detail::make_nccl_world(opts.world, &g_local_size, &g_we_initialized_mpi);
#else
    HP_NOT_SUPPORTED("backend 'nccl': this build has no CUDA and NCCL (see the README's GPU build)");
#endif
  } else {
    if (detail::launched_by_mpi()) {
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
    std::atexit([] {
      try {
        finalize();
      } catch (const std::exception& e) {  // a program that did not call finalize() itself
        std::fprintf(stderr, "hyperparallel: error at exit: %s\n", e.what());
        std::fflush(nullptr);
        std::_Exit(1);
      }
    });
    g_atexit_registered = true;
  }
  return g_world;
}

void finalize() {
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_world) return;
  g_world.reset();
  bool clean = detail::shutdown_all_communicators(std::chrono::milliseconds(5000));
  std::string trace_error;
  try {
    if (trace::enabled()) trace::flush();  // after the workers recorded their last spans
  } catch (const std::exception& e) {
    trace_error = e.what();  // raised once the rest is shut down
  }
#if HP_HAVE_MPI
  if (g_we_initialized_mpi) detail::finalize_mpi(clean);
#else
  (void)clean;
#endif
  HP_CHECK(trace_error.empty(), trace_error);
}

}  // namespace hp
