// ParallelMesh on the real world (4 or 8 ranks): for every layout of the world, each group it
// makes holds the ranks ParallelDims names (tested without ranks in parallel_dims_test) in
// that order, and a sum over it adds exactly those ranks; groups with the same ranks share a
// communicator; fully_shard's meshes are the kShard / kExpertShard groups with replicas
// outside; groups a layout does not use are refused by name.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <vector>

#include "hp/runtime.h"
#include "hp/train/parallel_dims.h"
#include "test_util.h"

namespace ht = hp::train;
using ht::Group;

namespace {

std::vector<ht::ParallelDims::Degrees> layouts(int n) {
  std::vector<ht::ParallelDims::Degrees> out;
  for (int64_t P : {1, 2}) {
    for (int64_t R : {1, 2}) {
      for (int64_t C : {1, 2}) {
        for (int64_t T : {1, 2}) {
          if (n % (P * R * C * T) != 0) continue;
          const int64_t S = n / (P * R * C * T);
          for (int64_t E : {1, 2, 4}) {
            const bool ok = E == 1 || (T == 1 ? (S * C) % E == 0 : E % T == 0 && (S * C) % (E / T) == 0);
            if (ok) out.push_back({R, -1, C, T, P, E});
          }
        }
      }
    }
  }
  return out;
}

}  // namespace

TEST(ParallelMesh, GroupsHoldTheirRanks) {
  hp::CommPtr w = hp::world();
  const int n = w->size(), me = w->rank();
  for (const auto& deg : layouts(n)) {
    const ht::ParallelDims dims(deg, n);
    SCOPED_TRACE(dims.describe() + " ep " + std::to_string(dims.ep()));
    ht::ParallelMesh mesh(dims, w);
    std::vector<Group> made = {Group::kPp, Group::kTp, Group::kShard, Group::kData, Group::kRouting};
    if (dims.dp_replicate() > 1) made.push_back(Group::kDpReplicate);
    if (dims.cp() > 1) made.push_back(Group::kCp);
    if (dims.ep() > 1) made.insert(made.end(), {Group::kEp, Group::kExpertShard});
    if (dims.ep() > 1 && dims.dp_replicate() > 1) made.push_back(Group::kExpertData);
    for (Group g : made) {
      const hp::CommPtr& c = mesh.group(g);
      const std::vector<int> want = dims.ranks(g, me);
      ASSERT_EQ(c->world_ranks(), want) << dims.label(g);
      at::Tensor x = at::full({2}, me, at::kLong);
      c->all_reduce(x).wait();
      int64_t sum = 0;
      for (int r : want) sum += r;
      EXPECT_EQ(x[1].item<int64_t>(), sum) << dims.label(g);
    }
    // One communicator for kinds with the same ranks; never the world itself.
    if (dims.dp_replicate() == 1) EXPECT_EQ(mesh.group(Group::kData), mesh.group(Group::kShard));
    for (Group g : made) EXPECT_NE(mesh.group(g), w) << dims.label(g);
    // fully_shard's mesh: (dp_replicate, dp_shard) with dp_shard the kShard group.
    const auto& f = mesh.fsdp_mesh();
    EXPECT_EQ(f->group("dp_shard"), mesh.group(Group::kShard));
    EXPECT_EQ(f->world(), mesh.group(dims.dp_replicate() > 1 ? Group::kData : Group::kShard));
    if (dims.dp_replicate() > 1) EXPECT_EQ(f->coordinate("dp_replicate"), mesh.rank_in(Group::kDpReplicate));
    if (dims.ep() > 1) {
      EXPECT_EQ(mesh.expert_fsdp_mesh()->group("expert_shard"), mesh.group(Group::kExpertShard));
    } else {
      EXPECT_EQ(mesh.expert_fsdp_mesh(), nullptr);
      hp::test::expect_error([&] { mesh.group(Group::kEp); }, {"no expert parallelism", "no group 'ep'"});
    }
    if (dims.cp() == 1) hp::test::expect_error([&] { mesh.group(Group::kCp); }, {"no group 'cp'"});
  }
}

TEST(ParallelMesh, RefusesAnotherWorldSize) {
  hp::CommPtr w = hp::world();
  const ht::ParallelDims dims({1, -1, 1, 1, 1, 1}, w->size() * 2);
  hp::test::expect_error([&] { ht::ParallelMesh(dims, w); },
                         {"covers " + std::to_string(w->size() * 2) + " ranks", "world has " + std::to_string(w->size())});
}
