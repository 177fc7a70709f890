// MeshLayout: pure layout logic, no ranks.
#include <gtest/gtest.h>

#include "hp/mesh/device_mesh.h"
#include "test_util.h"

using hp::MeshLayout;
using hp::test::expect_error;

TEST(MeshLayout, ResolvesTheRestDim) {
  MeshLayout l({{"dp_replicate", 2}, {"dp_shard", -1}}, 8);
  EXPECT_EQ(l.sizes(), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(l.size("dp_shard"), 4);
}

TEST(MeshLayout, RowMajorCoordinatesAndGroupsMatchNaiveLoops) {
  MeshLayout l({{"pp", 2}, {"dp", 3}, {"tp", 4}}, 24);
  for (int r = 0; r < 24; ++r) {
    // Row-major by hand: r = pp*12 + dp*4 + tp.
    std::vector<int64_t> c{r / 12, (r / 4) % 3, r % 4};
    EXPECT_EQ(l.coordinates(r), c);
    EXPECT_EQ(l.rank_at(c), r);
    std::vector<int> tp_group, pp_dp_group;
    for (int q = 0; q < 24; ++q) {
      if (q / 4 == r / 4) tp_group.push_back(q);
      if (q % 4 == r % 4) pp_dp_group.push_back(q);
    }
    EXPECT_EQ(l.group_ranks(r, {"tp"}), tp_group);
    EXPECT_EQ(l.group_ranks(r, {"dp", "pp"}), pp_dp_group);  // name order does not matter
    EXPECT_EQ(l.group_index(r, {"tp"}), r / 4);
    EXPECT_EQ(l.rank_in_group(r, {"tp"}), r % 4);
    EXPECT_EQ(l.rank_in_group(r, {"pp", "dp"}), r / 4);
  }
}

TEST(MeshLayout, BadMeshesAreClearErrors) {
  expect_error([] { MeshLayout({{"dp", 3}}, 4); }, {"has 3 ranks", "world has 4"});
  expect_error([] { MeshLayout({{"dp", 3}, {"tp", -1}}, 4); }, {"not divisible by 3"});
  expect_error([] { MeshLayout({{"dp", 2}, {"dp", 2}}, 4); }, {"'dp' is used twice"});
  expect_error([] { MeshLayout({{"dp", 0}}, 4); }, {"'dp' has size 0"});
  expect_error([] { MeshLayout({{"dp", -2}}, 4); }, {"'dp' has size -2"});
  expect_error([] { MeshLayout({{"dp", -1}, {"tp", -1}}, 4); }, {"'dp' and 'tp' are both -1"});
  expect_error([] { MeshLayout({}, 4); }, {"at least one dim"});
  MeshLayout l({{"dp", 4}}, 4);
  expect_error([&] { l.size("tp"); }, {"no dim named 'tp'", "dims: dp"});
  expect_error([&] { l.group_ranks(0, {"dp", "dp"}); }, {"named twice"});
  expect_error([&] { l.coordinates(4); }, {"rank 4"});
}
