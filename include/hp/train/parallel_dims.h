// hp::train::ParallelDims: a run's parallel degrees, their checks, the one world mesh they
// lay out and the groups a run communicates over, each a flattened view of that mesh.
//
// The world mesh, outermost first: pp, dp_replicate, dp_shard, cp, tp (tensor parallel on
// consecutive ranks, pipeline stages farthest apart). Expert parallelism borrows ranks: the
// inner dp_shard x cp x tp ranks, flattened, are regrouped as (expert_shard, ep) with ep
// inner, so an EP group is expert_parallel consecutive ranks (the tensor-parallel ones
// included) and each expert is whole and sharded over the expert_shard ranks holding the
// same experts (docs/ep.md). ParallelDims is pure (no ranks): the planner places its links
// by the same groups the Trainer communicates over, which ParallelMesh makes.
//
// Every group is named by a value of Group, never by a string: the axis names appear only
// in the groups' labels (errors, traces) and in hp-train's layout line.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/mesh/device_mesh.h"

namespace hp::train {

// The groups of a layout. Each is a set of ranks that differ only in the named axes.
enum class Group {
  kPp,           // pipeline stages
  kDpReplicate,  // HSDP's replicas
  kTp,           // tensor parallel
  kCp,           // context parallel: one sequence's pieces
  kShard,        // dp_shard x cp: what fully_shard shards the dense parameters over
  kBatch,        // dp_replicate x dp_shard: ranks reading different samples
  kData,         // dp_replicate x dp_shard x cp: ranks whose tokens differ (losses averaged)
  // The ranks whose routed tokens differ (an MoE's balancing load is summed over them):
  // kData, and tp's ranks too when each routes its own piece of the sequence (expert and
  // tensor parallel together).
  kRouting,
  kEp,           // the experts' token exchange: expert_parallel consecutive ranks
  kExpertShard,  // dp_shard x cp x tp / ep: the ranks holding the same experts
  kExpertData,   // dp_replicate x kExpertShard: the experts' HSDP world
};

class ParallelDims {
 public:
  struct Degrees {
    int64_t dp_replicate = 1;
    int64_t dp_shard = -1;  // -1: the rest of the world
    int64_t cp = 1;
    int64_t tp = 1;
    int64_t pp = 1;
    int64_t ep = 1;
  };

  // Checks the degrees against `world_size` (each positive, their product the world, every
  // product computed without overflow; expert_parallel dividing the ranks it borrows) and
  // resolves dp_shard = -1. Raises hp::Error naming the config keys (data_parallel,
  // data_parallel_shard, context_parallel, tensor_parallel, pipeline_parallel,
  // expert_parallel) and their values.
  ParallelDims(const Degrees& d, int world_size);

  int64_t dp_replicate() const { return d_.dp_replicate; }
  int64_t dp_shard() const { return d_.dp_shard; }
  int64_t cp() const { return d_.cp; }
  int64_t tp() const { return d_.tp; }
  int64_t pp() const { return d_.pp; }
  int64_t ep() const { return d_.ep; }
  int world_size() const { return world_; }
  // The number of ranks in each group of `g` (every group of a kind has the same size).
  int64_t size(Group g) const;

  // The world ranks of `rank`'s group of kind `g`, in the group's rank order (row-major over
  // its axes, as its communicator numbers them).
  std::vector<int> ranks(Group g, int rank) const;
  // `rank`'s position in that group.
  int rank_in(Group g, int rank) const;
  // The group's label in errors and traces: its axes joined by '+' ("dp_replicate+dp_shard"),
  // dp_replicate and cp left out where they are 1.
  std::string label(Group g) const;

  // The layout as hp-train prints it: "data_parallel 2 x data_parallel_shard 4 x ...";
  // the static form for degrees not checked yet (dp_shard -1 printed as it is).
  std::string describe() const { return describe(d_); }
  static std::string describe(const Degrees& d);

 private:
  // The axes of `g` in the world mesh (`expert`: in the experts' regrouping of it).
  std::vector<std::string> axes(Group g, bool* expert) const;

  Degrees d_;
  int world_ = 1;
  MeshLayout mesh_;    // pp, dp_replicate, dp_shard, cp, tp
  MeshLayout expert_;  // pp, dp_replicate, expert_shard, ep: the same ranks regrouped
};

// The communicators of a layout over a world, made once (collective: every rank constructs
// it with the same dims, in the same order). Groups a layout does not use are not made:
// group() raises for them (kCp without context parallelism; kEp, kExpertShard and
// kExpertData without expert parallelism). Two kinds with the same ranks share one
// communicator; none is the world itself (its ops and sequence numbers stay the step's).
class ParallelMesh {
 public:
  ParallelMesh(const ParallelDims& dims, CommPtr world);
  ParallelMesh(const ParallelMesh&) = delete;
  ParallelMesh& operator=(const ParallelMesh&) = delete;

  const ParallelDims& dims() const { return dims_; }
  const CommPtr& world() const { return world_; }
  const CommPtr& group(Group g) const;
  // This rank's position in its group of `g` (made or not).
  int rank_in(Group g) const { return dims_.rank_in(g, world_->rank()); }

  // fully_shard's mesh for the dense parameters: (dp_replicate, dp_shard) over the
  // kDpReplicate and kShard groups (HSDP), or (dp_shard) alone without replicas.
  std::shared_ptr<DeviceMesh> fsdp_mesh() const { return fsdp_; }
  // The same for the routed experts (expert parallelism only): (dp_replicate, expert_shard)
  // or (expert_shard).
  std::shared_ptr<DeviceMesh> expert_fsdp_mesh() const { return expert_fsdp_; }

 private:
  ParallelDims dims_;
  CommPtr world_;
  std::vector<CommPtr> groups_;  // indexed by Group
  std::shared_ptr<DeviceMesh> fsdp_, expert_fsdp_;
};

}  // namespace hp::train
