// Overlap and memory bounds of fully_shard, from the trace and the counting allocator.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include <torch/optim/adamw.h>

#include "fsdp_model.h"
#include "fsdp_test_util.h"
#include "hp/core/memory.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/memory_estimate.h"
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

// The collectives of a step, counted in the trace, are what estimate_collectives (the
// planner's count) says, for 1 and 3 micro-batches, resharding after forward or not: one
// fused all-gather per group in forward, again in backward for all but the root and the
// last block, one reduce-scatter per group, and before it one all-reduce of which
// parameters got a gradient. The runtime and the count follow
// src/fsdp/rules.h; a drift in either fails here.
TEST(FullyShardOverlap, CollectivesAreThoseEstimated) {
  auto w = hp::world();
  if (w->size() < 2) GTEST_SKIP() << "one shard gathers and reduces nothing";
  TinyConfig c = big_blocks();
  c.layers = 4;
  for (bool reshard : {true, false}) {
    torch::manual_seed(0);
    TinyModel m(c);
    hp::FullyShardOptions o;
    o.comm_fusion = true;
    o.reshard_after_forward = reshard;
    for (auto& b : m->blocks) hp::fully_shard(*b, o);
    hp::fully_shard(*m, o);
    at::Tensor x = at::randint(c.vocab, {2, c.seq}, at::kLong);
    hp::call(m, x, x).backward();  // warm-up: lazy initialization
    for (int64_t micro : {1, 3}) {
      hp::trace::enable(::testing::TempDir() + "hp_count_trace");
      hp::trace::clear();
      for (int64_t k = 0; k < micro; ++k) hp::call(m, x, x).backward();
      hp::trace::disable();
      int64_t gathers = 0, reductions = 0, all_reduces = 0;
      for (const auto& e : hp::trace::events()) {
        if (e.cat != "comm") continue;
        gathers += e.name == "all_gather";
        reductions += e.name == "reduce_scatter";
        all_reduces += e.name == "all_reduce";
      }
      const hp::CollectiveCounts want = hp::estimate_collectives(c.layers + 1, micro, reshard, 1);
      // By hand: 5 groups, 3 of them gathered again when resharding.
      EXPECT_EQ(want.all_gathers, micro * (reshard ? 8 : 5));
      EXPECT_EQ(gathers, want.all_gathers) << "reshard " << reshard << ", " << micro << " micro-batches";
      EXPECT_EQ(reductions, want.reduce_scatters) << "reshard " << reshard << ", " << micro << " micro-batches";
      EXPECT_EQ(all_reduces, want.all_reduces + want.flag_all_reduces);
    }
  }
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
    // Forward resharded every block but the last, freeing the storage in place; the last
    // keeps its parameters for the backward, which reaches it first.
    for (size_t i = 0; i < blocks.size(); ++i) {
      const bool last = i + 1 == blocks.size();
      EXPECT_EQ(blocks[i]->is_unsharded(), last) << "block " << i;
      for (auto& t : blocks[i]->module().parameters()) EXPECT_EQ(t.storage().nbytes() == 0u, !last) << "block " << i;
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
  // Forward holds at most two unsharded blocks and the activations autograd keeps, counted
  // by hand per block of T tokens (fp32): at most 16 T x dim (the norms' inputs and
  // outputs, q, k, v and their contiguous copies, the attention output, the residual) and
  // 3 T x ffn (fc1's output, gelu's, and its input) values; the T x T scores are smaller.
  const int64_t activations = c.layers * (16 * c.seq * c.dim + 3 * c.seq * c.ffn) * 4;
  EXPECT_LE(fwd_extra, 2 * block_bytes + activations)
      << "block " << block_bytes << " bytes, activations " << activations << " bytes";
  // Backward: the current block (its parameters freed as their gradients arrive, so
  // parameters + gradients stay within a block, plus the largest gradient next to its
  // parameter for a moment), and one more block: either a reduce-scatter input (with its
  // output, block/N) or the prefetched block, never both, since the backward prefetch
  // waits for the reduce-scatters ahead of it. Plus the sharded gradients of the blocks
  // done so far, and 64 KiB for activations. Measured 4.31 / 3.28 MB at 2 / 4 ranks
  // against bounds of 5.47 / 3.69 MB; before the prefetch waited, 5.10 / 3.91 MB.
  const int64_t sharded_grads = 8 * block_bytes / w->size();
  const int64_t largest_param = static_cast<int64_t>(c.dim) * c.ffn * 4;
  EXPECT_LE(max_extra, 2 * block_bytes + block_bytes / w->size() + largest_param + sharded_grads + (64 << 10))
      << "block " << block_bytes << " bytes";
}

// The counting allocator's peak over a training step (forward, backward, AdamW) against
// estimate_memory of the same layout, which hp-train's --estimate and the planner report:
// sharded parameters, gradients and AdamW's two moments, plus backward's two unsharded
// blocks, a block of gradients and two reduce-scatter inputs. One token, so that the
// activations it leaves out are negligible. The estimate is an upper bound: the peak must
// be at most 1.05 of it (5% for what it leaves out: the root's parameters kept from forward,
// the activations) and at least the sharded state it counts (parameters, gradients, AdamW's
// moments). Measured: 1.003 of it at 1 rank, 0.90 at 2, 0.82 at 4 (backward never holds
// the two unsharded blocks, the block of gradients and the two reduce-scatter inputs at
// once, which the estimate adds up).
TEST(FullyShardOverlap, StepPeakIsWithinTheEstimate) {
  auto w = hp::world();
  TinyConfig c = big_blocks();
  c.seq = 1;
  torch::manual_seed(0);
  // The earlier tests' dead modules hold fully_shard state until their hooks are purged,
  // which registering ours would do in the middle of the measurement.
  hp::purge_expired_forward_hooks();
  const int64_t base = hp::memory::current_bytes();
  TinyModel m(c);
  std::vector<hp::FSDPHandle> handles;
  for (auto& b : m->blocks) handles.push_back(hp::fully_shard(*b));
  handles.push_back(hp::fully_shard(*m));
  std::vector<at::Tensor> params;
  int64_t total = 0, block = 0;
  for (size_t i = 0; i < handles.size(); ++i) {
    for (auto& p : handles[i]->parameters()) params.push_back(p);
    for (const auto& st : handles[i]->state_dict()) {
      int64_t numel = 1;
      for (int64_t d : st.global_shape) numel *= d;
      total += numel;
      if (i == 0) block += numel;
    }
  }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
  at::Tensor x = at::randint(c.vocab, {1, c.seq}, at::kLong);
  auto step = [&] {
    opt.zero_grad();
    hp::call(m, x, x).backward();
    opt.step();
  };
  step();  // AdamW's state exists after the first step
  hp::memory::reset_peak();
  step();
  const int64_t peak = hp::memory::peak_bytes() - base;
  const hp::MemoryEstimate e = hp::estimate_memory(total, block, at::kFloat, {}, {1, w->size()});
  const double ratio = static_cast<double>(peak) / static_cast<double>(e.total());
  std::printf("rank %d: step peak %.3f MB, estimate %.3f MB: %.3f of it\n", w->rank(), peak / 1e6, e.total() / 1e6,
              ratio);
  EXPECT_GE(peak, e.sharded_params + e.sharded_grads + e.optimizer_state) << "estimate " << e.to_string();
  EXPECT_LE(ratio, 1.05) << "peak " << peak << " B, estimate " << e.to_string();
}

namespace {

// A frozen stem (its own fully_shard group, whose output needs no gradient, so its
// backward never starts), blocks that each have a parameter getting no gradient (their
// reduction is issued late, as with MoE experts that got no tokens), a final norm.
struct StemAndBlocksImpl : torch::nn::Module {
  explicit StemAndBlocksImpl(const TinyConfig& c) {
    stem = register_module("stem", torch::nn::Linear(c.dim, c.dim));
    for (auto& t : stem->parameters()) t.requires_grad_(false);
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks.push_back(register_module("blocks_" + std::to_string(i), hp::test::Block(c)));
      blocks.back()->register_parameter("unused", at::ones({3, 5}));
    }
    nf = register_module("nf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = hp::call(stem, x);
    for (auto& b : blocks) h = hp::call(b, h);
    return (hp::call(nf, h) - y).pow(2).mean();
  }
  torch::nn::Linear stem{nullptr};
  std::vector<hp::test::Block> blocks;
  torch::nn::LayerNorm nf{nullptr};
};
TORCH_MODULE(StemAndBlocks);

}  // namespace

// A backward prefetch is held back while a reduce-scatter is in flight, then issued at a
// gradient hook that finds the reduce-scatters done, or else before the rank's next
// collective (at the latest at the end of backward). Ranks running at different speeds
// take different paths (a slow rank finds them done; a fast one waits): the collectives
// must still reach the communicator in one order on every rank, and the gradients be those
// of one process on the whole batch. The first block's prefetch target is the frozen stem,
// which is gathered only by that prefetch, and the block's own reduction comes only at the
// end of backward.
TEST(FullyShardOverlap, RanksAtDifferentSpeedsIssueCollectivesInOneOrder) {
  auto w = hp::world();
  if (w->size() < 2) GTEST_SKIP() << "needs two ranks";
  TinyConfig c = big_blocks();
  c.layers = 4;
  torch::manual_seed(0);
  StemAndBlocks ref(c);
  torch::manual_seed(0);
  StemAndBlocks m(c);
  hp::fully_shard(*m->stem);
  auto sharded = hp::test::shard_blocks_then_root(m);
  if (w->rank() % 2 == 1) {
    for (auto& b : m->blocks) {
      for (auto& t : b->parameters()) {
        if (t.requires_grad()) {
          t.register_hook([](const at::Tensor&) { std::this_thread::sleep_for(std::chrono::milliseconds(3)); });
        }
      }
    }
  }
  const int64_t per_rank = 2;
  torch::manual_seed(1);
  at::Tensor x = at::randn({per_rank * w->size(), c.seq, c.dim});
  at::Tensor y = at::randn({per_rank * w->size(), c.seq, c.dim});
  hp::call(ref, x, y).backward();
  at::Tensor xs = x.narrow(0, per_rank * w->rank(), per_rank), ys = y.narrow(0, per_rank * w->rank(), per_rank);
  hp::trace::enable(::testing::TempDir() + "hp_order_trace");
  hp::trace::clear();
  for (int step = 0; step < 3; ++step) {
    for (auto& p : sharded.params) p.mutable_grad() = at::Tensor();
    hp::call(m, xs, ys).backward();
    for (auto& b : m->blocks) EXPECT_FALSE(hp::fsdp_handle(*b)->is_unsharded());
    EXPECT_FALSE(hp::fsdp_handle(*m->stem)->is_unsharded()) << "the stem was left gathered after backward";
  }
  hp::trace::disable();
  // The ops as the communicator ran them, in order: the same string on every rank.
  std::string ops;
  for (const auto& e : hp::trace::events()) {
    if (e.cat == "comm") ops += e.name + ";";
  }
  const double h = static_cast<double>(std::hash<std::string>{}(ops) % (1ull << 50));
  at::Tensor mx = at::tensor({h, static_cast<double>(ops.size())}, at::kDouble), mn = mx.clone();
  w->all_reduce(mx, {hp::ReduceOp::MAX}).wait();
  w->all_reduce(mn, {hp::ReduceOp::MIN}).wait();
  EXPECT_TRUE(mx.equal(mn)) << "rank " << w->rank() << " ran its collectives in another order: " << ops;
  // The last step's gradients against one process's, by name; the unused parameters: one
  // process leaves no gradient, and neither does fully_shard.
  double worst = 0;
  int compared = 0;
  for (size_t i = 0; i < sharded.handles.size(); ++i) {
    const bool root = i + 1 == sharded.handles.size();
    torch::nn::Module& ref_module = root ? static_cast<torch::nn::Module&>(*ref) : *ref->blocks[i];
    auto params = sharded.handles[i]->parameters();
    auto sd = sharded.handles[i]->state_dict();
    const auto ref_params = ref_module.named_parameters();  // find() points into it
    for (size_t j = 0; j < sd.size(); ++j) {
      const at::Tensor* want = ref_params.find(sd[j].name);
      ASSERT_NE(want, nullptr) << sd[j].name;
      // A parameter no rank produced a gradient for keeps none, as in one process.
      ASSERT_EQ(params[j].grad().defined(), want->grad().defined()) << sd[j].name;
      ++compared;
      if (!want->grad().defined()) continue;
      at::Tensor full = hp::test::reassemble(sd[j], params[j].grad(), w);
      const at::Tensor& g = want->grad();
      worst = std::max(worst, (full - g).abs().max().item<double>() / (g.abs().max().item<double>() + 1e-12));
    }
  }
  EXPECT_EQ(compared, c.layers * 12 + 2);  // per block: 11 parameters and the unused one; nf
  EXPECT_LT(worst, 1e-5);
}

// A module that only an explicit backward prefetch gathers, and that did not run in the
// forward, is resharded at the end of the backward on every rank, whether its gather was
// held back behind a reduce-scatter, queued behind one, or issued at once (which one differs
// between ranks with timing; a module left gathered on some ranks only would skip a gather
// there in a later forward, pairing different collectives across ranks).
TEST(FullyShardOverlap, APrefetchTargetThatDidNotRunIsReshardedAfterBackward) {
  auto w = hp::world();
  if (w->size() < 2) GTEST_SKIP() << "one rank holds everything: nothing is resharded";
  TinyConfig c = big_blocks();
  c.layers = 3;
  torch::manual_seed(0);
  TinyModel m(c);
  torch::nn::Linear spare(c.dim, c.dim);  // never called
  hp::FSDPHandle spare_h = hp::fully_shard(*spare);
  std::vector<hp::FSDPHandle> blocks;
  for (auto& b : m->blocks) blocks.push_back(hp::fully_shard(*b));
  hp::fully_shard(*m);
  // The last block's backward (no reduce-scatter in flight yet) and the first's (behind
  // the second's reduce-scatter) both prefetch it.
  blocks.back()->set_modules_to_backward_prefetch({spare_h});
  blocks.front()->set_modules_to_backward_prefetch({spare_h});
  at::Tensor x = at::randint(c.vocab, {1, c.seq}, at::kLong);
  for (int step = 0; step < 2; ++step) {
    hp::call(m, x, x).backward();
    EXPECT_FALSE(spare_h->is_unsharded()) << "step " << step;
    for (auto& t : spare->parameters()) EXPECT_EQ(t.storage().nbytes(), 0u) << "step " << step;
  }
}
