// DeepSeek-V3 (MLA, MoE with shared and routed experts, a dense first layer) under tensor
// parallelism, with and without sequence parallelism, alone and inside fully_shard, trains
// like the same model in one process on the global batch, balancing-bias updates
// included. Float64 with AdamW, bound 1e-10 relative, for the reason llama_tp_test gives.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "hp/core/trace.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/deepseek.h"
#include "hp/models/moe_llama.h"
#include "hp/models/tensor_parallel.h"
#include "hp/runtime.h"
#include "test_util.h"
#include "tp/tp_test_util.h"

namespace {

constexpr double kBound = 1e-10;

hp::models::DeepSeekConfig config() {
  hp::models::DeepSeekConfig c;
  c.vocab = 64;
  c.dim = 32;
  c.layers = 3;
  c.dense_layers = 1;
  c.heads = 4;
  c.q_lora_rank = 16;
  c.kv_lora_rank = 12;
  c.qk_nope_dim = 8;
  c.qk_rope_dim = 4;
  c.v_head_dim = 8;
  c.dense_hidden = 32;
  c.experts = 4;
  c.experts_per_token = 2;
  c.shared_experts = 1;
  c.expert_hidden = 8;
  c.bias_update_rate = 0.01;  // the routing changes between steps
  return c;
}

// The balancing bias from the load over the data-parallel group (tp ranks route the same
// tokens, so they are not in it).
void update_bias(hp::models::DeepSeek& m, const hp::CommPtr& dp) { m->update_balancing_bias(dp); }

TEST(DeepSeekTp, MatchesSingleProcessTraining) {
  auto g = hp::world();
  for (bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel only");
    hp::models::TensorParallelOptions o;
    o.sequence_parallel = sp;
    auto r = hp::test::train_tp_against_one_process<hp::models::DeepSeek>(config(), o, g, nullptr, 1, 0, update_bias);
    EXPECT_LE(r.loss, kBound);
    EXPECT_LE(r.params, kBound);
    EXPECT_EQ(r.spread, 0.0);  // norms, down-projections and the router identical on every rank
  }
}

TEST(DeepSeekTp, UnderFullyShardMatchesSingleProcessTraining) {
  auto w = hp::world();
  if (w->size() != 4) GTEST_SKIP() << "needs 4 ranks (dp_shard 2 x tp 2)";
  auto mesh = std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"dp_shard", 2}, {"tp", 2}});
  auto r = hp::test::train_tp_against_one_process<hp::models::DeepSeek>(
      config(), {}, mesh->group("tp"), mesh, 2, mesh->coordinate("dp_shard"), update_bias);
  EXPECT_LE(r.loss, kBound);
  EXPECT_LE(r.params, kBound);
  EXPECT_EQ(r.spread, 0.0);
}

// Each routed expert and the shared one end in a Partial output; the MoE reduces once.
TEST(DeepSeekTp, OneReductionAtTheMoEBoundary) {
  auto g = hp::world();
  if (g->size() == 1) GTEST_SKIP() << "no collectives at one rank";
  auto c = config();
  c.layers = 1;
  c.dense_layers = 0;  // one MoE block
  hp::models::DeepSeek m(c);
  hp::models::TensorParallelOptions o;
  o.sequence_parallel = false;
  hp::models::parallelize_deepseek(m, g, o);
  hp::test::Batch b = hp::test::batch(0, 2, 8, c.vocab);
  hp::trace::enable(::testing::TempDir() + "hp_tp_deepseek_trace");
  hp::trace::clear();
  m->loss_of_logits(m->forward(b.x), b.y);
  auto events = hp::trace::events();
  hp::trace::disable();
  int all_reduces = 0;
  for (const auto& e : events) all_reduces += e.cat == "comm" && e.name == "all_reduce";
  // embedding, attention output, MoE output, loss parallel's two.
  EXPECT_EQ(all_reduces, 5);
}

// tp::block_traffic, which the planner sums, from the family's account of what it sums
// (MLA's down-projections and norms, the router; the block's norms under sequence
// parallelism), against the communicator's count of one MoE block.
TEST(DeepSeekTp, BlockTrafficIsTheEstimators) {
  auto g = hp::world();
  if (g->size() == 1) GTEST_SKIP() << "no collectives at one rank";
  auto args = hp::models::model_family("deepseek").preset("tiny");
  auto& c = hp::models::config_of<hp::models::DeepSeekConfig>(*args);
  c = config();
  c.dense_layers = 0;  // the block added is a MoE block
  for (bool sp : {true, false}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel only");
    hp::test::expect_block_traffic_is_the_estimators(*args, g, sp, hp::test::batch(0, 2, 8, c.vocab));
  }
}

// The same for Qwen3-MoE (a dense block then a MoE one: the block the planner adds is the
// MoE; query/key norms, attention biases) and Mixtral: tp_summed_params against the count.
TEST(MoELlamaTp, BlockTrafficIsTheEstimators) {
  auto g = hp::world();
  if (g->size() == 1) GTEST_SKIP() << "no collectives at one rank";
  for (const char* family : {"qwen3_moe", "mixtral"}) {
    auto args = hp::models::model_family(family).preset("tiny");
    auto& c = hp::models::config_of<hp::models::MoELlamaConfig>(*args);
    c.kv_heads = c.heads;  // whole key/value heads on each of up to 4 ranks
    if (family[0] == 'q') {
      c.sparse_step = 2;
      c.attention_bias = true;
    }
    for (bool sp : {true, false}) {
      SCOPED_TRACE(std::string(family) + (sp ? " sequence parallel" : " tensor parallel only"));
      hp::test::expect_block_traffic_is_the_estimators(*args, g, sp, hp::test::batch(0, 2, 8, c.vocab));
    }
  }
}

TEST(DeepSeekTp, LayoutErrorsNameTheValue) {
  auto c = config();
  hp::test::expect_error([&] { hp::models::check_tensor_parallel(c, 3); }, {"tensor_parallel=3", "heads=4"});
  c.expert_hidden = 6;
  hp::test::expect_error([&] { hp::models::check_tensor_parallel(c, 4); }, {"expert_hidden=6", "not divisible"});
}

}  // namespace
