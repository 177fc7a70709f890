// Overlap and memory bounds of fully_shard, from the trace and the counting allocator.
#include <gtest/gtest.h>

#include <algorithm>

#include "fsdp_model.h"
#include "hp/core/memory.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"
#include "test_util.h"

using hp::test::TinyConfig;
using hp::test::TinyModel;

namespace {

TinyConfig big_blocks() {
  TinyConfig c;
  c.vocab = 16;
  c.dim = 128;
  c.ffn = 512;
  c.layers = 8;
  c.seq = 4;
  return c;
}

}  // namespace

// In a 2-rank run, a block's reduce-scatter (issue -> completion) overlaps the backward
// compute of another block: reductions are issued as each block's backward finishes,
// not at the end.
TEST(FullyShardOverlap, ReduceScatterOverlapsTheNextBlocksBackward) {
  auto w = hp::world();
  if (w->size() < 2) GTEST_SKIP() << "needs two ranks";
  TinyConfig c = big_blocks();
  torch::manual_seed(0);
  TinyModel m(c);
  for (auto& b : m->blocks) hp::fully_shard(*b);
  hp::fully_shard(*m);
  at::Tensor x = at::randint(c.vocab, {8, c.seq}, at::kLong);
  hp::call(m, x, x).backward();  // warm-up
  hp::trace::enable(::testing::TempDir() + "hp_overlap_trace");
  hp::trace::clear();
  hp::call(m, x, x).backward();
  hp::trace::disable();
  auto events = hp::trace::events();
  std::vector<hp::trace::Event> rs, bwd;
  for (const auto& e : events) {
    if (e.cat == "comm" && e.name == "reduce_scatter") rs.push_back(e);
    if (e.cat == "compute" && e.name.rfind("backward hp::test::BlockImpl", 0) == 0) bwd.push_back(e);
  }
  ASSERT_EQ(bwd.size(), c.layers) << "one backward span per block";
  ASSERT_GE(rs.size(), c.layers);
  int overlapping = 0;
  for (const auto& r : rs) {
    for (const auto& b : bwd) {
      bool overlap = b.ts_us < r.ts_us + r.dur_us && r.ts_us < b.ts_us + b.dur_us;
      // The block whose gradients this is ended its backward when the op was issued.
      if (overlap && b.ts_us + b.dur_us > r.ts_us) ++overlapping;
    }
  }
  EXPECT_GT(overlapping, 0) << "no reduce-scatter ran during another block's backward";
}

// Memory, measured by the counting allocator on a model whose activations are tiny next
// to its parameters: during forward and backward at most the current and the prefetched
// block are unsharded, resharding frees parameters in place, and reduce-scatter inputs do
// not pile up.
TEST(FullyShardOverlap, UnshardedParametersStayWithinTwoBlocks) {
  auto w = hp::world();
  TinyConfig c = big_blocks();
  torch::manual_seed(0);
  TinyModel m(c);
  std::vector<hp::FSDPHandle> blocks;
  for (auto& b : m->blocks) blocks.push_back(hp::fully_shard(*b));
  hp::fully_shard(*m);
  // Bytes of one block's unsharded parameters (padded to the shard count).
  int64_t block_bytes = 0;
  for (const auto& st : blocks[0]->state_dict()) {
    int64_t rows = (st.global_shape[0] + w->size() - 1) / w->size() * w->size();
    block_bytes += rows * (st.local.numel() / std::max<int64_t>(1, st.local.size(0))) * 4;
  }
  int max_unsharded = 0;
  int64_t max_extra = 0, base = 0;
  auto observe = [&] {
    int count = 0;
    for (auto& h : blocks) count += h->is_unsharded() ? 1 : 0;
    max_unsharded = std::max(max_unsharded, count);
    max_extra = std::max(max_extra, hp::memory::current_bytes() - base);
  };
  for (auto& b : m->blocks) {
    hp::ForwardHooks h;
    h.pre = [&](torch::nn::Module&) { observe(); };  // runs after fully_shard's own pre hook
    hp::register_forward_hooks(*b, h);
    for (auto& t : b->parameters()) {
      t.register_hook([&](const at::Tensor&) { observe(); });  // during that block's backward
    }
  }
  at::Tensor x = at::randint(c.vocab, {1, c.seq}, at::kLong);
  hp::call(m, x, x).backward();  // warm-up: optimizer-free, grads land on the shards
  for (auto& h : blocks) {
    for (auto& p : h->parameters()) p.mutable_grad() = at::Tensor();
  }
  base = hp::memory::current_bytes();
  max_unsharded = 0;
  max_extra = 0;
  at::Tensor loss = hp::call(m, x, x);
  if (w->size() > 1) {
    // Forward resharded every block, freeing the storage in place.
    for (auto& h : blocks) {
      EXPECT_FALSE(h->is_unsharded());
      for (auto& t : h->module().parameters()) EXPECT_EQ(t.storage().nbytes(), 0u);
    }
  }
  int fwd_max = max_unsharded;
  int64_t fwd_extra = max_extra;
  loss.backward();
  if (w->size() == 1) {
    // One shard: the module's parameters alias the shards; nothing is gathered or copied.
    EXPECT_LT(fwd_extra, block_bytes / 2);
    return;
  }
  EXPECT_LE(fwd_max, 1) << "forward prefetches nothing unless asked";
  EXPECT_LE(max_unsharded, 2) << "current + prefetched block";
  EXPECT_GE(fwd_extra, block_bytes) << "the running block was unsharded";
  EXPECT_LE(fwd_extra, 2 * block_bytes + (1 << 20));
  // Backward: two unsharded blocks, the current block's gradients and one reduce-scatter
  // input, plus the accumulated sharded gradients of the blocks done so far (measured:
  // 5.6 MB at 2 ranks against this 7.3 MB bound; reduce-scatter inputs kept until the end
  // would add 6.3 MB).
  int64_t sharded_grads = 8 * block_bytes / w->size();
  EXPECT_LE(max_extra, 4 * block_bytes + sharded_grads + (1 << 20))
      << "block " << block_bytes << " bytes";
}
