// The local backend: a world of one rank, no MPI.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "hp/comm/communicator.h"
#include "test_util.h"

TEST(LocalBackend, CollectivesAreCopies) {
  hp::CommPtr c = hp::make_local_communicator();
  EXPECT_EQ(c->backend(), "local");
  EXPECT_EQ(c->size(), 1);
  at::Tensor in = at::arange(6, at::kFloat);
  at::Tensor out = at::empty({6});
  c->all_gather(out, in).wait();
  EXPECT_TRUE(at::equal(out, in));
  at::Tensor rs = at::empty({6});
  c->reduce_scatter(rs, in, {hp::ReduceOp::AVG}).wait();
  EXPECT_TRUE(at::equal(rs, in));  // average over one rank
  at::Tensor x = in.clone();
  c->all_reduce(x, {hp::ReduceOp::MAX}).wait();
  EXPECT_TRUE(at::equal(x, in));
  at::Tensor a2a = at::empty({6});
  c->all_to_all(a2a, in).wait();
  EXPECT_TRUE(at::equal(a2a, in));
  c->broadcast(x, 0).wait();
  c->barrier().wait();
  hp::test::expect_error([&] { c->send(x, 0); }, {"itself"});
  EXPECT_EQ(c->split(-1, 0), nullptr);
  hp::CommPtr g = c->new_group({0}, {std::chrono::milliseconds(0), "solo"});
  EXPECT_EQ(g->name(), "solo");
  EXPECT_EQ(g->size(), 1);
}
