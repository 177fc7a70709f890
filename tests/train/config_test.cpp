// hp-train's config: the shipped configs parse to what they say; every bad config is
// rejected before training with an error naming the offending key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <algorithm>
#include <cmath>

#include "hp/core/error.h"
#include "hp/models/deepseek.h"
#include "hp/train/config.h"
#include "test_util.h"
#include "toy_family.h"
#include "hp/train/trainer.h"

namespace ht = hp::train;

namespace {

// The error text of parsing (and validating at `world`) `yaml` with `overrides`, or "".
std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}, int world = 4) {
  try {
    ht::TrainConfig c = ht::parse_config(yaml, overrides, "test.yaml");
    c.validate(world);
  } catch (const hp::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TrainConfig, ShippedDemoConfigReadsAsWritten) {
  ht::TrainConfig c = ht::load_config(HP_SOURCE_DIR "/configs/deepseek_tiny.yaml");
  c.validate(4);
  EXPECT_EQ(c.model.family().name(), "deepseek");
  EXPECT_EQ(c.params_dtype, at::kBFloat16);
  EXPECT_EQ(c.compute_dtype, at::kBFloat16);
  EXPECT_TRUE(c.accumulate_allreduce_grads_in_fp32);
  EXPECT_TRUE(c.fp32_master());
  EXPECT_EQ(c.data_parallel, 2);
  EXPECT_EQ(c.data_parallel_shard, 2);  // -1 resolved: 4 ranks / 2 replicas
  EXPECT_EQ(c.micro_batch_size(), 16 / (4 * 2));
  EXPECT_EQ(c.train_steps, 50);
  // The resolved policy: bf16 compute (no cast needed), fp32 reduction and main grads.
  hp::MixedPrecisionPolicy p = ht::mixed_precision(c);
  EXPECT_FALSE(p.param_dtype.has_value());
  ASSERT_TRUE(p.reduce_dtype.has_value());
  EXPECT_EQ(*p.reduce_dtype, at::kFloat);
  EXPECT_TRUE(p.apply_grad_on_fp32_main_grad);
}

TEST(TrainConfig, DefaultsOverridesAndPresets) {
  ht::TrainConfig c = ht::parse_config("params_dtype: bf16\nmodel:\n  dim: 96\n", {"model.dim=128", "lr=0.5"});
  EXPECT_EQ(c.model.config<hp::models::DeepSeekConfig>().dim, 128);  // --set wins over the file
  EXPECT_EQ(c.lr, 0.5);
  EXPECT_EQ(c.compute_dtype, at::kBFloat16);  // compute_dtype defaults to params_dtype
  EXPECT_FALSE(c.accumulate_allreduce_grads_in_fp32);
  EXPECT_EQ(c.model.config<hp::models::DeepSeekConfig>().experts, hp::models::DeepSeekConfig::tiny().experts);

  ht::TrainConfig big = ht::parse_config("model:\n  type: deepseek\n  preset: deepseek_v3\n  layers: 4\n");
  EXPECT_EQ(big.model.config<hp::models::DeepSeekConfig>().dim, 7168);
  EXPECT_EQ(big.model.config<hp::models::DeepSeekConfig>().layers, 4);  // fields override the preset whatever their order

  ht::TrainConfig ll = ht::parse_config("model:\n  kv_heads: 1\n  type: llama\n");
  EXPECT_EQ(ll.model.family().name(), "llama");
  EXPECT_EQ(ll.model.config<hp::models::LlamaConfig>().kv_heads, 1);
  ll.validate(1);
  EXPECT_EQ(ll.data_parallel_shard, 1);

  ht::TrainConfig empty = ht::parse_config("");
  empty.validate(2);
  EXPECT_EQ(empty.data_parallel_shard, 2);
}

TEST(TrainConfig, EveryBadConfigNamesItsKey) {
  struct Case {
    std::string yaml;
    std::vector<std::string> overrides;
    int world;
    std::vector<std::string> expect;  // substrings of the error
  };
  const std::vector<Case> cases = {
      {"lr_warmup_step: 3\n", {}, 4, {"unknown config key 'lr_warmup_step'", "did you mean 'lr_warmup_steps'"}},
      {"model:\n  dimm: 3\n", {}, 4, {"unknown config key 'model.dimm'", "'model.dim'"}},
      {"", {"nonsense=1"}, 4, {"unknown config key 'nonsense'", "--set"}},
      {"", {"lr"}, 4, {"--set lr", "key=value"}},
      {"train_steps: ten\n", {}, 4, {"train_steps=ten", "integer"}},
      {"train_steps: 0\n", {}, 4, {"train_steps=0", ">= 1"}},
      {"lr: -1\n", {}, 4, {"lr=-1", ">= 0"}},
      {"optimizer: muon\nmuon_lr: -0.5\n", {}, 4, {"muon_lr=-0.5", ">= 0"}},
      {"adam_beta2: 1.0\n", {}, 4, {"adam_beta2=1.0", "[0, 1)"}},
      {"comm_fusion: maybe\n", {}, 4, {"comm_fusion=maybe", "true or false"}},
      {"recompute: sometimes\n", {}, 4, {"recompute=sometimes", "none, full, selective"}},
      {"device: gpu\n", {}, 4, {"device=gpu", "cpu, cuda"}},
      {"wait_per_submodule: true\n", {}, 4, {"wait_per_submodule=true", "comm_fusion=false"}},
      {"", {"lr=1", "seed=3", "lr=2"}, 4, {"--set lr is given twice", "lr=1", "lr=2"}},
      {"model:\n  vocab: 1\n", {}, 4, {"model.vocab=1", ">= 2"}},
      {"apply_grad_on_fp32_main_grad: true\n", {}, 4, {"apply_grad_on_fp32_main_grad=true", "accumulate_allreduce_grads_in_fp32=true"}},
      // A combination broken by an override names the override, not only the file.
      {"min_lr: 0.5\n", {"lr=0.1"}, 4, {"with --set lr=0.1", "min_lr=0.5"}},
      {"model: {}\n", {}, 4, {"the section 'model' is empty"}},
      {"lr: 0.1\ndata: {}\n", {}, 4, {"the section 'data' is empty"}},
      {"train_steps: [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n",
       {}, 4, {"nested deeper than 64 levels"}},
      {"params_dtype: int8\n", {}, 4, {"params_dtype=int8", "bfloat16"}},
      {"lr_decay_style: step\n", {}, 4, {"lr_decay_style=step", "cosine"}},
      {"data_parallel_shard: 0\n", {}, 4, {"data_parallel_shard=0"}},
      {"seq_length:\n", {}, 4, {"'seq_length' has no value"}},
      {"seq_length: [1, 2]\n", {}, 4, {"'seq_length' is a list"}},
      {"model: [1\n", {}, 4, {"not valid YAML"}},
      {"- 1\n- 2\n", {}, 4, {"must be a map"}},
      {"model:\n  type: gpt\n", {}, 4, {"model.type=gpt", "deepseek, llama"}},
      {"model:\n  type: llama\n  experts: 4\n", {}, 4, {"model.experts=4", "model.type deepseek"}},
      {"model:\n  kv_heads: 2\n", {}, 4, {"model.kv_heads=2", "model.type llama"}},
      {"model:\n  type: llama\n  preset: deepseek_v3\n", {}, 4, {"model.preset=deepseek_v3", "tiny, llama3_8b"}},
      {"model:\n  experts_per_token: 9\n", {}, 4, {"model:", "experts_per_token=9"}},
      // impossible combinations, checked against the world size
      {"data_parallel: 3\n", {}, 4, {"data_parallel=3", "world size 4"}},
      {"data_parallel: 2\ndata_parallel_shard: 4\n", {}, 4, {"data_parallel=2", "data_parallel_shard=4", "world of 4"}},
      {"data_parallel: 16777216\ndata_parallel_shard: 16777216\n", {}, 4, {"data_parallel=16777216", "world of 4"}},
      {"micro_batch_num: 4611686018427387904\n", {}, 4, {"micro_batch_num=4611686018427387904", "<= "}},
      {"global_batch_size: 12\nmicro_batch_num: 16\n", {}, 4, {"global_batch_size=12", "micro_batch_num (16)"}},
      {"model:\n  vocab: 36028797018963968\n", {}, 4, {"model.vocab=36028797018963968", "<= 2147483648"}},
      {"model:\n  experts: 2147483648\n  expert_hidden: 2147483648\n  dim: 2147483648\n", {}, 4,
       {"model:", "too many to count"}},
      {"lr: 0.1\nlr: 0.2\n", {}, 4, {"'lr' is given twice"}},
      {"lr: 0.1\n---\nlr: 0.2\n", {}, 4, {"2 YAML documents"}},
      {"? [a, b]\n: 1\n", {}, 4, {"not a plain name"}},
      {"data:\n  token_dtype: uint32\n", {}, 4, {"data.token_dtype=uint32", "binary"}},
      {"data:\n  type: binary\n  path: x.bin\n  num_samples: 5\n", {}, 4, {"data.num_samples=5", "synthetic"}},
      {"global_batch_size: 6\n", {}, 4, {"global_batch_size=6", "micro_batch_num"}},
      {"global_batch_size: 8\nmicro_batch_num: 3\n", {}, 4, {"global_batch_size=8", "micro_batch_num (3)"}},
      {"seq_length: 300\n", {}, 4, {"seq_length=300", "model.max_seq=256"}},
      {"min_lr: 0.1\nlr: 0.01\n", {}, 4, {"min_lr=0.1", "lr=0.01"}},
      {"data:\n  type: binary\n", {}, 4, {"data.type=binary", "data.path"}},
      {"data:\n  path: x.bin\n", {}, 4, {"data.path='x.bin'", "binary, text or megatron"}},
      {"data:\n  type: text\n  path: a.txt\nmodel:\n  vocab: 100\n", {}, 4, {"data.type=text", "model.vocab=100"}},
      // validation: a set to read, read only when evaluating
      {"data:\n  valid_path: v.bin\n", {}, 4, {"data.valid_path='v.bin'", "eval_interval > 0"}},
      {"eval_interval: 5\ndata:\n  valid_path: v.bin\n", {}, 4, {"data.valid_path='v.bin'", "synthetic data holds out"}},
      {"eval_interval: 5\neval_steps: 0\n", {}, 4, {"eval_steps=0", "synthetic"}},
      {"eval_interval: 5\ndata:\n  type: binary\n  path: x.bin\n", {}, 4, {"eval_interval=5", "data.valid_path"}},
      {"eval_interval: -1\n", {}, 4, {"eval_interval", "-1"}},
      {"eval_interval: 1\neval_steps: 1099511627776\nglobal_batch_size: 16777216\n", {}, 4,
       {"eval_steps=1099511627776", "too many to count"}},
      {"sequence_parallel: true\n", {}, 4, {"sequence_parallel=true", "tensor_parallel > 1"}},
      // expert parallelism: experts to split, ranks to split them over (the tp ranks and
      // dp_shard ones, with sequence parallel), layouts not built
      {"expert_parallel: 3\n", {}, 4, {"expert_parallel=3", "does not divide the 8 routed experts"}},
      {"expert_parallel: 8\n", {}, 4, {"expert_parallel=8", "data_parallel_shard=4"}},
      {"model:\n  type: llama\nexpert_parallel: 2\n", {}, 4, {"expert_parallel=2", "model.type=llama has none"}},
      {"expert_parallel: 0\n", {}, 4, {"expert_parallel=0"}},
      {"moe_dispatcher: dedup\n", {}, 4, {"moe_dispatcher=dedup", "expert_parallel > 1"}},
      {"moe_dispatcher: fast\n", {}, 4, {"moe_dispatcher=fast", "all_to_all, dedup"}},
      // overlap chunks: an exchange to overlap, whole experts per chunk, the plain dispatcher
      {"moe_overlap_chunks: 2\n", {}, 4, {"moe_overlap_chunks=2", "needs expert_parallel > 1"}},
      {"moe_overlap_chunks: 3\nexpert_parallel: 4\n", {}, 4,
       {"moe_overlap_chunks=3", "exceeds the 2 experts each rank holds", "expert_parallel=4"}},
      {"moe_overlap_chunks: 2\nexpert_parallel: 2\nmoe_dispatcher: dedup\n", {}, 4,
       {"moe_overlap_chunks=2", "moe_dispatcher=dedup", "not supported yet"}},
      {"moe_overlap_chunks: 0\n", {}, 4, {"moe_overlap_chunks", "0"}},
      {"expert_parallel: 2\ntensor_parallel: 2\n", {}, 4,
       {"expert_parallel=2", "tensor_parallel=2", "needs sequence_parallel=true", "not supported yet"}},
      {"expert_parallel: 2\ntensor_parallel: 2\nsequence_parallel: true\nmodel:\n  mtp_layers: 1\n", {}, 4,
       {"expert_parallel=2", "tensor_parallel=2", "multi-token prediction", "model.mtp_layers=1", "not supported yet"}},
      {"expert_parallel: 2\ntensor_parallel: 4\nsequence_parallel: true\n", {}, 8,
       {"expert_parallel=2", "must be tensor_parallel x a divisor of data_parallel_shard=2"}},
      {"expert_parallel: 8\ntensor_parallel: 2\nsequence_parallel: true\n", {}, 4,
       {"expert_parallel=8", "data_parallel_shard=2"}},
      // the balance loss: a weight >= 0
      {"model:\n  aux_loss_coeff: -0.1\n", {}, 4, {"model.aux_loss_coeff", "-0.1"}},
      // a capacity: a factor >= 0 (0: none), a policy by name
      {"model:\n  capacity_factor: -1\n", {}, 4, {"model.capacity_factor=-1", "must be >= 0"}},
      {"model:\n  drop_policy: random\n", {}, 4, {"model.drop_policy=random", "expected one of: probs, position"}},
      {"pipeline_parallel_interleave_num: 2\n", {}, 4, {"pipeline_parallel_interleave_num=2", "pipeline_parallel > 1"}},
      // layouts the model cannot be split into
      {"pipeline_parallel: 2\npipeline_parallel_interleave_num: 4\n", {}, 4, {"= 8 stages", "more stages than layers"}},
      {"pipeline_parallel: 2\npipeline_parallel_interleave_num: 2\npipeline_schedule: 1f1b\n", {}, 4,
       {"pipeline_schedule=1f1b", "pipeline_parallel_interleave_num=2", "use interleaved, zbv or dualpipev"}},
      {"pipeline_parallel: 2\npipeline_parallel_interleave_num: 2\nmicro_batch_num: 5\nglobal_batch_size: 10\nmodel:\n  layers: 4\n", {}, 4,
       {"micro_batch_num=5", "2 rounds that do not divide it", "not supported yet"}},
      {"pipeline_parallel: 2\npipeline_stage_layers: [2, 2]\n", {}, 4, {"pipeline_stage_layers", "sum to 4", "3 layers"}},
      {"pipeline_stage_layers: [3]\n", {}, 4, {"pipeline_stage_layers needs pipeline_parallel > 1"}},
      {"pipeline_parallel: 2\npipeline_stage_layers: [3]\n", {}, 4, {"pipeline_stage_layers", "1 entries for 2 stages"}},
      {"pipeline_parallel: 2\npipeline_stage_layers: [2, x]\n", {}, 4, {"pipeline_stage_layers=x", "integer"}},
      {"pipeline_parallel: 3\n", {}, 4, {"pipeline_parallel=3 = 3 does not divide the world size 4"}},
      {"tensor_parallel: 3\n", {}, 3, {"tensor_parallel=3", "heads=4 is not divisible"}},
      {"tensor_parallel: 2\nsequence_parallel: true\nseq_length: 63\n", {}, 4,
       {"seq_length=63", "not divisible by tensor_parallel=2"}},
      // capabilities not built yet
      {"pipeline_parallel: 2\npipeline_schedule: zbv\n", {}, 4, {"pipeline_schedule=zbv", "interleave_num=2, not 1"}},
      {"pipeline_parallel: 2\npipeline_schedule: dualpipev\n", {}, 4,
       {"pipeline_schedule=dualpipev", "interleave_num=2, not 1"}},
      {"pipeline_parallel: 2\npipeline_parallel_interleave_num: 2\npipeline_schedule: dualpipev\nmicro_batch_num: 2\n"
       "global_batch_size: 4\n",
       {}, 4, {"pipeline_schedule=dualpipev", "micro_batch_num >= 2 x pipeline_parallel = 4, not 2"}},
      {"pipeline_parallel: 2\npipeline_parallel_interleave_num: 2\npipeline_schedule: dualpipev\nmicro_batch_num: 4\n"
       "global_batch_size: 8\nrecompute: full\n",
       {"model.layers=4"}, 4, {"pipeline_schedule=dualpipev with recompute=full", "not supported yet"}},
      {"pipeline_parallel: 2\npipeline_schedule: zbh1\nrecompute: full\n", {}, 4,
       {"pipeline_schedule=zbh1 with recompute=full", "not supported yet"}},
      {"params_dtype: float16\n", {}, 4, {"params_dtype=float16", "not supported yet"}},
      {"compute_dtype: fp16\n", {}, 4, {"compute_dtype=float16", "not supported yet"}},
      {"reshard_after_forward_group_size: 3\n", {}, 4, {"reshard_after_forward_group_size=3", "does not divide", "data_parallel_shard=4"}},
      {"reshard_after_forward_group_size: 2\ndata_parallel_shard_strategy: optim_grads\n", {}, 4,
       {"reshard_after_forward_group_size=2", "optim_grads_params"}},
      {"reshard_after_forward_group_size: -1\n", {}, 4, {"reshard_after_forward_group_size"}},
  };
  for (const Case& k : cases) {
    std::string err = error_of(k.yaml, k.overrides, k.world);
    ASSERT_FALSE(err.empty()) << "accepted:\n" << k.yaml;
    for (const std::string& want : k.expect) {
      EXPECT_NE(err.find(want), std::string::npos) << "error for\n" << k.yaml << "is: " << err << "\nmissing: " << want;
    }
  }
}

TEST(TrainConfig, PipelineStageLayersList) {
  ht::TrainConfig c = ht::parse_config("pipeline_parallel: 2\npipeline_stage_layers: [2, 1]\n");
  EXPECT_EQ(c.pipeline_stage_layers, (std::vector<int64_t>{2, 1}));
  c.validate(4);
  ht::TrainConfig o = ht::parse_config("pipeline_parallel: 2\n", {"pipeline_stage_layers=1,2"});
  EXPECT_EQ(o.pipeline_stage_layers, (std::vector<int64_t>{1, 2}));
  hp::test::expect_error([] { ht::parse_config("pipeline_stage_layers: [[1], 2]\n"); }, {"must be a list of numbers"});
  hp::test::expect_error([] { ht::parse_config("seed: [1, 2]\n"); }, {"'seed' is a list"});
}

TEST(TrainConfig, EmptyOrCommentOnlyFileIsAnError) {
  for (const char* text : {"", "# only a comment\n", "---\n"}) {
    const std::string path = ::testing::TempDir() + "/hp_empty_config.yaml";
    {
      std::ofstream f(path);
      f << text;
    }
    hp::test::expect_error([&] { ht::load_config(path); }, {path, "holds no settings"});
  }
}

// Found by fuzz/config_fuzz.cpp (its input is fuzz/corpus/config/stall-leading-comma.yaml):
// a line starting with ',' (here a wrapped comment that lost its '#') made yaml-cpp 0.7's
// LoadAll loop forever, allocating until the machine ran out of memory.
TEST(TrainConfig, ATokenYamlCannotPassIsAnErrorNotAHang) {
  for (const char* text : {",", ", dense) trained on the synthetic corpus\nseed: 1\n", "seed: 1\n---\n,\n"}) {
    hp::test::expect_error([&] { ht::parse_config(text, {}, "c.yaml"); }, {"c.yaml", "YAML"});
    const std::string path = ::testing::TempDir() + "/hp_comma_config.yaml";
    {
      std::ofstream f(path);
      f << text;
    }
    hp::test::expect_error([&] { ht::load_config(path); }, {path, "YAML"});
  }
  // Documents are still counted.
  hp::test::expect_error([] { ht::parse_config("seed: 1\n---\nseed: 2\n", {}, "c.yaml"); }, {"2 YAML documents"});
}

TEST(TrainConfig, UnreadableFileIsNamed) {
  for (std::string path : {"/nonexistent/x.yaml", "/tmp"}) {
    try {
      ht::load_config(path);
      FAIL() << "no error for " << path;
    } catch (const hp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + path + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(TrainConfig, EveryKeyIsListedOnce) {
  auto keys = ht::config_keys();
  std::set<std::string> seen;
  for (const auto& k : keys) {
    EXPECT_TRUE(seen.insert(k.key).second) << k.key;
    EXPECT_FALSE(k.help.empty()) << k.key;
  }
  for (const char* want : {"params_dtype", "compute_dtype", "accumulate_allreduce_grads_in_fp32", "data_parallel",
                           "data_parallel_shard", "data_parallel_shard_strategy", "comm_fusion", "wait_per_submodule", "recompute", "tensor_parallel",
                           "sequence_parallel", "pipeline_parallel", "pipeline_parallel_interleave_num", "pipeline_schedule",
                           "micro_batch_num", "global_batch_size", "seq_length", "lr", "min_lr", "lr_warmup_steps",
                           "lr_decay_style", "weight_decay", "clip_grad", "train_steps", "seed", "model.type"}) {
    EXPECT_TRUE(seen.count(want)) << want;
  }
}

// The schedule against values computed by hand.
TEST(TrainSchedule, WarmupThenCosineOrLinear) {
  ht::TrainConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.lr_warmup_steps = 4;
  c.train_steps = 14;  // steps 0..13: 4 of warmup, 10 of decay
  EXPECT_DOUBLE_EQ(ht::lr_at(c, 0), 0.25);
  EXPECT_DOUBLE_EQ(ht::lr_at(c, 3), 1.0);                // the peak, at the end of warmup
  EXPECT_NEAR(ht::lr_at(c, 4), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.1)), 1e-12);  // decay 1/10
  EXPECT_NEAR(ht::lr_at(c, 8), 0.1 + 0.9 * 0.5, 1e-12);  // decay 5/10: cos = 0
  EXPECT_NEAR(ht::lr_at(c, 13), 0.1, 1e-12);             // the last step runs at min_lr
  c.lr_decay_style = ht::LrDecay::kLinear;
  EXPECT_NEAR(ht::lr_at(c, 5), 1.0 - 0.9 * 0.2, 1e-12);
  EXPECT_NEAR(ht::lr_at(c, 13), 0.1, 1e-12);
  c.lr_decay_style = ht::LrDecay::kConstant;
  EXPECT_DOUBLE_EQ(ht::lr_at(c, 12), 1.0);
  c.lr_warmup_steps = 0;
  c.lr_decay_style = ht::LrDecay::kCosine;
  c.train_steps = 2;
  EXPECT_NEAR(ht::lr_at(c, 0), 0.1 + 0.9 * 0.5, 1e-12);  // two steps: halfway, then the end
  EXPECT_NEAR(ht::lr_at(c, 1), 0.1, 1e-12);
}

// What PyTorch's optimizers and torchtitan accept is accepted, with a word: lr 0 (its
// schedule all zeros, Muon's peak still scheduled by the same warmup and decay) and a run
// shorter than its warmup (the warmup cut to the run).
TEST(TrainSchedule, LrZeroAndARunShorterThanItsWarmupAreAcceptedWithAWarning) {
  ht::TrainConfig c = ht::parse_config("lr: 0\nmin_lr: 0\nlr_warmup_steps: 2\ntrain_steps: 6\noptimizer: muon\n"
                                       "muon_lr: 0.02\nlr_decay_style: linear\n");
  c.validate(4);
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("lr=0"), std::string::npos) << c.warnings[0];
  EXPECT_NE(ht::describe(c).find("warning: lr=0"), std::string::npos) << ht::describe(c);
  for (int64_t k = 0; k < 6; ++k) EXPECT_EQ(ht::lr_at(c, k), 0.0) << k;
  EXPECT_DOUBLE_EQ(ht::muon_lr_at(c, 0), 0.01);          // warmup 1/2
  EXPECT_DOUBLE_EQ(ht::muon_lr_at(c, 1), 0.02);          // the peak
  EXPECT_NEAR(ht::muon_lr_at(c, 2), 0.02 * 0.75, 1e-15);  // linear decay 1/4 of the way to 0
  EXPECT_NEAR(ht::muon_lr_at(c, 5), 0.0, 1e-15);
  // With lr > 0 Muon's lr is lr's factor on muon_lr (the floor scaled too).
  c.lr = 1.0;
  c.min_lr = 0.2;
  EXPECT_NEAR(ht::muon_lr_at(c, 2), 0.02 * (1.0 - 0.8 * 0.25), 1e-15);

  ht::TrainConfig s = ht::parse_config("lr_warmup_steps: 5\n", {"train_steps=2"});
  s.validate(4);
  EXPECT_EQ(s.lr_warmup_steps, 2);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_NE(s.warnings[0].find("lr_warmup_steps=5 exceeds train_steps=2"), std::string::npos) << s.warnings[0];
  EXPECT_DOUBLE_EQ(ht::lr_at(s, 0), s.lr * 0.5);
  EXPECT_DOUBLE_EQ(ht::lr_at(s, 1), s.lr);
  s.validate(4);  // validated again: said once
  EXPECT_EQ(s.warnings.size(), 1u);
}

// Clipping in one process against a hand-computed norm: grads (3, 4) and (12) have norm 13.
TEST(TrainClip, NormAndScaleByHand) {
  std::vector<at::Tensor> g = {at::tensor({3.0f, 4.0f}), at::tensor({12.0f})};
  const double norm = ht::global_grad_norm(g, nullptr);
  EXPECT_DOUBLE_EQ(norm, 13.0);
  EXPECT_DOUBLE_EQ(ht::clip_grads_(g, 20.0, norm), 1.0);  // under the limit: untouched
  EXPECT_FLOAT_EQ(g[1].item<float>(), 12.0f);
  const double s = ht::clip_grads_(g, 6.5, norm);
  EXPECT_NEAR(s, 0.5, 1e-7);
  EXPECT_NEAR(g[0][1].item<float>(), 2.0f, 1e-6);
  EXPECT_NEAR(ht::global_grad_norm(g, nullptr), 6.5, 1e-5);
  EXPECT_DOUBLE_EQ(ht::clip_grads_(g, 0.0, 100.0), 1.0);  // 0 = off
}

// --estimate and --plan count a pipeline stage's parameters from the config alone (building
// the stages of a 671B model took minutes): against the stages built without storage.
TEST(Config, StageParameterCountsMatchTheBuiltStages) {
  std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"model:\n  type: llama\n  layers: 5\n", {}},
      {"model:\n  type: llama\n  layers: 5\n  tie_embeddings: true\n", {}},
      {"model:\n  type: deepseek\n  layers: 5\n", {}},
      {"model:\n  type: deepseek\n  layers: 5\n  dense_layers: 0\n", {}},
      {"model:\n  type: deepseek\n  layers: 4\n  dense_layers: 4\n", {}},
      {"model:\n  type: deepseek\n  layers: 5\n  dense_layers: 3\n", {}},
      {"model:\n  type: qwen3_moe\n  layers: 5\n  sparse_step: 2\n  attention_bias: true\n  head_dim: 24\n", {}},
      {"model:\n  type: mixtral\n  layers: 5\n", {}},
  };
  for (const auto& [yaml, overrides] : cases) {
    ht::TrainConfig c = ht::parse_config(yaml, overrides, "stages.yaml");
    for (int stages : {1, 2, 3, 4}) {
      for (const auto& slice : hp::models::split_layers(c.model->layers(), stages)) {
        auto m = ht::make_model(c, /*deferred=*/true, slice);
        int64_t built = 0;
        for (const auto& p : m->root().parameters()) built += p.numel();
        EXPECT_EQ(c.model->stage_params(slice), built)
            << yaml << " stages " << stages << " layers [" << slice.first_layer << ", " << slice.end_layer << ")";
      }
    }
  }
}

// The key table's defaults are TrainConfig{}'s: each key's listed default, set explicitly,
// gives a config equal to the default one, and so does the empty config.
TEST(TrainConfig, EveryKeysDefaultIsTheDefaultConfigs) {
  const ht::TrainConfig defaults;
  const auto want = ht::resolved_settings(defaults);
  EXPECT_EQ(ht::resolved_settings(ht::parse_config("")), want);
  int checked = 0;
  for (const auto& k : ht::config_keys()) {
    // Derived defaults name their source instead of a value; the model's fields are the
    // preset's (checked below).
    if (k.default_value == "preset" || k.default_value == "params_dtype" ||
        k.default_value == "output_dir/checkpoints" || k.default_value == "[] (even)" || k.default_value == "lr" ||
        k.default_value == "weight_decay") {
      continue;
    }
    const auto got = ht::resolved_settings(ht::parse_config("", {k.key + "=" + k.default_value}));
    EXPECT_EQ(got, want) << k.key << "=" << k.default_value;
    ++checked;
  }
  EXPECT_GE(checked, 40);
  // Hand-written: what the docs promise a config without keys trains.
  const ht::TrainConfig d;
  EXPECT_EQ(d.model.family().name(), "deepseek");
  EXPECT_EQ(d.model.preset(), "tiny");
  EXPECT_EQ(d.model->num_params(), hp::models::DeepSeekConfig::tiny().num_params());
  EXPECT_EQ(d.lr, 1e-3);
  EXPECT_EQ(d.adam_beta2, 0.95);
  EXPECT_EQ(d.global_batch_size, 8);
  EXPECT_EQ(d.pipeline_schedule, ht::PipelineScheduleKind::kAuto);
  EXPECT_EQ(d.data.type, ht::DataType::kSynthetic);
  // Every model field of each family reads back what its preset holds.
  for (const auto* f : hp::models::model_families()) {
    const ht::TrainConfig c = ht::parse_config("model:\n  type: " + f->name() + "\n");
    std::vector<std::string> sets;
    for (const auto& [key, value] : ht::resolved_settings(c)) {
      if (key.rfind("model.", 0) == 0) sets.push_back(key + "=" + value);
    }
    EXPECT_EQ(ht::resolved_settings(ht::parse_config("", sets)), ht::resolved_settings(c)) << f->name();
  }
}

// Every enum's names parse to their value and are written back the same.
TEST(TrainConfig, EnumChoicesRoundTrip) {
  auto check = [](const char* key, const auto& names) {
    for (const auto& [value, name] : names) {
      const auto settings = ht::resolved_settings(ht::parse_config("", {std::string(key) + "=" + name}));
      bool found = false;
      for (const auto& [k, v] : settings) {
        if (k == key) {
          EXPECT_EQ(v, name) << key;
          found = true;
        }
      }
      EXPECT_TRUE(found) << key;
    }
  };
  check("data.type", ht::enum_names<ht::DataType>());
  check("data.token_dtype", ht::enum_names<ht::TokenDtype>());
  check("data_parallel_shard_strategy", ht::enum_names<ht::ShardStrategy>());
  check("recompute", ht::enum_names<ht::Recompute>());
  check("pipeline_schedule", ht::enum_names<ht::PipelineScheduleKind>());
  check("lr_decay_style", ht::enum_names<ht::LrDecay>());
  check("moe_dispatcher", ht::enum_names<hp::ep::DispatcherKind>());
  check("device", ht::enum_names<ht::Device>());
  EXPECT_EQ(ht::parse_config("device: cuda\n").device, ht::Device::kCuda);
  EXPECT_NE(ht::describe(ht::parse_config("device: cuda\n")).find("device cuda"), std::string::npos);
  EXPECT_EQ(ht::parse_config("pipeline_schedule: zbv\n").pipeline_schedule, ht::PipelineScheduleKind::kZBV);
  EXPECT_EQ(ht::parse_config("recompute: selective\n").recompute, ht::Recompute::kSelective);
  EXPECT_EQ(ht::parse_config("recompute: light\n").recompute, ht::Recompute::kLight);
  EXPECT_EQ(ht::recompute_policy(ht::Recompute::kLight), hp::RecomputePolicy::kLight);
}

// A family registered at run time gets its keys parsed, listed and checked like the
// built-in ones.
TEST(TrainConfig, ARegisteredFamilyBringsItsKeys) {
  hp::test::register_toy_family();
  ht::TrainConfig c = ht::parse_config("model:\n  type: toy\n  toy_hidden: 48\n  layers: 5\n");
  EXPECT_EQ(c.model.family().name(), "toy");
  EXPECT_EQ(c.model.config<hp::test::ToyConfig>().hidden, 48);
  EXPECT_EQ(c.model->layers(), 5);
  EXPECT_EQ(c.model->num_params(), 2 * 64 * 16 + 5 * 2 * 16 * 48);  // by hand: embedding, head, blocks
  hp::test::expect_error([] { ht::parse_config("model:\n  type: toy\n  kv_heads: 2\n"); },
                         {"model.kv_heads=2", "model.type llama", "model.type is toy"});
  hp::test::expect_error([] { ht::parse_config("model:\n  toy_hidden: 2\n"); },
                         {"model.toy_hidden=2", "model.type toy", "model.type is deepseek"});
  hp::test::expect_error([] { ht::parse_config("model:\n  type: toy\n  preset: big\n"); },
                         {"model.preset=big", "small"});
  hp::test::expect_error([] { (void)ht::ModelSpec("gpt"); }, {"'gpt'", "deepseek, llama, qwen3_moe, mixtral, toy"});
  bool listed = false;
  for (const auto& k : ht::config_keys()) {
    if (k.key == "model.toy_hidden") listed = k.help.find("[toy]") != std::string::npos;
    if (k.key == "model.type") {
      EXPECT_NE(k.type.find("toy"), std::string::npos) << k.type;
    }
  }
  EXPECT_TRUE(listed);
  hp::test::expect_error([] { hp::models::register_model_family(std::make_shared<hp::test::ToyFamily>()); },
                         {"'toy' is registered already"});
}

// model.from_hf: the family and sizes from a Hugging Face config.json (written here as
// transformers writes a Llama's), the weights' folder with them; model keys beside it
// override (init_from_hf then checks them against the file); a checkpoint records the
// sizes, not the folder. What does not fit is named.
TEST(TrainConfig, ModelFromAHuggingFaceFolder) {
  namespace fs = std::filesystem;
  const std::string dir = ::testing::TempDir() + "/hp_from_hf_llama";
  fs::create_directories(dir);
  {
    std::ofstream f(dir + "/config.json");
    f << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 96,
             "intermediate_size": 200, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "rope_theta": 50000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
             "tie_word_embeddings": true, "torch_dtype": "bfloat16"})";
  }
  const ht::TrainConfig c = ht::parse_config("model:\n  from_hf: " + dir + "\n");
  ASSERT_EQ(c.model.family().name(), "llama");
  const auto& l = c.model.config<hp::models::LlamaConfig>();
  EXPECT_EQ(l.vocab, 300);
  EXPECT_EQ(l.dim, 96);
  EXPECT_EQ(l.hidden_dim(), 200);
  EXPECT_EQ(l.layers, 3);
  EXPECT_EQ(l.heads, 6);
  EXPECT_EQ(l.kv_heads, 2);
  EXPECT_EQ(l.max_seq, 128);
  EXPECT_EQ(l.rope_theta, 50000.0);
  EXPECT_EQ(l.norm_eps, 1e-5);
  EXPECT_TRUE(l.tie_embeddings);
  EXPECT_EQ(c.init_from_hf, dir);
  EXPECT_EQ(c.model.source(), dir);
  // Keys beside it override; an explicit init_from_hf stays.
  const ht::TrainConfig o = ht::parse_config("init_from_hf: elsewhere\nmodel:\n  from_hf: " + dir + "\n  dim: 48\n");
  EXPECT_EQ(o.model.config<hp::models::LlamaConfig>().dim, 48);
  EXPECT_EQ(o.init_from_hf, "elsewhere");
  // Recorded as its sizes: the settings read back as the same model without the folder.
  std::vector<std::string> sets;
  for (const auto& [key, value] : ht::resolved_settings(c)) {
    if (key.rfind("model.", 0) == 0) sets.push_back(key + "=" + value);
    if (key == "model.from_hf") EXPECT_EQ(value, "");
  }
  const ht::TrainConfig again = ht::parse_config("", sets);
  EXPECT_EQ(again.model.config<hp::models::LlamaConfig>().dim, 96);
  EXPECT_EQ(again.model.config<hp::models::LlamaConfig>().kv_heads, 2);
  // Errors, each naming the key and the folder or the value.
  hp::test::expect_error([&] { ht::parse_config("model:\n  type: deepseek\n  from_hf: " + dir + "\n"); },
                         {"model.from_hf=" + dir, "describes a llama model, but model.type is deepseek"});
  hp::test::expect_error([&] { ht::parse_config("model:\n  from_hf: " + dir + "/none\n"); },
                         {"model.from_hf=" + dir + "/none", "no config.json"});
  {
    std::ofstream f(dir + "/config.json");
    f << R"({"model_type": "gpt2", "vocab_size": 300})";
  }
  hp::test::expect_error([&] { ht::parse_config("model:\n  from_hf: " + dir + "\n"); },
                         {"model_type 'gpt2' is not supported yet", "llama", "deepseek_v3"});
}

// The tensors of a Hugging Face folder an import may pass over (as transformers does), by
// hand: the saved rotary frequencies; a tied Llama's lm_head.weight; DeepSeek's blocks after
// the last (multi-token prediction) only as unbuilt MTP modules (init_from_hf_drop_mtp
// decides). Nothing else: a leftover bias or norm is an error.
TEST(TrainConfig, HuggingFaceTensorsAnImportPassesOver) {
  ht::TrainConfig l = ht::parse_config("model:\n  type: llama\n  layers: 2\n");
  EXPECT_TRUE(l.model->hf_ignores("model.layers.0.self_attn.rotary_emb.inv_freq"));
  EXPECT_FALSE(l.model->hf_ignores("model.layers.0.self_attn.rotary_emb.inv_freq_x"));
  EXPECT_FALSE(l.model->hf_ignores("lm_head.weight"));
  EXPECT_FALSE(l.model->hf_ignores("model.layers.0.mlp.down_proj.bias"));
  EXPECT_FALSE(l.model->hf_ignores("model.layers.2.input_layernorm.weight"));
  ht::TrainConfig tied = ht::parse_config("model:\n  type: llama\n  tie_embeddings: true\n");
  EXPECT_TRUE(tied.model->hf_ignores("lm_head.weight"));
  EXPECT_FALSE(tied.model->hf_ignores("lm_head.bias"));
  ht::TrainConfig d = ht::parse_config("model:\n  type: deepseek\n  layers: 3\n  dense_layers: 1\n");
  EXPECT_FALSE(d.model->hf_ignores("model.layers.3.eh_proj.weight"));
  EXPECT_TRUE(d.model->hf_unbuilt_mtp("model.layers.3.eh_proj.weight"));
  EXPECT_TRUE(d.model->hf_unbuilt_mtp("model.layers.61.shared_head.norm.weight"));
  EXPECT_FALSE(d.model->hf_unbuilt_mtp("model.layers.2.mlp.gate.weight"));
  EXPECT_FALSE(d.model->hf_unbuilt_mtp("model.layers.x.mlp.gate.weight"));
  EXPECT_FALSE(d.model->hf_unbuilt_mtp("model.layers."));
  EXPECT_FALSE(d.model->hf_unbuilt_mtp("model.layers.99999999999999999999.mlp.gate.weight"));
  EXPECT_FALSE(d.model->hf_unbuilt_mtp("lm_head.weight"));
  EXPECT_FALSE(d.model->hf_ignores("lm_head.weight"));
  // With its module built, the block after the last is read, the one after that is not.
  ht::TrainConfig m = ht::parse_config("model:\n  type: deepseek\n  layers: 3\n  mtp_layers: 1\n");
  EXPECT_FALSE(m.model->hf_unbuilt_mtp("model.layers.3.eh_proj.weight"));
  EXPECT_TRUE(m.model->hf_unbuilt_mtp("model.layers.4.eh_proj.weight"));
  EXPECT_FALSE(l.model->hf_unbuilt_mtp("model.layers.2.input_layernorm.weight"));
  EXPECT_TRUE(d.model->hf_ignores("model.layers.0.self_attn.rotary_emb.inv_freq"));
}

// optimizer: muon's routing overrides against llama_tiny's parameters (per block wq, wk, wv,
// wo and the MLP's w1, w2, w3: 14 matrices over 2 blocks; the embedding and output head
// go to AdamW): by count, by hand.
TEST(TrainConfig, MuonRoutingOverrides) {
  auto config = [](const std::vector<std::string>& extra) {
    std::vector<std::string> o = {"optimizer=muon"};
    o.insert(o.end(), extra.begin(), extra.end());
    ht::TrainConfig c = ht::load_config(HP_SOURCE_DIR "/configs/llama_tiny.yaml", o);
    c.validate(1);
    return c;
  };
  EXPECT_EQ(ht::muon_matrix_shapes(config({})).size(), 14u);
  // The MLP's 3 matrices of each block to AdamW; the output head (256 x 64) to Muon.
  EXPECT_EQ(ht::muon_matrix_shapes(config({"muon_to_adamw=[layers_*.mlp.*]"})).size(), 8u);
  const auto with_head = ht::muon_matrix_shapes(config({"muon_to_muon=[output.weight]"}));
  ASSERT_EQ(with_head.size(), 15u);
  EXPECT_NE(std::find(with_head.begin(), with_head.end(), std::make_pair<int64_t, int64_t>(256, 64)), with_head.end());
  EXPECT_EQ(config({"muon_to_adamw=[layers_*.mlp.*]"}).muon_to_adamw, std::vector<std::string>{"layers_*.mlp.*"});
  hp::test::expect_error([&] { ht::muon_matrix_shapes(config({"muon_to_adamw=[layers_*.mpl.*]"})); },
                         {"muon_to_adamw: the pattern 'layers_*.mpl.*' matches no parameter"});
  hp::test::expect_error(
      [&] { ht::muon_matrix_shapes(config({"muon_to_adamw=[layers_0.*]", "muon_to_muon=[layers_0.attn.wq.weight]"})); },
      {"'layers_0.attn.wq.weight' matches both muon_to_adamw's 'layers_0.*' and muon_to_muon's"});
  hp::test::expect_error([&] { config({"muon_to_adamw=[a b]"}); }, {"pattern 'a b'", "only letters"});
  hp::test::expect_error([&] { ht::muon_matrix_shapes(config({"muon_to_muon=[layers_0.attn_norm.weight]"})); },
                         {"only matrices (2-D) are supported yet"});
  // Under adamw a routing key is an error, not ignored.
  hp::test::expect_error(
      [] {
        ht::TrainConfig c = ht::load_config(HP_SOURCE_DIR "/configs/llama_tiny.yaml", {"muon_to_muon=[output.weight]"});
        c.validate(1);
      },
      {"muon_to_muon=[output.weight] is given but optimizer=adamw"});
}

// Context parallelism's settings, refused before training with the value named.
TEST(TrainConfig, ContextParallelErrors) {
  auto validated = [](const std::vector<std::string>& o, int world) {
    ht::TrainConfig c = ht::load_config(HP_SOURCE_DIR "/configs/llama_tiny.yaml", o);
    c.validate(world);
    return c;
  };
  // llama_tiny: seq_length 64, 4 heads, 2 kv heads.
  const ht::TrainConfig ok = validated({"context_parallel=2"}, 4);
  EXPECT_EQ(ok.data_parallel_shard, 2);  // 4 ranks = dp_shard 2 x cp 2
  hp::test::expect_error([&] { validated({"context_parallel=2", "seq_length=66"}, 2); },
                         {"seq_length=66 with context_parallel=2", "not divisible by the 4 chunks"});
  hp::test::expect_error([&] { validated({"context_parallel=3"}, 4); }, {"context_parallel=3", "does not divide the world size 4"});
  hp::test::expect_error([&] { validated({"context_parallel=4", "context_parallel_method=ulysses"}, 4); },
                         {"ulysses needs the 4 query heads and 2 key/value heads of a rank divisible by context_parallel=4"});
  hp::test::expect_error([&] { validated({"context_parallel=2", "recompute=light"}, 2); },
                         {"recompute=light with context_parallel=2 is not supported yet"});
  hp::test::expect_error([&] { validated({"context_parallel_method=allgather"}, 1); },
                         {"context_parallel_method=allgather needs context_parallel > 1"});
  hp::test::expect_error(
      [&] {
        validated({"context_parallel=2", "tensor_parallel=4", "sequence_parallel=true", "seq_length=20", "model.kv_heads=4"},
                  8);
      },
      {"seq_length=20 over context_parallel=2 leaves 10 tokens per rank, not divisible by tensor_parallel=4"});
  EXPECT_EQ(validated({"context_parallel=2", "context_parallel_method=ulysses"}, 2).context_parallel_method,
            hp::cp::Method::kUlysses);
}

// The optimizer benchmark's model (BENCHMARKS.md, "Muon inside hp-train") is what the
// benchmark says: its 74 Muon matrices, listed here from the config's sizes. Per layer MLA's
// wq_a [q_lora, dim], wq_b [heads (nope + rope), q_lora], wkv_a [kv_lora + rope, dim],
// wkv_b [heads (nope + v), kv_lora], wo [dim, heads v]; the dense block's w1, w3 [hidden,
// dim] and w2 [dim, hidden]; each MoE block's 8 routed and 1 shared experts alike at hidden
// 128, and its router [experts, dim].
TEST(TrainConfig, TinyWideBenchmarkConfigHasItsMatrices) {
  ht::TrainConfig c = ht::load_config(HP_SOURCE_DIR "/configs/deepseek_tiny_wide.yaml", {"optimizer=muon"});
  c.validate(4);
  std::vector<std::pair<int64_t, int64_t>> want;
  for (int l = 0; l < 3; ++l) {
    for (auto s : {std::pair<int64_t, int64_t>{128, 256}, {8 * 48, 128}, {96 + 16, 256}, {8 * 64, 96}, {256, 8 * 32}}) {
      want.push_back(s);
    }
  }
  for (auto s : {std::pair<int64_t, int64_t>{512, 256}, {512, 256}, {256, 512}}) want.push_back(s);
  for (int l = 0; l < 2; ++l) {
    for (int e = 0; e < 9; ++e) {
      for (auto s : {std::pair<int64_t, int64_t>{128, 256}, {128, 256}, {256, 128}}) want.push_back(s);
    }
    want.emplace_back(8, 256);
  }
  std::vector<std::pair<int64_t, int64_t>> got = ht::muon_matrix_shapes(c);
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  int64_t elements = 0;
  for (const auto& [r, k] : got) elements += r * k;
  EXPECT_EQ(elements, 2842624);  // the startup line's "muon 74 matrices (2842624 parameters)"
}
