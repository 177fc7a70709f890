// Checkpoints of tensor-parallel layouts: fully_shard's state_dict under tensor
// parallelism gives each shard's box in the global tensor (the tp piece split again over
// dp_shard), so a checkpoint saved by TP x FSDP loads into one process, into FSDP alone
// and back into TP x FSDP, bitwise.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "hp/ckpt/checkpoint.h"
#include "hp/core/files.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/llama.h"
#include "hp/models/tensor_parallel.h"
#include "hp/runtime.h"

namespace {

hp::models::LlamaConfig config() {
  hp::models::LlamaConfig c;
  c.vocab = 64;
  c.dim = 32;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn_dim = 48;
  return c;
}

struct Sharded {
  hp::models::Llama model{nullptr};
  std::vector<hp::FSDPHandle> handles;
};

// Llama with tensor parallelism over `tp` (when > 1) and fully_shard over dp_shard, its
// parameters initialized from `seed`.
Sharded build(int64_t tp, uint64_t seed) {
  auto w = hp::world();
  auto mesh = std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"dp_shard", -1}, {"tp", tp}});
  Sharded s;
  s.model = hp::models::Llama(config());
  if (tp > 1) hp::models::parallelize_llama(s.model, mesh->group("tp"));
  s.model->init_weights(seed);
  hp::FullyShardOptions o;
  o.mesh = mesh;
  for (auto& b : s.model->blocks) s.handles.push_back(hp::fully_shard(*b, o));
  s.handles.push_back(hp::fully_shard(*s.model, o));
  return s;
}

// Every shard as a checkpoint item named by its full parameter name.
std::vector<hp::ckpt::Item> items(const Sharded& s) {
  std::vector<hp::ckpt::Item> out;
  for (size_t i = 0; i < s.handles.size(); ++i) {
    const std::string prefix = i + 1 < s.handles.size() ? "layers_" + std::to_string(i) + "." : "";
    for (const auto& st : s.handles[i]->state_dict()) out.push_back({prefix + st.name, st.local, st.spec});
  }
  return out;
}

std::string dir() { return ::testing::TempDir() + "hp_tp_ckpt"; }

TEST(TpCheckpoint, SavedUnderTpFsdpLoadsIntoAnyLayoutBitwise) {
  auto w = hp::world();
  if (w->size() % 2 != 0) GTEST_SKIP() << "tensor_parallel=2 needs an even world";
  Sharded saved = build(2, 7);
  hp::ckpt::save(items(saved), dir(), w);
  at::NoGradGuard no_grad;  // loads write into parameters
  // One process: every tensor whole, against the model initialized whole from the same seed.
  hp::models::Llama one(config());
  one->init_weights(0);
  std::vector<hp::ckpt::Item> whole;
  for (const auto& item : one->named_parameters()) {
    at::Tensor t = item.value().detach();
    std::vector<std::vector<hp::DimSplit>> none(t.dim());
    whole.push_back({item.key(), t, hp::make_shard_spec(t.sizes().vec(), none)});
  }
  hp::ckpt::load(whole, dir());
  hp::models::Llama want(config());
  want->init_weights(7);
  auto want_params = want->named_parameters();
  for (const auto& item : one->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), want_params[item.key()])) << item.key();
  }
  // FSDP over every rank, and TP x FSDP again: each shard against the same layout built
  // from the seed.
  for (int64_t tp : {int64_t{1}, int64_t{2}}) {
    Sharded into = build(tp, 0), ref = build(tp, 7);
    auto got = items(into), expect = items(ref);
    hp::ckpt::load(got, dir());
    ASSERT_EQ(got.size(), expect.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i].local, expect[i].local)) << "tp " << tp << ": " << got[i].name;
    }
  }
  w->barrier().wait();
  if (w->rank() == 0) hp::files::remove_tree(dir());
}

}  // namespace
