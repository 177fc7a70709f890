// Deferred initialization: a model built under hp::memory::DeferredAllocation and sharded
// with param_init holds, on every rank, bitwise the shards of the same model built whole,
// initialized and then sharded; and building it costs about the shards plus one parameter.
#include <gtest/gtest.h>

#include <cstdio>
#include <utility>
#include <vector>

#include "fsdp/fsdp_test_util.h"
#include "hp/core/memory.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/deepseek.h"
#include "hp/models/llama.h"
#include "hp/runtime.h"
#include "test_util.h"

namespace {

std::shared_ptr<hp::DeviceMesh> mesh_for(bool hsdp) {
  auto w = hp::world();
  if (hsdp) return std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"dp_replicate", 2}, {"dp_shard", -1}});
  return std::make_shared<hp::DeviceMesh>(w, std::vector<hp::MeshDim>{{"dp_shard", -1}});
}

void cast(torch::nn::Module& m, at::ScalarType dt) {
  at::NoGradGuard ng;
  for (auto& p : m.parameters()) {
    if (p.scalar_type() != dt) p.set_data(p.to(dt));
  }
}

template <typename Model>
struct Built {
  std::unique_ptr<Model> model;
  std::vector<hp::FSDPHandle> handles;
  std::vector<hp::ShardedTensor> shards;  // this rank's
};

// Builds Model (a holder) from `cfg` whole or deferred, casts it to `dt`, shards every block
// then the root.
template <typename Model, typename Config>
Built<Model> build(const Config& cfg, bool deferred, at::ScalarType dt, bool hsdp) {
  hp::FullyShardOptions o;
  o.mesh = mesh_for(hsdp);
  o.comm_fusion = true;
  std::unique_ptr<Model> m;
  if (deferred) {
    hp::memory::DeferredAllocation scope;
    m = std::make_unique<Model>(cfg);
    cast(**m, dt);
  } else {
    m = std::make_unique<Model>(cfg);
    (*m)->init_weights(17);
    cast(**m, dt);
  }
  if (deferred) o.param_init = hp::models::parameter_initializer(**m, 17);
  auto sharded = hp::test::shard_blocks_then_root(*m, o);
  if (deferred) hp::materialize_deferred_buffers(**m);
  Built<Model> out;
  for (auto& h : sharded.handles) {
    for (auto& st : h->state_dict()) out.shards.push_back(st);
  }
  for (auto& b : (*m)->buffers()) {
    EXPECT_FALSE(hp::memory::is_deferred(b.storage().data())) << "a buffer kept no storage of its own";
    EXPECT_TRUE(at::equal(b, at::zeros_like(b)));
  }
  out.model = std::move(m);
  out.handles = sharded.handles;
  return out;
}

template <typename Model, typename Config>
void expect_bitwise(const Config& cfg, const char* what) {
  const int n = hp::world()->size();
  for (bool hsdp : {false, true}) {
    if (hsdp && n % 2 != 0) continue;
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(what) + (hsdp ? " hsdp " : " fsdp ") + c10::toString(dt));
      auto whole = build<Model>(cfg, false, dt, hsdp);
      auto deferred = build<Model>(cfg, true, dt, hsdp);
      const auto &want = whole.shards, &got = deferred.shards;
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].name, want[i].name);
        EXPECT_EQ(got[i].row_offset, want[i].row_offset);
        EXPECT_TRUE(at::equal(got[i].local, want[i].local)) << got[i].name;
      }
    }
  }
}

}  // namespace

TEST(DeferredInit, LlamaShardsAreBitwiseThoseOfTheWholeModel) {
  hp::models::LlamaConfig c = hp::models::LlamaConfig::tiny();
  c.dim = 48;  // rows not divisible by 3 or 4 ranks
  c.vocab = 101;
  expect_bitwise<hp::models::Llama>(c, "llama");
}

TEST(DeferredInit, DeepSeekShardsAreBitwiseThoseOfTheWholeModel) {
  expect_bitwise<hp::models::DeepSeek>(hp::models::DeepSeekConfig::tiny(), "deepseek");
}

// Memory while building and sharding: the shards this rank keeps, plus one scratch copy of
// the largest parameter (in fp32), counted by hand from the config. Llama (untied): the
// embedding and the head vocab x dim; per block wq and wo dim x dim, wk and wv kv_dim x dim,
// w1 and w3 hidden x dim, w2 dim x hidden, two norms of dim; the final norm. A rank keeps
// ceil(rows / n) rows of each (fully_shard pads dim 0 to the ranks), and with comm_fusion
// each parameter's shard starts 64-byte aligned in its group's buffer (under 64 bytes each).
// The slack: 1/64 of one block's fp32 bytes, for what else construction allocates.
TEST(DeferredInit, ConstructionHoldsTheShardsPlusOneParameter) {
  hp::models::LlamaConfig c = hp::models::LlamaConfig::tiny();
  c.dim = 128;
  c.vocab = 4096;  // the embedding and the head: 2 MiB each in fp32, the largest parameters
  c.layers = 4;
  const int64_t n = hp::world()->size();
  const int64_t D = c.dim, kv = c.kv_heads * (c.dim / c.heads), H = (8 * D / 3 + 31) / 32 * 32;
  ASSERT_EQ(H, 352);
  // (rows, columns) of every parameter.
  std::vector<std::pair<int64_t, int64_t>> shapes = {{c.vocab, D}, {c.vocab, D}, {D, 1}};
  for (int64_t l = 0; l < c.layers; ++l) {
    for (auto rc : std::vector<std::pair<int64_t, int64_t>>{{D, D}, {kv, D}, {kv, D}, {D, D}, {H, D}, {H, D}, {D, H},
                                                             {D, 1}, {D, 1}}) {
      shapes.push_back(rc);
    }
  }
  int64_t shard_bytes = 0, block_bytes = 0;
  for (auto [rows, cols] : shapes) shard_bytes += (rows + n - 1) / n * cols * 4 + 64;
  for (size_t i = 3; i < 3 + 9; ++i) block_bytes += shapes[i].first * shapes[i].second * 4;
  const int64_t largest = c.vocab * c.dim * 4;
  hp::purge_expired_forward_hooks();  // the earlier tests' dead modules' state, freed now
  const int64_t before = hp::memory::current_bytes();
  hp::memory::reset_peak();
  auto built = build<hp::models::Llama>(c, true, at::kFloat, false);
  const int64_t held = hp::memory::current_bytes() - before;
  const int64_t peak = hp::memory::peak_bytes() - before;
  if (hp::world()->rank() == 0) {
    std::printf("construction on %d rank(s): peak %.3f MiB, held %.3f MiB; by hand: shards %.3f MiB + largest "
                "parameter %.3f MiB + slack %.3f MiB\n",
                hp::world()->size(), peak / 1048576.0, held / 1048576.0, shard_bytes / 1048576.0, largest / 1048576.0,
                block_bytes / 64 / 1048576.0);
  }
  EXPECT_LE(held, shard_bytes + block_bytes / 64) << "held " << held << " B, shards by hand " << shard_bytes << " B";
  EXPECT_LE(peak, shard_bytes + largest + block_bytes / 64)
      << "peak " << peak << " B, shards by hand " << shard_bytes << " B, largest parameter " << largest << " B";
  // And the whole model was never there: 4 bytes x every parameter exceeds the peak at any
  // rank count (at one rank the shards are the whole model).
  if (n > 1) {
    EXPECT_LT(peak, 4 * c.num_params());
  }
}

TEST(DeferredInit, MissingInitializerIsAClearError) {
  hp::models::LlamaConfig c = hp::models::LlamaConfig::tiny();
  std::unique_ptr<hp::models::Llama> m;
  {
    hp::memory::DeferredAllocation scope;
    m = std::make_unique<hp::models::Llama>(c);
    hp::test::expect_error([&] { hp::fully_shard(*(*m)->blocks[0]); }, {"inside a DeferredAllocation scope"});
  }
  hp::test::expect_error([&] { hp::fully_shard(*(*m)->blocks[0]); }, {"DeferredAllocation", "param_init"});
}
