// How hp::init and hp::finalize (src/runtime.cpp) start and stop the comm layer; the only
// part of it the runtime sees (transports and the queued communicator stay behind
// comm/transport.h).
#pragma once

#include <chrono>

#include "hp/comm/communicator.h"
#include "hp/config.h"

namespace hp::detail {

// Whether a launcher (mpirun, srun, ...) started this process.
bool launched_by_mpi();

#if HP_HAVE_MPI
// MPI_Init_thread(MPI_THREAD_MULTIPLE) unless the program did it (then sets
// *we_initialized); returns the ranks of this node.
int init_mpi(bool* we_initialized);
#endif

#if HP_HAVE_NCCL
// The world over NCCL: ranks from MPI under a launcher (which shares the unique id), else
// HP_RANK / HP_WORLD_SIZE with the HP_NCCL_STORE file store; the CUDA device is the local
// rank modulo the GPUs. Sets *local_size (the ranks of this node) and, when it started MPI,
// *we_initialized_mpi.
CommPtr make_nccl_world(const CommOptions& o, int* local_size, bool* we_initialized_mpi);
#endif

// Stops every live communicator's worker before the runtime shuts MPI down. Returns
// false if some worker is stuck in an op that timed out (MPI must then not be finalized).
bool shutdown_all_communicators(std::chrono::milliseconds grace);

#if HP_HAVE_MPI
// After shutdown_all_communicators returned `clean`: frees the mpi backend's progress
// table and finalizes MPI (unless already finalized); when not clean, says why it leaves
// MPI alone.
void finalize_mpi(bool clean);
#endif

}  // namespace hp::detail
