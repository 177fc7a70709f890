#include "bootstrap.h"

#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "transport.h"
#include "hp/core/env.h"
#include "hp/core/error.h"

#if HP_HAVE_MPI
#include <mpi.h>
#endif
#if HP_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#endif

namespace hp::detail {

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

#if HP_HAVE_MPI
int init_mpi(bool* we_initialized) {
  int inited = 0;
  HP_CHECK(MPI_Initialized(&inited) == MPI_SUCCESS, "MPI_Initialized failed");
  if (!inited) {
    int provided = 0;
    HP_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS,
             "MPI_Init_thread failed");
    *we_initialized = true;
    HP_CHECK(provided == MPI_THREAD_MULTIPLE,
             "this MPI library does not provide MPI_THREAD_MULTIPLE (got level ", provided,
             "); hyperparallel runs collectives on their own threads and needs it");
  }
  MPI_Comm node;
  HP_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS,
           "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed: cannot count the ranks of this node");
  int local = 1;
  HP_CHECK(MPI_Comm_size(node, &local) == MPI_SUCCESS, "MPI_Comm_size failed on the node communicator");
  HP_CHECK(MPI_Comm_free(&node) == MPI_SUCCESS, "MPI_Comm_free failed on the node communicator");
  return local;
}
#endif

#if HP_HAVE_NCCL
namespace {

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

}  // namespace

CommPtr make_nccl_world(const CommOptions& o, int* local_size, bool* we_initialized_mpi) {
  int rank = 0, size = 1;
  std::function<void(void*, size_t)> share;
#if HP_HAVE_MPI
  if (launched_by_mpi()) {
    *local_size = init_mpi(we_initialized_mpi);
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
    *local_size = size;  // one node: the file store serves a single machine
  }
  const int gpus = c10::cuda::device_count();
  HP_CHECK(gpus > 0, "the nccl backend needs a CUDA device, and this process sees none");
  const int device = launcher_local_rank(rank) % gpus;
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));  // the tensors' default CUDA device
  return make_queued_communicator(make_nccl_world_transport(rank, size, device, share),
                                  o.name.empty() ? "world" : o.name, o);
}
#endif

#if HP_HAVE_MPI
void finalize_mpi(bool clean) {
  // At exit: failures are reported, not raised.
  int fin = 0;
  if (MPI_Finalized(&fin) != MPI_SUCCESS) {
    std::cerr << "hyperparallel: MPI_Finalized failed; not finalizing MPI\n";
    return;
  }
  if (fin) return;
  if (clean) {
    free_mpi_progress_table();
    if (MPI_Finalize() != MPI_SUCCESS) std::cerr << "hyperparallel: MPI_Finalize failed\n";
  } else {
    std::cerr << "hyperparallel: a communicator is stuck in an op that timed out; not finalizing MPI\n";
  }
}
#endif

}  // namespace hp::detail
