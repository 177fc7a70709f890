// The mpi backend's table of every communicator's progress in shared memory (private to
// src/comm/mpi_*.cpp; built with MPI only).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace hp::detail {

// Out-of-band progress of every communicator, for naming the peers of a collective that
// timed out. Each rank owns one row of kSlots (tag, count) pairs in shared memory that the
// other ranks of its node can read without any MPI call (reading cannot hang behind a
// stuck peer). A communicator's slot is picked by hashing its member list and how many
// communicators over the same members this process made before it (the same on every
// member: they are created collectively, in one order); the tag tells a reader whether
// the slot holds that communicator. Ranks on other nodes are not visible.
class ProgressTable {
 public:
  static constexpr int kSlots = 1024;
  struct Slot {
    uint64_t tag;
    uint64_t count;
  };

  // Collective over MPI_COMM_WORLD (from make_mpi_world_transport). On any failure the
  // table stays off and every peer counts as not visible.
  static void create();
  // Collective again: at shutdown, before MPI_Finalize.
  static void destroy();
  static ProgressTable& instance() {
    static ProgressTable t;
    return t;
  }

  // The slot and tag of a new communicator over `members` (world ranks).
  std::pair<int, uint64_t> slot_for(const std::vector<int>& members);
  void started(int slot, uint64_t collective) {
    if (on_) __atomic_store_n(&rows_[me_][slot].count, collective, __ATOMIC_RELEASE);
  }
  // More ranks on this node than it has cores.
  bool ranks_share_cores() const { return ranks_share_cores_; }
  // The count world rank `w` reached in `slot`, or -1 when not visible.
  int64_t count_of(int w, int slot, uint64_t tag) const {
    if (!on_ || w < 0 || w >= static_cast<int>(rows_.size()) || rows_[w] == nullptr) return -1;
    if (__atomic_load_n(&rows_[w][slot].tag, __ATOMIC_ACQUIRE) != tag) return -1;
    return static_cast<int64_t>(__atomic_load_n(&rows_[w][slot].count, __ATOMIC_ACQUIRE));
  }

 private:
  bool on_ = false;
  bool ranks_share_cores_ = false;
  int me_ = 0;
  MPI_Comm node_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  std::vector<Slot*> rows_;  // by world rank; null off this node
  std::mutex mu_;
  std::map<uint64_t, uint64_t> made_;  // communicators made per member list
};

}  // namespace hp::detail
