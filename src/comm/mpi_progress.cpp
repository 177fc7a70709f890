// The mpi backend's progress table (mpi_progress.h).
#include "hp/config.h"

#if HP_HAVE_MPI
#include "mpi_progress.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "hp/core/hash.h"

namespace hp::detail {

void ProgressTable::create() {
  ProgressTable& t = instance();
  if (t.on_) return;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &t.node_) != MPI_SUCCESS) return;
  if (MPI_Comm_set_errhandler(t.node_, MPI_ERRORS_RETURN) != MPI_SUCCESS) return;
  void* base = nullptr;
  if (MPI_Win_allocate_shared(kSlots * sizeof(Slot), sizeof(Slot), MPI_INFO_NULL, t.node_, &base, &t.win_) !=
      MPI_SUCCESS) {
    return;
  }
  int node_size = 0, world_size = 0;
  std::memset(base, 0, kSlots * sizeof(Slot));
  MPI_Group node_group, world_group;
  // Every call checked; the rows stay unknown (the table off) when one fails. The barrier
  // below is reached by every rank of the node either way, so none waits forever.
  bool ok = MPI_Comm_size(t.node_, &node_size) == MPI_SUCCESS &&
            MPI_Comm_size(MPI_COMM_WORLD, &world_size) == MPI_SUCCESS &&
            MPI_Comm_rank(MPI_COMM_WORLD, &t.me_) == MPI_SUCCESS;
  t.rows_.assign(ok ? world_size : 0, nullptr);
  ok = ok && MPI_Comm_group(t.node_, &node_group) == MPI_SUCCESS;
  ok = ok && MPI_Comm_group(MPI_COMM_WORLD, &world_group) == MPI_SUCCESS;
  for (int i = 0; ok && i < node_size; ++i) {
    MPI_Aint size = 0;
    int disp = 0;
    void* ptr = nullptr;
    int world = MPI_UNDEFINED;
    if (MPI_Win_shared_query(t.win_, i, &size, &disp, &ptr) != MPI_SUCCESS) continue;
    if (MPI_Group_translate_ranks(node_group, 1, &i, world_group, &world) != MPI_SUCCESS) continue;
    if (world >= 0 && world < world_size) t.rows_[world] = static_cast<Slot*>(ptr);
  }
  if (ok) {
    MPI_Group_free(&node_group);
    MPI_Group_free(&world_group);
  }
  ok = MPI_Barrier(t.node_) == MPI_SUCCESS && ok;  // every row zeroed before anyone registers
  t.on_ = ok && t.me_ < static_cast<int>(t.rows_.size()) && t.rows_[t.me_] != nullptr;
  t.ranks_share_cores_ = ok && node_size > static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void ProgressTable::destroy() {
  ProgressTable& t = instance();
  if (t.win_ != MPI_WIN_NULL) MPI_Win_free(&t.win_);
  if (t.node_ != MPI_COMM_NULL) MPI_Comm_free(&t.node_);
  t.on_ = false;
  t.rows_.clear();
}

std::pair<int, uint64_t> ProgressTable::slot_for(const std::vector<int>& members) {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t h = kFnvOffset;
  for (int m : members) h = fnv1a_step(h, static_cast<uint64_t>(m + 1));
  const uint64_t ordinal = made_[h]++;
  h = fnv1a_step(h, ordinal + 0x9e3779b97f4a7c15ULL);
  h |= 1;  // never 0: an empty slot
  const int slot = static_cast<int>(h % kSlots);
  if (on_) {
    __atomic_store_n(&rows_[me_][slot].count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&rows_[me_][slot].tag, h, __ATOMIC_RELEASE);
  }
  return {slot, h};
}

}  // namespace hp::detail
#endif  // HP_HAVE_MPI
