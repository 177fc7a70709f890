// DeviceMesh on the real world (1 or 4 ranks): coordinates and sub-communicators.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "hp/mesh/device_mesh.h"
#include "hp/runtime.h"
#include "test_util.h"

TEST(DeviceMesh, TwoDimsGroupsReduceOverTheirRanks) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  hp::DeviceMesh mesh(w, {{"dp_replicate", 2}, {"dp_shard", -1}});
  const int shard = n / 2;
  EXPECT_EQ(mesh.size("dp_shard"), shard);
  EXPECT_EQ(mesh.coordinate("dp_replicate"), r / shard);
  EXPECT_EQ(mesh.coordinate("dp_shard"), r % shard);
  // Naive expectations: the dp_shard group holds the ranks of my row, dp_replicate my column.
  std::vector<int> row, col;
  for (int i = 0; i < n; ++i) {
    if (i / shard == r / shard) row.push_back(i);
    if (i % shard == r % shard) col.push_back(i);
  }
  EXPECT_EQ(mesh.group("dp_shard")->world_ranks(), row);
  EXPECT_EQ(mesh.group("dp_replicate")->world_ranks(), col);
  EXPECT_EQ(mesh.group({"dp_shard", "dp_replicate"}), w);
  at::Tensor x = at::full({3}, r, at::kLong);
  mesh.group("dp_shard")->all_reduce(x).wait();
  int64_t want = 0;
  for (int i : row) want += i;
  EXPECT_EQ(x[0].item<int64_t>(), want);
  at::Tensor y = at::full({3}, r, at::kLong);
  mesh.group("dp_replicate")->all_reduce(y).wait();
  want = 0;
  for (int i : col) want += i;
  EXPECT_EQ(y[1].item<int64_t>(), want);
  EXPECT_EQ(mesh.group("dp_shard")->name(), "dp_shard");
  hp::test::expect_error([&] { mesh.group("tp"); }, {"no dim named 'tp'", "dp_replicate"});
}

TEST(DeviceMesh, ThreeDimsWithCombinations) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  hp::DeviceMesh mesh(w, {{"pp", 1}, {"dp", -1}, {"tp", n % 2 == 0 ? 2 : 1}});
  const int tp = n % 2 == 0 ? 2 : 1;
  EXPECT_EQ(mesh.coordinate("tp"), r % tp);
  EXPECT_EQ(mesh.coordinate("dp"), r / tp);
  EXPECT_EQ(mesh.coordinate("pp"), 0);
  hp::CommPtr pp_tp = mesh.group({"tp", "pp"});
  EXPECT_EQ(pp_tp->size(), tp);
  hp::CommPtr dp_tp = mesh.group({"dp", "tp"});
  EXPECT_EQ(dp_tp->size(), n);
  at::Tensor x = at::ones({2});
  pp_tp->all_reduce(x).wait();
  EXPECT_EQ(x[0].item<float>(), float(tp));
}

TEST(DeviceMesh, RejectsAMeshThatDoesNotFitTheWorld) {
  auto w = hp::world();
  const int n = w->size();
  hp::test::expect_error([&] { hp::DeviceMesh(w, {{"dp", n + 1}}); },
                         {"has " + std::to_string(n + 1) + " ranks", std::to_string(n)});
  hp::test::expect_error([&] { hp::DeviceMesh(w, {{"a", -1}, {"b", -1}}); }, {"both -1"});
  hp::test::expect_error([&] { hp::DeviceMesh(nullptr, {{"a", 1}}); }, {"null"});
}
