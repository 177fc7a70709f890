// The memory estimate against values computed by hand.
#include <gtest/gtest.h>

#include "hp/models/llama.h"
#include "hp/fsdp/memory_estimate.h"
#include "test_util.h"

using hp::estimate_memory;

TEST(MemoryEstimate, Fp32FsdpOverFourRanks) {
  // 1000 params, blocks of 100, fp32 everything, 4 shards: 250 per rank.
  auto m = estimate_memory(1000, 100, at::kFloat, {}, {1, 4});
  EXPECT_EQ(m.sharded_params, 250 * 4);
  EXPECT_EQ(m.sharded_grads, 250 * 4);
  EXPECT_EQ(m.optimizer_state, 2 * 250 * 4);
  EXPECT_EQ(m.fp32_masters, 0);
  // 2 unsharded blocks + block grads + 2 reduce-scatter inputs, all fp32.
  EXPECT_EQ(m.backward_peak_extra, (2 * 100 + 100 + 2 * 100) * 4);
  EXPECT_EQ(m.total(), 1000 + 1000 + 2000 + 2000);
}

// Resharding to groups of 2 after forward keeps half of the model (bf16 all-gather dtype
// here) from forward to backward; a group size that does not divide dp_shard is refused.
TEST(MemoryEstimate, ReshardToGroupsKeepsTheGroupsShares) {
  hp::MixedPrecisionPolicy p;
  p.param_dtype = at::kBFloat16;
  auto m = estimate_memory(1000, 100, at::kFloat, p, {1, 4, 2});
  EXPECT_EQ(m.post_forward_shares, 500 * 2);
  EXPECT_EQ(m.total(), estimate_memory(1000, 100, at::kFloat, p, {1, 4}).total() + 1000);
  EXPECT_NE(m.to_string().find("kept from forward"), std::string::npos);
  hp::test::expect_error([&] { estimate_memory(1000, 100, at::kFloat, p, {1, 4, 3}); },
                         {"reshard_after_forward_group_size=3", "dp_shard=4"});
}

// Under a pipeline a rank's stages stay whole from their first micro-batch to their last,
// their gradients accumulating unsharded: the whole 1000 in the compute dtype (bf16) and in
// the accumulation dtype (the fp32 reduction's), beside one block's fresh bf16 gradient and
// two fp32 reduce-scatter inputs of a block.
TEST(MemoryEstimate, APipelineKeepsItsStagesWholeThroughTheStep) {
  hp::MixedPrecisionPolicy p;
  p.param_dtype = at::kBFloat16;
  p.reduce_dtype = at::kFloat;
  hp::ParallelLayout l{1, 4, 0, /*unsharded_through_step=*/true};
  auto m = estimate_memory(1000, 100, at::kFloat, p, l);
  EXPECT_EQ(m.backward_peak_extra, 1000 * 2 + 1000 * 4 + 100 * 2 + 2 * 100 * 4);
  EXPECT_EQ(m.post_forward_shares, 0);
  EXPECT_EQ(m.sharded_params, 250 * 4);  // the sharded state as without a pipeline
  EXPECT_EQ(m.optimizer_state, 2 * 250 * 4);
}

TEST(MemoryEstimate, Bf16ShardsWithMainGradsAndMasters) {
  hp::MixedPrecisionPolicy p;
  p.reduce_dtype = at::kFloat;
  p.apply_grad_on_fp32_main_grad = true;
  auto m = estimate_memory(800, 100, at::kBFloat16, p, {2, 2});  // HSDP: shards over 2
  EXPECT_EQ(m.sharded_params, 400 * 2);
  EXPECT_EQ(m.sharded_grads, 400 * 4);     // fp32 main grads
  EXPECT_EQ(m.optimizer_state, 2 * 400 * 4);  // AdamW steps the fp32 masters
  EXPECT_EQ(m.fp32_masters, 400 * 4);
  EXPECT_EQ(m.backward_peak_extra, 2 * 100 * 2 + 100 * 2 + 2 * 100 * 4);
}

TEST(MemoryEstimate, OneShardAliasesAndBadLayouts) {
  auto m = estimate_memory(1000, 100, at::kFloat, {}, {1, 1});
  EXPECT_EQ(m.backward_peak_extra, 100 * 4);  // only the block's gradients
  hp::test::expect_error([] { estimate_memory(1000, 100, at::kFloat, {}, {1, 0}); }, {"dp_shard=0"});
  // From a published config, without allocating it: Llama 3 8B over 8 shards, fp32 AdamW.
  auto c = hp::models::LlamaConfig::llama3_8b();
  auto e = estimate_memory(c.num_params(), c.block_params(), at::kFloat, {}, {1, 8});
  EXPECT_NEAR(e.sharded_params / 1e9, 8.03 * 4 / 8, 0.01);
}

// By hand: 9 groups (8 blocks and the root), 4 micro-batches, HSDP over 2 replicas.
// Resharding after forward gathers 9 in forward and 7 again in backward (all but the root
// and the last block) per micro-batch; each group reduces once per micro-batch and, across
// replicas, all-reduces what it reduced; before each of those it agrees on which parameters
// got a gradient (a flag all-reduce).
TEST(MemoryEstimate, CollectivesOfAStep) {
  auto c = hp::estimate_collectives(9, 4, true, 2);
  EXPECT_EQ(c.all_gathers, 4 * (9 + 7));
  EXPECT_EQ(c.reduce_scatters, 4 * 9);
  EXPECT_EQ(c.all_reduces, 4 * 9);
  EXPECT_EQ(c.flag_all_reduces, 2 * 4 * 9);  // before each reduce-scatter and each all-reduce
  c = hp::estimate_collectives(9, 1, false, 1);  // a pipeline's once-a-step, kept parameters
  EXPECT_EQ(c.all_gathers, 9);
  EXPECT_EQ(c.reduce_scatters, 9);
  EXPECT_EQ(c.all_reduces, 0);
  EXPECT_EQ(c.flag_all_reduces, 9);
  EXPECT_EQ(hp::estimate_collectives(1, 2, true, 1).all_gathers, 2);  // a root alone: nothing again
  hp::test::expect_error([] { hp::estimate_collectives(3, 1, true, 0); }, {"dp_replicate=0"});
}
