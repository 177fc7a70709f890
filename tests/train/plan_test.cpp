// hp-train --plan's model against figures worked out by hand in this file: the layouts of a
// world, the parameters each rank holds, and the step time of a fixed compute profile over a
// given link (compute, fully_shard's, tensor parallel's and the pipeline's communication,
// the 1F1B bubble), with overlap off and on; memory that does not fit; the FLOP count for a
// given device.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "hp/train/plan.h"

namespace ht = hp::train;

namespace {

// Llama tiny (dim 64, 2 layers, 4 heads, 2 kv heads, vocab 256), sequences of 64, a global
// batch of 16 in 4 micro-batches.
ht::TrainConfig tiny() {
  ht::TrainConfig c = ht::parse_config("model:\n  type: llama\nglobal_batch_size: 16\nmicro_batch_num: 4\n"
                                       "seq_length: 64\noutput_dir: ''\n",
                                       {}, "plan.yaml");
  return c;
}

// By hand: q 64x64, k and v 64x32, o 64x64; SwiGLU hidden 8/3 x 64 = 170.7, rounded up to a
// multiple of 32: 192, three 64x192 matrices; two norms of 64.
constexpr double kBlock = 4096 + 2048 + 2048 + 4096 + 3 * 64 * 192 + 2 * 64;  // 49280
constexpr double kModel = 2 * kBlock + 2 * 256 * 64 + 64;                      // 131392

// A profile fixed by the test: (forward, backward) 10 and 20 ms for the first block with the
// embedding, head and loss, 4 and 8 ms for each further block; 1 ns per parameter of AdamW.
struct FakeCompute {
  std::shared_ptr<std::map<int64_t, int>> asked = std::make_shared<std::map<int64_t, int>>();
  double matmul_forward_layer = 0;  // unknown: tensor parallelism divides everything
  ht::ComputeProfile operator()(int64_t samples, int threads, int /*copies*/) const {
    (*asked)[samples] = threads;
    ht::ComputeProfile p;
    p.forward_first = 0.010;
    p.backward_first = 0.020;
    p.forward_layer = 0.004;
    p.backward_layer = 0.008;
    p.optimizer_per_param = 1e-9;
    p.matmul_forward_layer = matmul_forward_layer;
    p.activations_first = 500;  // bytes a micro-batch keeps: 500 with one block, 400 more per block
    p.activations_layer = 400;
    p.source = "fake";
    return p;
  }
};

// The row of a layout, under the config's fully_shard strategy or (`optim`) the planner's
// ZeRO-1 variant of it.
const ht::PlanRow& find(const std::vector<ht::PlanRow>& rows, int64_t r, int64_t s, int64_t t, int64_t p,
                        bool optim = false) {
  for (const auto& row : rows) {
    const auto& c = row.config;
    if (c.data_parallel == r && c.data_parallel_shard == s && c.tensor_parallel == t && c.pipeline_parallel == p &&
        (c.data_parallel_shard_strategy == ht::ShardStrategy::kOptim) == optim) {
      return row;
    }
  }
  throw std::runtime_error("no such layout");
}

// 10 us per op and 1 GB/s: `seconds` of moving `bytes` with bus factor `f`, in `ops` ops.
// The expectations below are exact sums of such terms in double; the bounds (1e-12 s for
// compute, 1e-9 s for communication: one byte at 1 GB/s) only absorb rounding.
double link(double f, double bytes, double ops = 1) { return ops * 10e-6 + f * bytes / 1e9; }

ht::PlanOptions options(int world, int cores) {
  ht::PlanOptions o;
  o.world = world;
  o.network = hp::SimulatedNetwork::parse("10:1");
  o.cores_per_node = cores;
  o.threads_per_rank = 1;
  o.memory_per_rank = int64_t{1} << 40;
  return o;
}

}  // namespace

TEST(Plan, EveryLayoutOfTheWorldOnceWithTheReasonOfEachInfeasibleOne) {
  FakeCompute fake;
  const auto rows = ht::plan_layouts(tiny(), options(4, 4), fake);
  // 4 = r s cp t p: the ordered factorizations of 2^2 into five factors, C(6, 4) = 15; and
  // the 7 of them with p = 1 and s cp > 1 again under optim (ZeRO-1): the 10 of r s cp t
  // less the 3 of r t alone.
  ASSERT_EQ(rows.size(), 22u);
  std::set<std::vector<int64_t>> seen;
  for (const auto& row : rows) {
    const auto& c = row.config;
    EXPECT_EQ(c.data_parallel * c.data_parallel_shard * c.context_parallel * c.tensor_parallel * c.pipeline_parallel, 4);
    seen.insert({c.data_parallel, c.data_parallel_shard, c.context_parallel, c.tensor_parallel, c.pipeline_parallel});
  }
  EXPECT_EQ(seen.size(), 15u);
  const auto& tp4 = find(rows, 1, 1, 4, 1);
  EXPECT_FALSE(tp4.feasible);
  EXPECT_NE(tp4.reason.find("kv_heads=2"), std::string::npos) << tp4.reason;
  const auto& pp4 = find(rows, 1, 1, 1, 4);
  EXPECT_FALSE(pp4.feasible);
  EXPECT_NE(pp4.reason.find("2 layers"), std::string::npos) << pp4.reason;
  // Feasible ones first, fastest first.
  size_t feasible = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].feasible) continue;
    EXPECT_EQ(i, feasible++) << "an infeasible layout ranked before a feasible one";
    if (i > 0) {
      EXPECT_LE(rows[i - 1].step_s, rows[i].step_s);
    }
  }
  EXPECT_EQ(feasible, 20u);  // all but tp 4 and pp 4
  // A rank's micro-batch: 16 / (data-parallel ranks x 4 micro-batches) sequences.
  EXPECT_EQ(*fake.asked, (std::map<int64_t, int>{{1, 1}, {2, 1}, {4, 1}}));
}

// optim (ZeRO-1) holds the whole model and its gradients only across micro-batches: with one
// micro-batch it is optim_grads (the same estimate); with 4, over dp_shard 2, the model and
// its fp32 gradients through the step (8 kModel bytes) where optim_grads keeps the model
// from forward to backward (4 kModel) and 2 unsharded blocks (8 kBlock).
TEST(Plan, OptimHoldsTheModelOnlyAcrossMicroBatches) {
  for (int64_t m : {1, 4}) {
    ht::TrainConfig z = tiny(), g = tiny();
    z.micro_batch_num = g.micro_batch_num = m;
    z.data_parallel_shard_strategy = ht::ShardStrategy::kOptim;
    g.data_parallel_shard_strategy = ht::ShardStrategy::kOptimGrads;
    z.validate(2);
    g.validate(2);
    const int64_t diff = ht::estimate_rank_memory(z).estimate.total() - ht::estimate_rank_memory(g).estimate.total();
    EXPECT_EQ(diff, m == 1 ? 0 : static_cast<int64_t>(4 * kModel - 8 * kBlock)) << m << " micro-batches";
  }
}

TEST(Plan, StepTimeOfEachKindOfLayoutAsWorkedOutByHand) {
  const auto rows = ht::plan_layouts(tiny(), options(2, 2), FakeCompute{});
  ASSERT_EQ(rows.size(), 7u);  // r, s, cp, t, p: one of them 2; s or cp also under optim
  const double world_sums = 3 * link(2.0 * 1 / 2, 16);  // gradient norm, loss, step time
  {
    // fully_shard over 2: each of 4 micro-batches runs 1 + 1 more blocks forward and back.
    const auto& r = find(rows, 1, 2, 1, 1);
    ASSERT_TRUE(r.feasible) << r.reason;
    EXPECT_FALSE(r.overlap);  // 2 cores, 2 ranks of 1 thread: no core to spare
    EXPECT_EQ(r.memory.rank_params, static_cast<int64_t>(kModel));
    EXPECT_NEAR(r.compute_s, 4 * (0.030 + 0.012) + 1e-9 * kModel / 2, 1e-12);
    // Per micro-batch: the gathers of forward (3 ops: 2 blocks and the root), of backward
    // after resharding (the first block only: the root and the last block keep theirs for
    // it), and one reduce-scatter of the fp32 model (3 ops); each op of a whole number of
    // bytes, bus 1/2. Before each reduce-scatter, an all-reduce of the flags of which
    // parameters got a gradient (64 bytes counted, bus 2 x 1/2).
    const double one = link(0.5, 3 * std::floor(4 * kModel / 3), 3);
    const double flags = 4 * 3 * link(1.0, 64);
    EXPECT_NEAR(r.fsdp_comm_s, 4 * (1 + 1.0 / 3 + 1) * one + flags, 1e-9);
    EXPECT_NEAR(r.exposed_s, 4 * (1 + 1.0 / 3 + 1) * one + flags + world_sums, 1e-9);
    EXPECT_NEAR(r.step_s, r.compute_s + r.exposed_s, 1e-12);
    // The same under optim (ZeRO-1): gathered in the first micro-batch's forward (3 ops)
    // and reduced after the last one's backward (3 ops, their flags before), once a step.
    // For it the rank holds the whole model in fp32 and its fp32 gradients through the
    // step, where the plain layout holds 2 unsharded blocks: 8 (kModel - kBlock) bytes more.
    const auto& z = find(rows, 1, 2, 1, 1, /*optim=*/true);
    ASSERT_TRUE(z.feasible) << z.reason;
    EXPECT_EQ(z.layout(), "dp_replicate=1 dp_shard=2 tp=1 pp=1 optim");
    EXPECT_NEAR(z.compute_s, r.compute_s, 1e-12);
    EXPECT_NEAR(z.fsdp_comm_s, (1 + 1) * one + 3 * link(1.0, 64), 1e-9);
    EXPECT_NEAR(z.exposed_s, z.fsdp_comm_s + world_sums, 1e-9);
    EXPECT_EQ(z.memory.estimate.backward_peak_extra - r.memory.estimate.backward_peak_extra,
              static_cast<int64_t>(8 * (kModel - kBlock)));
    EXPECT_EQ(z.memory.estimate.sharded_params, r.memory.estimate.sharded_params);
  }
  {
    // Tensor parallel over 2: half the compute; per micro-batch of 4 x 64 tokens x 64 fp32,
    // two all-reduces (bus 2 x 1/2) per block and the embedding/head, forward and backward.
    const auto& r = find(rows, 1, 1, 2, 1);
    ASSERT_TRUE(r.feasible) << r.reason;
    const double tp_params = (kModel - 5 * 64) / 2 + 5 * 64;  // the 5 norms whole
    EXPECT_EQ(r.memory.rank_params, static_cast<int64_t>(tp_params));
    EXPECT_NEAR(r.compute_s, 4 * 0.042 / 2 + 1e-9 * tp_params, 1e-12);
    const double act = 4 * 64 * 64 * 4;
    EXPECT_NEAR(r.tp_comm_s, 4 * 2 * 3 * link(1.0, 2 * act, 2), 1e-9);
    EXPECT_NEAR(r.exposed_s, r.tp_comm_s + world_sums, 1e-9);
    EXPECT_EQ(r.fsdp_comm_s, 0);
  }
  {
    // Two pipeline stages of one block, 1F1B over 4 micro-batches. Stage 0: forward 4 ms,
    // backward 8; stage 1 (with the head and loss) 4 + 6 and 8 + 12. Stage 1 paces the step:
    // it starts after stage 0's first forward, then never waits (replayed by hand:
    // F0 4-14, B0 14-34, F1 34-44, B1 44-64, ... B3 104-124), and stage 0's last backward
    // follows: 4 + 4 x 30 + 8 = 132 ms. Busy: stage 1 120, stage 0 4 x 12 = 48; bubble
    // (12 + 84) / (2 x 132). Each forward and backward also waits for the activation hop
    // (4 x 64 x 64 fp32): 10 of them on the path.
    const auto& r = find(rows, 1, 1, 1, 2);
    ASSERT_TRUE(r.feasible) << r.reason;
    const double stage1 = kBlock + 256 * 64 + 64;  // block, final norm, head
    EXPECT_EQ(r.memory.rank_params, static_cast<int64_t>(stage1));
    EXPECT_NEAR(r.compute_s, 0.132 + 1e-9 * stage1, 1e-12);
    EXPECT_NEAR(r.bubble, (0.012 + 0.084) / (2 * 0.132), 1e-12);
    const double hop = link(1.0, 4 * 64 * 64 * 4);
    EXPECT_NEAR(r.pp_comm_s, 2 * 4 * hop, 1e-12);
    EXPECT_NEAR(r.exposed_s, 10 * hop + world_sums, 1e-9);
  }
  {
    // Replicas: one all-reduce (bus 2 x 1/2) of the fp32 gradients per micro-batch.
    const auto& r = find(rows, 2, 1, 1, 1);
    ASSERT_TRUE(r.feasible) << r.reason;
    EXPECT_NEAR(r.fsdp_comm_s, 4 * link(1.0, 4 * kModel), 1e-9);
  }
  {
    // Context parallel 2 (ring): half of every block's work, fully_shard over dp_shard x cp
    // = 2 as dp_shard 2 would. Activations: half of each block's 400 and of the head's 100,
    // but attention's tiles while computing, which do not shrink with the tokens (one tile
    // of the 64 positions, 2 x 64 x 64 fp32 scores per head and sequence: 4 sequences x 4
    // heads), whole where the profile counted them halved. Per block and
    // micro-batch of 4 x 32 local tokens
    // the K/V block is 4 x 32 x 64 fp32 = 32768 bytes: one send forward, one and the two
    // gradient blocks backward, each under a block's 2 ms of compute (not exposed).
    const ht::PlanRow* cp = nullptr;
    for (const auto& row : rows) {
      if (row.config.context_parallel == 2) cp = &row;
    }
    ASSERT_NE(cp, nullptr);
    const auto& r = *cp;
    ASSERT_TRUE(r.feasible) << r.reason;
    EXPECT_EQ(r.layout(), "dp_replicate=1 dp_shard=1 cp=2 tp=1 pp=1");
    EXPECT_NEAR(r.compute_s, 4 * 0.042 / 2 + 1e-9 * kModel / 2, 1e-12);
    EXPECT_NEAR(r.activations, 50 + 2 * 400 / 2 + 4 * 4 * 2 * 64 * 64 * 4 / 2.0, 1e-9);
    EXPECT_NEAR(r.cp_comm_s, 4 * 2 * 4 * link(1.0, 32768), 1e-12);
    const auto& fsdp = find(rows, 1, 2, 1, 1);
    EXPECT_NEAR(r.fsdp_comm_s, fsdp.fsdp_comm_s, 1e-12);
    EXPECT_NEAR(r.exposed_s, fsdp.exposed_s, 1e-12);
  }
}

// Tensor parallelism divides a block's matrix products by its degree; of the rest, the
// work on whole activations (the norms' and the column-parallel products' inputs: the
// activations' whole share, 4 x 64 of 1220 elements) stays whole on every rank.
TEST(Plan, TensorParallelDividesTheMatrixProductsAndPartOfTheRest) {
  FakeCompute fake;
  fake.matmul_forward_layer = 0.003;  // of the 4 ms block forward: 3/4 in products
  const auto rows = ht::plan_layouts(tiny(), options(2, 2), fake);
  const auto& r = find(rows, 1, 1, 2, 1);
  ASSERT_TRUE(r.feasible) << r.reason;
  const double whole = 4.0 * 64 / 1220, mm = 0.75;
  const double scale = mm / 2 + (1 - mm) * (whole + (1 - whole) / 2);
  const double tp_params = (kModel - 5 * 64) / 2 + 5 * 64;
  EXPECT_NEAR(r.compute_s, 4 * 0.042 * scale + 1e-9 * tp_params, 1e-12);
  // Without tensor parallelism nothing changes.
  EXPECT_NEAR(find(rows, 1, 2, 1, 1).compute_s, 4 * 0.042 + 1e-9 * kModel / 2, 1e-12);
}

TEST(Plan, ActivationsOfOneMicroBatchOrOfThoseAPipelineHolds) {
  const auto rows = ht::plan_layouts(tiny(), options(2, 2), FakeCompute{});
  // One micro-batch at a time: 500 + 400 bytes.
  EXPECT_EQ(find(rows, 1, 2, 1, 1).activations, 900);
  // Tensor parallel 2 without sequence parallel: the head's 100 split; of each block's 400
  // the norms' and column-parallel products' inputs (4 x 64 of the 1220 elements a position
  // keeps, counted in GivenDeviceCountsFlopsAtHalfItsPeak) whole, the rest split.
  const double share = 4.0 * 64 / 1220;
  // Bytes; 1e-9 absorbs only the rounding of the shares' divisions.
  EXPECT_NEAR(find(rows, 1, 1, 2, 1).activations, 100.0 / 2 + 2 * 400 * (share + (1 - share) / 2), 1e-9);
  // 1F1B over 2 stages: the first rank holds 2 micro-batches of its stage (one block, 400),
  // the last one of its stage (one block with the head and loss: 500): the larger, 800.
  EXPECT_EQ(find(rows, 1, 1, 1, 2).activations, 800);
  // A layout whose state fits but not with its activations: named with both.
  ht::PlanOptions o = options(2, 2);
  const auto& fsdp = find(rows, 1, 2, 1, 1);
  o.memory_per_rank = fsdp.memory.estimate.total() + 500;
  const auto tight = ht::plan_layouts(tiny(), o, FakeCompute{});
  const auto& r = find(tight, 1, 2, 1, 1);
  EXPECT_FALSE(r.feasible);
  EXPECT_NE(r.reason.find("state, 900 B activations"), std::string::npos) << r.reason;
}

TEST(Plan, OverlapHidesFullyShardsCommunicationWhenACoreIsSpare) {
  // 4 cores for 2 ranks of 1 thread: each rank's communication thread has a core.
  const auto rows = ht::plan_layouts(tiny(), options(2, 4), FakeCompute{});
  const auto& r = find(rows, 1, 2, 1, 1);
  ASSERT_TRUE(r.overlap);
  const double one = link(0.5, 3 * std::floor(4 * kModel / 3), 3);
  // Exposed: the first block's gather and the last one's reduce-scatter; the rest (12 ms
  // against 168 ms of compute) hides.
  EXPECT_NEAR(r.exposed_s, 2 * one / 3 + 3 * link(1.0, 16), 1e-9);
}

TEST(Plan, OversubscribedCoresSlowEveryRank) {
  // 4 ranks of 1 thread on 2 cores: compute takes twice as long as on 4.
  const auto slow = ht::plan_layouts(tiny(), options(4, 2), FakeCompute{});
  const auto fast = ht::plan_layouts(tiny(), options(4, 4), FakeCompute{});
  EXPECT_NEAR(find(slow, 1, 4, 1, 1).compute_s, 2 * find(fast, 1, 4, 1, 1).compute_s, 1e-12);
}

TEST(Plan, LayoutsThatDoNotFitInMemorySayWhatTheyNeed) {
  ht::PlanOptions o = options(2, 2);
  o.memory_per_rank = 1000;
  const auto rows = ht::plan_layouts(tiny(), o, FakeCompute{});
  for (const auto& r : rows) {
    EXPECT_FALSE(r.feasible);
    EXPECT_NE(r.reason.find("needs "), std::string::npos) << r.reason;
    EXPECT_NE(r.reason.find("1000 B available"), std::string::npos) << r.reason;
  }
  EXPECT_NE(ht::format_plan(rows).find("not feasible:"), std::string::npos);
}

TEST(Plan, GivenDeviceCountsFlopsAtHalfItsPeak) {
  ht::TrainConfig c = tiny();
  const auto p = ht::measured_compute(c, /*device_tflops=*/100)(2, 1, 1);
  const double tokens = 2 * 64;
  const double rate = 0.5 * 100e12;
  // Matmuls 2 x the block's parameters per token, attention's two products 4 x T x dim (one
  // tile of 128 holds the 64 positions: every score is computed, the causal half included).
  const double layer = (2 * kBlock + 4 * 64 * 64) * tokens / rate;
  EXPECT_NEAR(p.forward_layer, layer, 1e-18);
  EXPECT_NEAR(p.forward_first, layer + 2 * 256 * 64 * tokens / rate, 1e-18);
  EXPECT_NEAR(p.backward_layer, 2 * layer, 1e-18);
  // The optimizer: 28 bytes per parameter (fp32 parameter, gradient and moments read, three
  // written) at an assumed 2 TB/s, not this machine's CPU.
  EXPECT_DOUBLE_EQ(p.optimizer_per_param, 28 / 2e12);
  // Activations from the shapes, per position of a block: norms' inputs and outputs, q and
  // the attention output and o's input (6 x 64), k and v (2 x 2 heads x 16), the MLP's four
  // products (4 x 192), attention's log-sum-exp (one per head: 4); fp32. The head: the
  // logits (fp32) and their fp32 copy and probabilities. Once, attention's tiles while a
  // block computes: one tile holds the 64 positions, 2 x 64 x 64 fp32 scores for each of the
  // 4 heads of the 2 sequences.
  const double block = 6 * 64 + 2 * 32 + 4 * 192 + 4;
  EXPECT_DOUBLE_EQ(p.activations_layer, tokens * 4 * block);
  EXPECT_DOUBLE_EQ(p.activations_first, tokens * 4 * block + tokens * 12 * 256 + 2 * 4 * 2 * 64 * 64 * 4);
  // Light recompute: Llama has no marked matmul, so backward stays twice forward; a block
  // keeps its input, wq, wk, wv, wo, w1, w3 and w2's outputs, attention's output and
  // log-sum-exps: 64 + 64 + 2 x 32 + 64 + 2 x 192 + 64 + 64 + 4 = 772 per position, and the
  // block rerunning rebuilds the other 1220 - 772.
  c.recompute = ht::Recompute::kLight;
  const auto light = ht::measured_compute(c, 100)(2, 1, 1);
  EXPECT_NEAR(light.backward_layer, 2 * layer, 1e-18);
  EXPECT_DOUBLE_EQ(light.activations_layer, tokens * 4 * 772);
  EXPECT_DOUBLE_EQ(light.activations_first,
                   tokens * 4 * 772 + tokens * 12 * 256 + tokens * 4 * (1220 - 772) + 2 * 4 * 2 * 64 * 64 * 4);
  c.recompute = ht::Recompute::kFull;
  EXPECT_NEAR(ht::measured_compute(c, 100)(2, 1, 1).backward_layer, 3 * layer, 1e-18);
}

TEST(Plan, MeasuresTheModelHere) {
  const auto p = ht::measured_compute(tiny())(2, 1, 1);
  EXPECT_FALSE(p.contended);
  // The logits alone (2 x 64 x 256 fp32) are kept for the loss.
  EXPECT_GT(p.activations_first, 2 * 64 * 256 * 4);
  EXPECT_GT(p.activations_layer, 0);
  EXPECT_GT(p.forward_first, 0);
  EXPECT_GT(p.backward_first, 0);
  EXPECT_GT(p.optimizer_per_param, 0);
  EXPECT_NE(p.source.find("measured here"), std::string::npos) << p.source;
  // Two ranks sharing one core: timed together.
  const auto shared = ht::measured_compute(tiny())(2, 1, 2);
  EXPECT_TRUE(shared.contended);
  EXPECT_GT(shared.forward_first, 0);
}

TEST(Plan, APipelineOnOversubscribedCoresTakesAtLeastTheNodesWork) {
  // 2 pipeline ranks on 1 core, 4 micro-batches: a core each would take 132 ms (above), but
  // the node's work, 4 x (12 + 30) ms on one core, takes 168.
  ht::PlanOptions o = options(2, 1);
  const auto rows = ht::plan_layouts(tiny(), o, FakeCompute{});
  const auto& r = find(rows, 1, 1, 1, 2);
  EXPECT_NEAR(r.compute_s, 4 * 0.042 + 2 * 1e-9 * (kBlock + 256 * 64 + 64), 1e-12);
}

namespace {

// DeepSeek tiny (dim 64, 3 blocks: 1 dense, then 2 MoE of 8 routed experts, top-2, each a
// SwiGLU of hidden 32), sequences of 64, a global batch of 16 in 4 micro-batches, fp32.
ht::TrainConfig deepseek_tiny(const std::string& more = "") {
  return ht::parse_config("model:\n  type: deepseek\nglobal_batch_size: 16\nmicro_batch_num: 4\n"
                          "seq_length: 64\noutput_dir: ''\n" + more,
                          {}, "plan.yaml");
}
// By hand: a MoE block's routed experts, 8 x 3 matrices of 64 x 32.
constexpr double kExperts = 8 * 3 * 64 * 32;  // 49152

const ht::PlanRow& find_ep(const std::vector<ht::PlanRow>& rows, int64_t r, int64_t s, int64_t e, int64_t t,
                           int64_t p) {
  for (const auto& row : rows) {
    const auto& c = row.config;
    if (c.data_parallel == r && c.data_parallel_shard == s && c.expert_parallel == e && c.tensor_parallel == t &&
        c.pipeline_parallel == p && c.data_parallel_shard_strategy != ht::ShardStrategy::kOptim) {
      return row;
    }
  }
  throw std::runtime_error("no such layout");
}

}  // namespace

// With routed experts every expert_parallel dividing dp_shard and the expert count is a
// layout of its own (tensor_parallel 1 only: beside tensor parallelism it is not supported
// yet), shown in the layout's name.
TEST(Plan, ExpertParallelDegreesAreLayoutsOfTheirOwn) {
  const auto rows = ht::plan_layouts(deepseek_tiny(), options(4, 4), FakeCompute{});
  // The 15 (r, s, cp, t, p) of 4 ranks with ep 1, and with t = 1: s cp = 2 ((s, cp) 2 ways,
  // p r = 2: 2 ways) ep 2, s cp = 4 ((s, cp) 3 ways) ep 2 and ep 4: 15 + 4 + 6; those with
  // p = 1 and s cp > 1 again under optim: 7 + 2 + 6.
  ASSERT_EQ(rows.size(), 40u);
  std::set<std::vector<int64_t>> seen;
  for (const auto& row : rows) {
    const auto& c = row.config;
    seen.insert({c.data_parallel, c.data_parallel_shard, c.context_parallel, c.expert_parallel, c.tensor_parallel,
                 c.pipeline_parallel});
    if (c.expert_parallel > 1) {
      EXPECT_EQ(c.tensor_parallel, 1);
      EXPECT_EQ(c.data_parallel_shard * c.context_parallel % c.expert_parallel, 0);
    }
  }
  EXPECT_EQ(seen.size(), 25u);
  EXPECT_EQ(find_ep(rows, 1, 4, 4, 1, 1).layout(), "dp_replicate=1 dp_shard=4 ep=4 tp=1 pp=1");
  // A model without experts names no ep.
  EXPECT_EQ(find(ht::plan_layouts(tiny(), options(2, 2), FakeCompute{}), 1, 2, 1, 1).layout(),
            "dp_replicate=1 dp_shard=2 tp=1 pp=1");
}

// Expert parallelism 4 over dp_shard 4: a rank keeps 2 of each MoE's 8 experts, whole (the
// experts' fully_shard group is 4 / 4 = 1 rank), the rest sharded over 4; per MoE block and
// micro-batch the all-to-alls of the dispatcher, all on the critical path.
TEST(Plan, ExpertParallelMemoryAndAllToAllsAsWorkedOutByHand) {
  const ht::TrainConfig base = deepseek_tiny();
  const double model = static_cast<double>(base.model->num_params());
  const auto rows = ht::plan_layouts(base, options(4, 4), FakeCompute{});
  const auto& r = find_ep(rows, 1, 4, 4, 1, 1);
  ASSERT_TRUE(r.feasible) << r.reason;
  const double dense = model - 2 * kExperts, held = 2 * kExperts / 4;
  EXPECT_EQ(r.memory.expert_params, static_cast<int64_t>(held));
  EXPECT_EQ(r.memory.rank_params, static_cast<int64_t>(dense + held));
  // fp32 parameters, gradients and two moments: the rest's shard (a quarter, rounded up)
  // and the whole 2 experts x 2 blocks.
  const double shard = std::ceil(dense / 4) + held;
  EXPECT_EQ(r.memory.estimate.sharded_params, static_cast<int64_t>(4 * shard));
  EXPECT_EQ(r.memory.estimate.optimizer_state, static_cast<int64_t>(2 * 4 * shard));
  // The optimizer steps the rank's shards: a quarter of the rest and its experts.
  EXPECT_NEAR(r.compute_s, 4 * (0.030 + 2 * 0.012) + 1e-9 * (dense / 4 + held), 1e-12);

  // A micro-batch of 16 / (4 x 4) = 1 sequence: 64 tokens, each sent to 2 experts as a row
  // of 64 fp32. Forward: the counts (8 int64) and 2 token all-to-alls, backward 2 more; bus
  // 3/4; 2 MoE blocks; 4 micro-batches.
  const double rows_bytes = 64 * 2 * 64 * 4;
  const double forward = link(0.75, 8 * 8) + 2 * link(0.75, rows_bytes), backward = 2 * link(0.75, rows_bytes);
  EXPECT_NEAR(r.ep_comm_s, 4 * 2 * (forward + backward), 1e-9);
  // fully_shard's own over the other parameters alone: 4 groups (3 blocks and the root) of
  // the rest, per micro-batch 4 + 2 gathers and 4 reduce-scatters with their flags.
  const double gather = link(0.75, std::floor(4 * dense / 4));
  const double flags = link(2 * 0.75, 64);
  EXPECT_NEAR(r.fsdp_comm_s, 4 * (6 * gather + 4 * (gather + flags)), 1e-9);
  const double world_sums = 3 * link(2 * 0.75, 16);
  EXPECT_NEAR(r.exposed_s, r.ep_comm_s + r.fsdp_comm_s + world_sums, 1e-9);  // 4 cores, 4 ranks: overlap off

  // Expert parallelism 2 over the same 4: a rank keeps 4 experts of each MoE, sharded over
  // the 2 ranks holding them (2 MoE groups, per micro-batch 2 gathers and 2 reductions).
  const auto& r2 = find_ep(rows, 1, 4, 2, 1, 1);
  ASSERT_TRUE(r2.feasible) << r2.reason;
  const double held2 = 2 * kExperts / 2;
  EXPECT_EQ(r2.memory.expert_params, static_cast<int64_t>(held2));
  EXPECT_EQ(r2.memory.estimate.sharded_params, static_cast<int64_t>(4 * (std::ceil(dense / 4) + held2 / 2)));
  const double eg = link(0.5, std::floor(4 * held2 / 2));
  const double eflags = link(2 * 0.5, 64);
  EXPECT_NEAR(r2.fsdp_comm_s, 4 * (6 * gather + 4 * (gather + flags)) + 4 * (2 * eg + 2 * (eg + eflags)), 1e-9);
  const double forward2 = link(0.5, 8 * 8) + 2 * link(0.5, rows_bytes), backward2 = 2 * link(0.5, rows_bytes);
  EXPECT_NEAR(r2.ep_comm_s, 4 * 2 * (forward2 + backward2), 1e-9);
}

// Context parallel ranks shard like data ranks under expert parallelism too, as the trainer
// shards them: the rest of the model over dp_shard x cp, the experts over the dp_shard x cp /
// ep ranks holding the same ones. dp_shard 2 x cp 2 with expert_parallel 2: a rank keeps 4
// experts of each of the 2 MoE blocks, sharded over 2; the rest over 4 (fp32 parameters,
// gradients and two moments). The estimate once divided the rest by dp_shard alone and the
// experts by dp_shard / ep (seen failing: twice the rest, the experts whole).
TEST(Plan, ContextParallelRanksShardLikeDataRanksUnderExpertParallelism) {
  ht::TrainConfig c = deepseek_tiny("expert_parallel: 2\ncontext_parallel: 2\n");
  c.validate(4);
  ASSERT_EQ(c.data_parallel_shard, 2);
  const ht::RankMemory m = ht::estimate_rank_memory(c);
  const double dense = static_cast<double>(c.model->num_params()) - 2 * kExperts, held = 2 * kExperts / 2;
  EXPECT_EQ(m.expert_params, static_cast<int64_t>(held));
  const double shard = std::ceil(dense / 4) + held / 2;
  EXPECT_EQ(m.estimate.sharded_params, static_cast<int64_t>(4 * shard));
  EXPECT_EQ(m.estimate.optimizer_state, static_cast<int64_t>(2 * 4 * shard));
  // The same as dp_shard 4 without context parallelism.
  ht::TrainConfig d = deepseek_tiny("expert_parallel: 2\n");
  d.validate(4);
  EXPECT_EQ(ht::estimate_rank_memory(d).estimate.total(), m.estimate.total());
  EXPECT_NE(ht::describe_estimate(c, m).find("sharded over 2 ranks, and " +
                                             std::to_string(static_cast<int64_t>(dense)) + " others, sharded over 4"),
            std::string::npos)
      << ht::describe_estimate(c, m);
}

// The de-duplicating dispatcher sends a token once per rank holding some of its experts:
// with 8 experts over 4 ranks and top-2, a rank misses both of a token's experts with
// probability (6/8)(5/7), so a token reaches 4 (1 - 30/56) ranks; beside each copy its 2
// local ids (int64) and weights (fp32). Forward: counts, rows, ids, weights, and the
// partial sums back; backward: the two row exchanges reversed and the weights' gradients.
// Recompute runs forward's again in backward.
TEST(Plan, DedupDispatcherAndRecomputeInTheAllToAllCount) {
  const auto rows =
      ht::plan_layouts(deepseek_tiny("expert_parallel: 4\ndata_parallel_shard: 4\nmoe_dispatcher: dedup\n"
                                     "recompute: full\n"),
                       options(4, 4), FakeCompute{});
  const auto& r = find_ep(rows, 1, 4, 4, 1, 1);
  ASSERT_TRUE(r.feasible) << r.reason;
  EXPECT_EQ(r.config.moe_dispatcher, hp::ep::DispatcherKind::kDedup);
  const double copies = 64 * 4 * (1 - 30.0 / 56);
  const double row = 64 * 4;
  auto a2a = [](double bytes) { return link(0.75, std::floor(bytes)); };
  // The counts: one int64 per rank of the 4 (the plain dispatcher's are one per expert).
  const double forward = a2a(8 * 4) + a2a(copies * row) + a2a(copies * 2 * 8) + a2a(copies * 2 * 4) + a2a(copies * row);
  const double backward = 2 * a2a(copies * row) + a2a(copies * 2 * 4) + forward;
  EXPECT_NEAR(r.ep_comm_s, 4 * 2 * (forward + backward), 1e-9);
  // ep 1 layouts keep the plain dispatcher (dedup needs expert_parallel > 1).
  EXPECT_EQ(find_ep(rows, 1, 4, 1, 1, 1).config.moe_dispatcher, hp::ep::DispatcherKind::kAllToAll);
}

// Under recompute light a recomputed MoE block keeps what its exchanges delivered instead of
// exchanging again (ep_test's LightRecomputeKeepsTheExchange counts it at run time): the
// all-to-alls of the run without recompute, and per MoE block and micro-batch the kept
// rows received and outputs returned (64 tokens x 2 rows of 64 fp32 each way) and the 8
// counts, on top of its activations. Full recompute runs the forward's again; so does light
// with the exchange overlapped, which keeps nothing of it.
TEST(Plan, LightRecomputeKeepsTheExpertExchangeInsteadOfRunningItAgain) {
  auto row = [](const std::string& extra) {
    const auto rows = ht::plan_layouts(deepseek_tiny("expert_parallel: 4\ndata_parallel_shard: 4\n" + extra),
                                       options(4, 4), FakeCompute{});
    return find_ep(rows, 1, 4, 4, 1, 1);
  };
  const ht::PlanRow none = row(""), light = row("recompute: light\n"), full = row("recompute: full\n");
  for (const auto* r : {&none, &light, &full}) ASSERT_TRUE(r->feasible) << r->reason;
  const double rows_bytes = 64 * 2 * 64 * 4;
  const double forward = link(0.75, 8 * 8) + 2 * link(0.75, rows_bytes);
  EXPECT_NEAR(light.ep_comm_s, none.ep_comm_s, 1e-12);
  EXPECT_NEAR(full.ep_comm_s, none.ep_comm_s + 4 * 2 * forward, 1e-9);
  const double kept = 2 * rows_bytes + 8 * 8;
  EXPECT_NEAR(light.activations - none.activations, 2 * kept, 1e-6);  // 2 MoE blocks
  EXPECT_NEAR(full.activations, none.activations, 1e-6);
  ht::TrainConfig c = deepseek_tiny("expert_parallel: 4\ndata_parallel_shard: 4\nrecompute: light\n");
  c.validate(4);
  EXPECT_EQ(ht::light_kept_exchange_bytes(c), kept);
  const std::string estimate = ht::describe_estimate(c, ht::estimate_rank_memory(c));
  EXPECT_NE(estimate.find("what the experts' exchange delivered"), std::string::npos) << estimate;
  // Overlapped (2 chunks of the 2 experts a rank holds): exchanged again, nothing kept.
  const ht::PlanRow chunked = row("recompute: light\nmoe_overlap_chunks: 2\n"),
                    chunked_none = row("moe_overlap_chunks: 2\n");
  EXPECT_GT(chunked.ep_comm_s, chunked_none.ep_comm_s);
  EXPECT_NEAR(chunked.activations, chunked_none.activations, 1e-6);
}

// moe_overlap_chunks 2 with the layout above (EP 4, 2 experts a rank): each exchange in 2
// all-to-alls of half the rows. The fake profile's block takes 4 ms forward and 8 backward,
// the shared expert's share of it far above a chunk's 22 us, so what stays exposed per MoE
// block and micro-batch is, forward, the counts and the last chunk's outputs (the first
// chunk's rows travel while the shared expert runs) and, backward, the first chunk's
// output gradient (the last rows' gradient travels during the shared expert's backward).
// Of the 3 chunks' time each way that this hides the planner credits 0.65 (the share
// measured hidden, BENCHMARKS.md): 4 - 0.65 x 3 chunks stay exposed each way.
TEST(Plan, OverlappedExpertExchangeExposesTheCountsAndOneChunkEachWay) {
  const ht::TrainConfig base = deepseek_tiny("expert_parallel: 4\ndata_parallel_shard: 4\nmoe_overlap_chunks: 2\n");
  const hp::models::FlopCount f = base.model->flops_per_token(base.seq_length);
  const double chunk = link(0.75, 64 * 2 * 64 * 4 / 2);
  ASSERT_GT(0.004 * f.shared / f.block, chunk) << "the shared expert must outlast a chunk's rows";
  const auto rows = ht::plan_layouts(base, options(4, 4), FakeCompute{});
  const auto& r = find_ep(rows, 1, 4, 4, 1, 1);
  ASSERT_TRUE(r.feasible) << r.reason;
  EXPECT_EQ(r.config.moe_overlap_chunks, 2);
  EXPECT_NEAR(r.ep_comm_s, 4 * 2 * (link(0.75, 8 * 8) + 2 * (4 - 0.65 * 3) * chunk), 1e-9);
  // EP 2 keeps the 2 chunks (4 experts a rank); EP 1 has no exchange and no chunks.
  EXPECT_EQ(find_ep(rows, 1, 4, 2, 1, 1).config.moe_overlap_chunks, 2);
  EXPECT_EQ(find_ep(rows, 1, 4, 1, 1, 1).config.moe_overlap_chunks, 1);
}

// Under a pipeline a rank's stages stay gathered from their first micro-batch to their
// last, their gradients accumulating unsharded: the stage's parameters in fp32, twice, one
// block's fresh gradient and two reduce-scatter inputs of a block, instead of two blocks.
TEST(Plan, APipelineRankHoldsItsStagesWhole) {
  const auto rows = ht::plan_layouts(tiny(), options(4, 4), FakeCompute{});
  const auto& r = find(rows, 1, 2, 1, 2);
  ASSERT_TRUE(r.feasible) << r.reason;
  const double stage1 = kBlock + 256 * 64 + 64;
  EXPECT_EQ(r.memory.rank_params, static_cast<int64_t>(stage1));
  EXPECT_EQ(r.memory.estimate.backward_peak_extra, static_cast<int64_t>(stage1 * 4 * 2 + kBlock * 4 + 2 * kBlock * 4));
}

// optimizer: muon. tiny's 14 Muon matrices (per block 2 of 64 x 64, 2 of 32 x 64 and 3 of
// 64 x 192; the embedding and head go to AdamW): s^2 (2 l + s) = 786432, 163840 and 1835008
// multiply-adds per Newton-Schulz step, 14,811,136 in all; 5 quintic steps of 2 FLOPs each:
// 148,111,360 FLOPs, half per rank over 2 ranks, at the profile's matmul rate (a block's
// 114,944 FLOPs a token, 2 x 2 x 49280 + 4 x 64 x 4 x 16, over 128 tokens in 2 ms). The
// owner scheme: a rank's 98,304 / 2 elements in fp32 to their owners and back, two
// all-to-alls (bus 1/2), exposed.
TEST(Plan, MuonIterationsAndOwnerExchangesByHand) {
  FakeCompute fake;
  fake.matmul_forward_layer = 0.002;
  const ht::TrainConfig adamw = tiny();
  const ht::TrainConfig muon = ht::parse_config("model:\n  type: llama\nglobal_batch_size: 16\nmicro_batch_num: 4\n"
                                                "seq_length: 64\noutput_dir: ''\noptimizer: muon\n",
                                                {}, "plan.yaml");
  const auto a_rows = ht::plan_layouts(adamw, options(2, 2), fake);
  const auto m_rows = ht::plan_layouts(muon, options(2, 2), fake);
  const auto& a = find(a_rows, 1, 2, 1, 1);
  const auto& m = find(m_rows, 1, 2, 1, 1);
  ASSERT_TRUE(a.feasible && m.feasible) << a.reason << m.reason;
  const double rate = 114944.0 * 128 / 0.002;
  EXPECT_NEAR(m.compute_s - a.compute_s, 148111360.0 / 2 / rate, 1e-12);
  EXPECT_NEAR(m.optimizer_comm_s, 2 * link(0.5, 98304 / 2 * 4), 1e-12);
  EXPECT_NEAR(m.exposed_s - a.exposed_s, m.optimizer_comm_s, 1e-12);
  EXPECT_EQ(a.optimizer_comm_s, 0);
}

// An elastic relaunch's restrictions (PlanOptions::tensor_parallel, pipeline_parallel,
// micro_batch_samples): over 6 ranks with tensor_parallel 2 held, the layouts are those of the
// other 3 ranks (r s cp t p with t = 2, p = 1: (r, s, cp) ordered factorizations of 3, 3 of
// them, and dp_shard x cp > 1 again under optim: 2 more), and a micro-batch of 4 samples per
// data-parallel rank sets micro_batch_num to 16 / (dp x 4), which dp 3 does not divide.
TEST(Plan, ElasticRestrictionsHoldTheDegreesAndTheMicroBatch) {
  FakeCompute fake;
  ht::PlanOptions o = options(4, 4);
  o.tensor_parallel = 2;
  o.pipeline_parallel = 1;
  o.micro_batch_samples = 4;
  const auto rows = ht::plan_layouts(tiny(), o, fake);
  // 4 ranks, tp 2, pp 1: (r, s, cp) of 2: (2,1,1) (1,2,1) (1,1,2), and (1,2,1) (1,1,2) under optim.
  ASSERT_EQ(rows.size(), 5u);
  for (const auto& row : rows) {
    EXPECT_EQ(row.config.tensor_parallel, 2);
    EXPECT_EQ(row.config.pipeline_parallel, 1);
    ASSERT_TRUE(row.feasible) << row.layout() << ": " << row.reason;
    // 16 samples over 2 data-parallel ranks (or 1 under cp 2) in micro-batches of 4.
    const int64_t dp = row.config.data_parallel * row.config.data_parallel_shard;
    EXPECT_EQ(row.config.micro_batch_num, 16 / (dp * 4)) << row.layout();
    EXPECT_EQ(row.config.micro_batch_size(), 4) << row.layout();
  }
  EXPECT_EQ(*fake.asked, (std::map<int64_t, int>{{4, 1}}));  // every row timed at 4 samples
  // 6 ranks, tp 2: dp 3 cannot hold 16 samples in micro-batches of 4: listed, not feasible.
  o.world = 6;
  const auto six = ht::plan_layouts(tiny(), o, fake);
  size_t dp3 = 0;
  for (const auto& row : six) {
    if (row.config.data_parallel * row.config.data_parallel_shard != 3) continue;
    ++dp3;
    EXPECT_FALSE(row.feasible);
    EXPECT_NE(row.reason.find("global_batch_size=16 is not a whole number of micro-batches of 4 sample(s) over 3 "
                              "data-parallel rank(s)"),
              std::string::npos)
        << row.reason;
  }
  EXPECT_EQ(dp3, 3u);  // (3,1,1) (1,3,1) and (1,3,1) under optim
}
