#include "hp/core/env.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "hp/core/error.h"

namespace hp::env {

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> kKnobs = {
      {"HP_BACKEND", "auto",
       "Communicator backend for hp::init: auto (mpi under mpirun/srun, else local), mpi, local, "
       "nccl (CUDA tensors; builds with CUDA and NCCL)", 1, 0, "auto|mpi|local|nccl"},
      {"HP_COMM_TIMEOUT_S", "600",
       "Default timeout in seconds of every collective; an op not done by then raises (0.001 to "
       "31536000, a year)", 0.001, 31536000},
      {"HP_NUM_THREADS", "0",
       "Compute threads per rank (libtorch and OpenBLAS); 0 = cores / ranks on this node; at most 1024",
       0, 1024},
      {"HP_TRACE", "",
       "Directory for Chrome trace-event files (trace_rank<R>.json); empty = tracing off. Created "
       "and checked for writing at hp::init"},
      {"HP_FSDP_OVERLAP", "auto",
       "fully_shard overlap: auto = on where the backend moves data without the CPU (nccl) or each "
       "rank has a core to spare for its communication thread, else off; 1 = prefetch all-gathers and "
       "reduce while backward goes on; 0 = every collective waited for where it is issued", 1, 0, "auto|0|1"},
      {"HP_SIM_NET", "",
       "Simulated network, a measuring tool (hp/comm/simulated_network.h): ALPHA_US:GB_PER_S, or "
       "ALPHA_US:GB_PER_S,INTER_ALPHA_US:INTER_GB_PER_S:RANKS_PER_NODE; every op is held until the "
       "modelled link would have finished it. Empty = off"},
      {"HP_RANK", "0", "nccl backend without MPI: this process's rank", 0, 16777215},
      {"HP_WORLD_SIZE", "1", "nccl backend without MPI: the number of ranks", 1, 16777216},
      {"HP_LOCAL_RANK", "-1",
       "nccl backend: the rank on this node, which picks the GPU (local rank % GPUs); -1 = from the "
       "launcher (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, LOCAL_RANK), else HP_RANK", -1, 65535},
      {"HP_NCCL_STORE", "",
       "nccl backend without MPI and more than one rank: a fresh directory all ranks see, through "
       "which rank 0 hands out the NCCL unique id"},
      {"HP_FAILURE_MARKERS", "",
       "Set by scripts/launch.sh: a folder where a rank that fails with an error leaves a file "
       "(rank<R>: its error) before it exits, so that the launcher can end a job whose launcher "
       "process cannot (mpirun across a partition); empty = none"},
      {"HP_RESTART_CAUSES", "",
       "Set by scripts/launch.sh when it relaunches: the cause of each of its relaunches so far, "
       "one a line, this one last; hp-train records those that left no resume record (they "
       "ended before training) beside its own"},
      {"HP_RESTART_CAUSE", "",
       "Set by scripts/launch.sh when it relaunches a failed run: why (the exit status), recorded by "
       "hp-train in the resume record of metrics.jsonl; empty = a resume the user asked for"},
      {"HP_RS_SEGMENT_BYTES", "131072",
       "Segment size of the pipelined ring reduce-scatter of the mpi backend (1024 to 1073741824)", 1024,
       1073741824},
  };
  return kKnobs;
}

static const Knob& find(const char* name) {
  for (const auto& k : knobs()) {
    if (std::string(k.name) == name) return k;
  }
  HP_INTERNAL_ASSERT(false, "undeclared environment knob ", name);
  __builtin_unreachable();
}

std::string get_string(const char* name) {
  const Knob& k = find(name);
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return k.default_value;
  return v;
}

namespace {
std::string fmt(double x) {
  if (x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  std::ostringstream os;
  os << x;
  return os.str();
}
void check_range(const Knob& k, const std::string& v, double x) {
  if (!k.numeric()) return;
  HP_CHECK(x >= k.min && x <= k.max, "environment variable ", k.name, "='", v, "' is out of range: it must be in [",
           fmt(k.min), ", ", fmt(k.max), "]");
}
}  // namespace

int64_t get_int(const char* name) {
  const Knob& k = find(name);
  std::string v = get_string(name);
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  HP_CHECK(end != v.c_str() && *end == '\0', "environment variable ", name, "='", v, "' is not an integer");
  HP_CHECK(errno != ERANGE, "environment variable ", name, "='", v, "' is out of range: it must be in [", fmt(k.min),
           ", ", fmt(k.max), "]");
  check_range(k, v, static_cast<double>(x));
  return x;
}

double get_double(const char* name) {
  const Knob& k = find(name);
  std::string v = get_string(name);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  HP_CHECK(end != v.c_str() && *end == '\0', "environment variable ", name, "='", v, "' is not a number");
  HP_CHECK(std::isfinite(x), "environment variable ", name, "='", v, "' is not a finite number");
  check_range(k, v, x);
  return x;
}

void check_all() {
  for (const auto& k : knobs()) {
    if (k.numeric()) {
      // Whole-number knobs are read as integers; the timeout is the one fractional knob.
      if (std::string(k.name) == "HP_COMM_TIMEOUT_S") {
        get_double(k.name);
      } else {
        get_int(k.name);
      }
    } else if (*k.choices != '\0') {
      const std::string v = get_string(k.name), all = k.choices;
      bool ok = false;
      size_t start = 0;
      while (start <= all.size()) {
        size_t bar = all.find('|', start);
        if (bar == std::string::npos) bar = all.size();
        ok = ok || (all.compare(start, bar - start, v) == 0 && bar - start == v.size());
        start = bar + 1;
      }
      HP_CHECK(ok, "environment variable ", k.name, "='", v, "' is not one of ", all);
    }
  }
}

}  // namespace hp::env
