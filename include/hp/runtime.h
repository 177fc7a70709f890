// Process start-up and shut-down for hyperparallel programs.
//
// hp::init() picks the backend (mpi under mpirun / srun, else local; HP_BACKEND
// overrides), initializes MPI with MPI_THREAD_MULTIPLE when needed, sets each rank's
// compute thread count (libtorch and OpenBLAS) so that ranks x threads does not
// oversubscribe the node's cores (the cores this process may run on / ranks on the node),
// installs the counting CPU allocator, enables tracing when HP_TRACE is set, and returns
// the world communicator. hp::finalize() (also run at exit) writes the trace, stops every
// communicator's thread and finalizes MPI if hp::init initialized it; a trace that could
// not be written raises hp::Error once the rest is done (run at exit: the message goes to
// stderr and the process exits with status 1), so call it before returning from main to
// report it your own way.
#pragma once

#include <string>

#include "hp/comm/communicator.h"

namespace hp {

struct InitOptions {
  // "auto", "mpi" or "local"; empty = the HP_BACKEND knob.
  std::string backend;
  // Compute threads per rank; 0 = HP_NUM_THREADS, whose 0 means cores / ranks on this node.
  int num_threads = 0;
  CommOptions world;
};

// Idempotent: later calls return the same world communicator.
CommPtr init(const InitOptions& o = {});
// The world communicator; raises if hp::init has not run.
CommPtr world();
bool initialized();
void finalize();

// Sets libtorch's and OpenBLAS's thread counts; returns the count set.
int set_compute_threads(int n);
// The cores this process may run on (its affinity mask).
int usable_cores();
// Ranks of the world sharing this node (1 without MPI).
int local_world_size();
// Whether each rank on this node has a core beyond its compute threads, for its
// communication thread: the cores this process may run on, shared by the node's ranks,
// give each at least its compute threads + 1. The rule, for a node of `cores` running
// `ranks_per_node` ranks of `threads_per_rank` compute threads each, is the second form
// (fully_shard's overlap setting and the planner use it too).
bool spare_core_per_rank();
bool spare_core_per_rank(int cores, int ranks_per_node, int threads_per_rank);

// Call first in main(argc, argv): when OMP_WAIT_POLICY is not set, sets it to "passive" and
// re-executes the program (OpenMP reads it once, when it loads). With libtorch's OpenMP
// threads spinning between parallel regions while OpenBLAS's own threads run the matrix
// products, a rank of 2 compute threads took 3.3x longer per step here than with them
// sleeping (docs/performance.md). A policy the user set is kept. Returns only when no
// re-execution happened (or it failed, which costs speed only).
void prefer_passive_openmp(char** argv);

}  // namespace hp
