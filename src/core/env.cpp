#include "hp/core/env.h"

#include <cstdlib>

#include "hp/core/error.h"

namespace hp::env {

const std::vector<Knob>& knobs() {
  static const std::vector<Knob> kKnobs = {
      {"HP_BACKEND", "auto",
       "Communicator backend for hp::init: auto (mpi under mpirun/srun, else local), mpi, local, "
       "nccl (CUDA tensors; builds with CUDA and NCCL)"},
      {"HP_COMM_TIMEOUT_S", "600",
       "Default timeout in seconds of every collective; an op not done by then raises"},
      {"HP_NUM_THREADS", "0",
       "Compute threads per rank (libtorch and OpenBLAS); 0 = cores / ranks on this node"},
      {"HP_TRACE", "",
       "Directory for Chrome trace-event files (trace_rank<R>.json); empty = tracing off"},
      {"HP_FSDP_OVERLAP", "1",
       "fully_shard overlap: 1 = prefetch all-gathers and reduce while backward goes on; 0 = every "
       "collective waited for where it is issued (for measuring what overlap hides)"},
      {"HP_RANK", "0", "nccl backend without MPI: this process's rank"},
      {"HP_WORLD_SIZE", "1", "nccl backend without MPI: the number of ranks"},
      {"HP_LOCAL_RANK", "-1",
       "nccl backend: the rank on this node, which picks the GPU (local rank % GPUs); -1 = from the "
       "launcher (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, LOCAL_RANK), else HP_RANK"},
      {"HP_NCCL_STORE", "",
       "nccl backend without MPI and more than one rank: a fresh directory all ranks see, through "
       "which rank 0 hands out the NCCL unique id"},
      {"HP_RS_SEGMENT_BYTES", "131072",
       "Segment size of the pipelined ring reduce-scatter of the mpi backend"},
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

int64_t get_int(const char* name) {
  std::string v = get_string(name);
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  HP_CHECK(end != v.c_str() && *end == '\0', "environment variable ", name, "='", v,
           "' is not an integer");
  return x;
}

double get_double(const char* name) {
  std::string v = get_string(name);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  HP_CHECK(end != v.c_str() && *end == '\0', "environment variable ", name, "='", v,
           "' is not a number");
  return x;
}

}  // namespace hp::env
