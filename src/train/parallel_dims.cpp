#include "hp/train/parallel_dims.h"

#include <algorithm>
#include <utility>

#include "hp/core/error.h"

namespace hp::train {

namespace {

constexpr const char* kPpAxis = "pp";
constexpr const char* kReplicateAxis = "dp_replicate";
constexpr const char* kShardAxis = "dp_shard";
constexpr const char* kCpAxis = "cp";
constexpr const char* kTpAxis = "tp";
constexpr const char* kExpertShardAxis = "expert_shard";
constexpr const char* kEpAxis = "ep";
constexpr int kGroups = static_cast<int>(Group::kExpertData) + 1;

// The degrees checked, with dp_shard resolved: every product is checked against the world
// size before it is formed, so none can overflow.
ParallelDims::Degrees checked(ParallelDims::Degrees d, int world) {
  HP_CHECK(world >= 1, "ParallelDims: world size ", world, " must be positive");
  const std::pair<const char*, int64_t> named[] = {{"data_parallel", d.dp_replicate},
                                                   {"context_parallel", d.cp},
                                                   {"tensor_parallel", d.tp},
                                                   {"pipeline_parallel", d.pp},
                                                   {"expert_parallel", d.ep}};
  for (const auto& [key, v] : named) HP_CHECK(v >= 1, key, "=", v, " must be positive");
  HP_CHECK(d.dp_shard >= 1 || d.dp_shard == -1, "data_parallel_shard=", d.dp_shard,
           " must be positive, or -1 for the rest of the world");
  const std::string cp_part = d.cp > 1 ? detail::str_cat(" x context_parallel=", d.cp) : std::string();
  auto layout_error = [&] {
    return detail::str_cat("data_parallel=", d.dp_replicate, " x data_parallel_shard=", d.dp_shard, cp_part,
                           " x tensor_parallel=", d.tp, " x pipeline_parallel=", d.pp, " does not match the world of ",
                           world, " ranks");
  };
  int64_t others = 1;
  for (int64_t f : {d.dp_replicate, d.cp, d.tp, d.pp}) {
    HP_CHECK(f <= world / others, layout_error());
    others *= f;
  }
  if (d.dp_shard == -1) {
    HP_CHECK(world % others == 0, "data_parallel=", d.dp_replicate, cp_part, " x tensor_parallel=", d.tp,
             " x pipeline_parallel=", d.pp, " = ", others, " does not divide the world size ", world,
             " (so data_parallel_shard=-1 has no value)");
    d.dp_shard = world / others;
  }
  HP_CHECK(d.dp_shard <= world / others && others * d.dp_shard == world, layout_error());
  if (d.ep > 1) {
    // EP borrows the ranks whose tokens differ inside a replica (dp_shard's and cp's, each
    // routing its own piece of the sequences), and the tensor-parallel ones, innermost.
    const int64_t shard = d.dp_shard * d.cp;
    const std::string shard_name = d.cp > 1 ? detail::str_cat("data_parallel_shard x context_parallel=", shard)
                                            : detail::str_cat("data_parallel_shard=", shard);
    if (d.tp == 1) {
      HP_CHECK(shard % d.ep == 0, "expert_parallel=", d.ep, " does not divide ", shard_name,
               " (expert parallelism borrows those ranks)");
    } else {
      HP_CHECK(d.ep % d.tp == 0 && shard % (d.ep / d.tp) == 0, "expert_parallel=", d.ep, " with tensor_parallel=", d.tp,
               " must be tensor_parallel x a divisor of ", shard_name,
               " (expert parallelism borrows the tensor-parallel ranks and those)");
    }
  }
  return d;
}

}  // namespace

ParallelDims::ParallelDims(const Degrees& d, int world_size)
    : d_(checked(d, world_size)),
      world_(world_size),
      mesh_({{kPpAxis, d_.pp}, {kReplicateAxis, d_.dp_replicate}, {kShardAxis, d_.dp_shard}, {kCpAxis, d_.cp}, {kTpAxis, d_.tp}},
            world_size),
      expert_({{kPpAxis, d_.pp},
               {kReplicateAxis, d_.dp_replicate},
               {kExpertShardAxis, d_.dp_shard * d_.cp * d_.tp / d_.ep},
               {kEpAxis, d_.ep}},
              world_size) {}

std::vector<std::string> ParallelDims::axes(Group g, bool* expert) const {
  *expert = false;
  switch (g) {
    case Group::kPp:
      return {kPpAxis};
    case Group::kDpReplicate:
      return {kReplicateAxis};
    case Group::kTp:
      return {kTpAxis};
    case Group::kCp:
      return {kCpAxis};
    case Group::kShard:
      return {kShardAxis, kCpAxis};
    case Group::kBatch:
      return {kReplicateAxis, kShardAxis};
    case Group::kData:
      return {kReplicateAxis, kShardAxis, kCpAxis};
    case Group::kRouting:
      if (d_.ep > 1 && d_.tp > 1) return {kReplicateAxis, kShardAxis, kCpAxis, kTpAxis};
      return {kReplicateAxis, kShardAxis, kCpAxis};
    case Group::kEp:
      *expert = true;
      return {kEpAxis};
    case Group::kExpertShard:
      *expert = true;
      return {kExpertShardAxis};
    case Group::kExpertData:
      *expert = true;
      return {kReplicateAxis, kExpertShardAxis};
  }
  HP_INTERNAL_ASSERT(false, "ParallelDims: group ", static_cast<int>(g), " is not a Group");
  return {};
}

int64_t ParallelDims::size(Group g) const {
  bool expert = false;
  const std::vector<std::string> a = axes(g, &expert);
  const MeshLayout& m = expert ? expert_ : mesh_;
  int64_t n = 1;
  for (const std::string& name : a) n *= m.size(name);
  return n;
}

std::vector<int> ParallelDims::ranks(Group g, int rank) const {
  bool expert = false;
  const std::vector<std::string> a = axes(g, &expert);
  return (expert ? expert_ : mesh_).group_ranks(rank, a);
}

int ParallelDims::rank_in(Group g, int rank) const {
  bool expert = false;
  const std::vector<std::string> a = axes(g, &expert);
  return (expert ? expert_ : mesh_).rank_in_group(rank, a);
}

std::string ParallelDims::label(Group g) const {
  bool expert = false;
  const std::vector<std::string> a = axes(g, &expert);
  if (a.size() == 1) return a.front();
  std::string out;
  for (const std::string& name : a) {
    if ((name == kReplicateAxis && d_.dp_replicate == 1) || (name == kCpAxis && d_.cp == 1)) continue;
    out += (out.empty() ? "" : "+") + name;
  }
  return out;
}

std::string ParallelDims::describe(const Degrees& d) {
  return detail::str_cat("data_parallel ", d.dp_replicate, " x data_parallel_shard ", d.dp_shard,
                         d.cp > 1 ? detail::str_cat(" x context_parallel ", d.cp) : std::string(),
                         d.tp > 1 ? detail::str_cat(" x tensor_parallel ", d.tp) : std::string(),
                         d.pp > 1 ? detail::str_cat(" x pipeline_parallel ", d.pp) : std::string());
}

ParallelMesh::ParallelMesh(const ParallelDims& dims, CommPtr world)
    : dims_(dims), world_(std::move(world)), groups_(kGroups) {
  HP_CHECK(world_ != nullptr, "ParallelMesh needs a world communicator, got null");
  HP_CHECK(world_->size() == dims_.world_size(), "ParallelMesh: the layout (", dims_.describe(), ") covers ",
           dims_.world_size(), " ranks but the world has ", world_->size());
  const int me = world_->rank();
  std::vector<Group> made = {Group::kPp, Group::kTp, Group::kShard, Group::kData, Group::kRouting};
  if (dims_.dp_replicate() > 1) made.push_back(Group::kDpReplicate);
  if (dims_.cp() > 1) made.push_back(Group::kCp);
  if (dims_.ep() > 1) {
    made.insert(made.end(), {Group::kEp, Group::kExpertShard});
    if (dims_.dp_replicate() > 1) made.push_back(Group::kExpertData);
  }
  // In this order on every rank (split is collective). A group with the ranks of one made
  // before shares its communicator. Even a group of the whole world is a communicator of its
  // own: the world's ops (agreement, checkpoints) never interleave with a step's, and a
  // group's errors and traces carry its own name and sequence numbers.
  std::vector<std::pair<std::vector<int>, CommPtr>> seen;
  for (Group g : made) {
    const std::vector<int> ranks = dims_.ranks(g, me);
    CommPtr comm;
    for (const auto& [r, c] : seen) {
      if (r == ranks) comm = c;
    }
    if (!comm) {
      // Each group's colour is its first rank, which no other group of the kind holds.
      comm = world_->split(ranks.front(), dims_.rank_in(g, me), CommOptions{world_->default_timeout(), dims_.label(g)});
    }
    seen.emplace_back(ranks, comm);
    groups_[static_cast<size_t>(g)] = comm;
  }
  const bool hsdp = dims_.dp_replicate() > 1;
  auto view = [&](Group whole, Group shard, const char* shard_axis) {
    std::vector<MeshDim> d;
    std::vector<CommPtr> g;
    if (hsdp) {
      d.push_back({kReplicateAxis, dims_.dp_replicate()});
      g.push_back(group(Group::kDpReplicate));
    }
    d.push_back({shard_axis, dims_.size(shard)});
    g.push_back(group(shard));
    return std::make_shared<DeviceMesh>(hsdp ? group(whole) : group(shard), std::move(d), std::move(g));
  };
  fsdp_ = view(Group::kData, Group::kShard, kShardAxis);
  if (dims_.ep() > 1) expert_fsdp_ = view(Group::kExpertData, Group::kExpertShard, kExpertShardAxis);
}

const CommPtr& ParallelMesh::group(Group g) const {
  const CommPtr& c = groups_.at(static_cast<size_t>(g));
  HP_CHECK(c != nullptr, "ParallelMesh: the layout (", dims_.describe(), dims_.ep() > 1 ? "" : ", no expert parallelism",
           ") has no group '", dims_.label(g), "'");
  return c;
}

}  // namespace hp::train
