// Distributed checkpoints: saved from one layout, loaded into another, against slices of
// the global tensors made here (the same on every rank); replicated boxes written once; a
// folder without metadata is not a checkpoint; fully_shard's shards round-trip.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>

#include "hp/ckpt/checkpoint.h"
#include "hp/ckpt/safetensors.h"
#include "hp/core/files.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"
#include "test_util.h"

namespace hc = hp::ckpt;
namespace fs = std::filesystem;

namespace {

std::map<std::string, at::Tensor> globals() {
  at::manual_seed(9);
  return {{"a", at::randn({10, 6})},
          {"b", at::randn({7}).to(at::kBFloat16)},
          {"c", at::randn({5, 3, 4}, at::kDouble)}};
}

at::Tensor box(const at::Tensor& t, const hp::ShardSpec& s) {
  at::Tensor v = t;
  for (size_t d = 0; d < s.offsets.size(); ++d) v = v.narrow(static_cast<int64_t>(d), s.offsets[d], s.lengths[d]);
  return v;
}

// One item per tensor, its box by `splits` (per tensor).
std::vector<hc::Item> items(const std::map<std::string, at::Tensor>& g,
                            const std::map<std::string, std::vector<std::vector<hp::DimSplit>>>& splits, bool fill) {
  std::vector<hc::Item> out;
  for (const auto& [name, t] : g) {
    hp::ShardSpec s = hp::make_shard_spec(t.sizes().vec(), splits.at(name));
    at::Tensor local = fill ? box(t, s).clone() : at::full(s.lengths, -7, t.options());
    out.push_back({name, local, s});
  }
  return out;
}

std::string dir_for(const std::string& name) {
  return ::testing::TempDir() + "/hp_ckpt_" + name + "_np" + std::to_string(hp::world()->size());
}

}  // namespace

TEST(Checkpoint, SavedInOneLayoutLoadedInAnother) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  auto g = globals();
  const std::string dir = dir_for("reshard");
  // Saved: a over dim 0, b over the world, c over dim 1 (3 columns: some ranks hold none).
  hc::save(items(g, {{"a", {{{"world", n, r}}}}, {"b", {{{"world", n, r}}}}, {"c", {{}, {{"world", n, r}}}}}, true),
           dir, w, {{"step", "10"}});
  EXPECT_TRUE(fs::exists(dir + "/metadata.json"));
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  // Loaded: a over dim 1 in two nested splits, b whole on every rank, c over dims 0 and 2.
  const int half = n % 2 == 0 ? 2 : 1;
  auto load = items(g,
                    {{"a", {{}, {{"outer", half, r % half}, {"inner", n / half, r / half}}}},
                     {"b", {}},
                     {"c", {{{"x", n, r}}, {}, {{"y", 2, (r + 1) % 2}}}}},
                    false);
  auto values = hc::load(load, dir);
  EXPECT_EQ(values.at("step"), "10");
  for (const auto& it : load) EXPECT_TRUE(at::equal(it.local, box(g.at(it.name), it.spec))) << it.name;
}

// Replicas holding the same box (HSDP's dp_replicate) write it once: the files hold each
// element of every tensor exactly once.
TEST(Checkpoint, ReplicatedBoxesAreWrittenOnce) {
  auto w = hp::world();
  const int n = w->size(), r = w->rank();
  if (n % 2 != 0) GTEST_SKIP() << "needs pairs of replicas";
  auto g = globals();
  const std::string dir = dir_for("replicas");
  const int shards = n / 2, k = r % shards;  // ranks r and r + shards hold the same boxes
  hc::save(items(g, {{"a", {{{"dp_shard", shards, k}}}}, {"b", {{{"dp_shard", shards, k}}}}, {"c", {{{"dp_shard", shards, k}}}}},
                 true),
           dir, w);
  if (r == 0) {
    int64_t bytes = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() != ".safetensors") continue;
      auto h = hc::read_header(e.path().string());
      for (const auto& t : h.tensors) bytes += t.end - t.begin;
    }
    int64_t want = 0;
    for (const auto& [name, t] : g) want += static_cast<int64_t>(t.nbytes());
    EXPECT_EQ(bytes, want);
  }
  auto load = items(g, {{"a", {}}, {"b", {}}, {"c", {}}}, false);
  hc::load(load, dir);
  for (const auto& it : load) EXPECT_TRUE(at::equal(it.local, g.at(it.name))) << it.name;
  w->barrier().wait();
}

TEST(Checkpoint, OnlyCommittedFoldersLoadAndMismatchesAreNamed) {
  auto w = hp::world();
  auto g = globals();
  const std::string dir = dir_for("named");
  hc::save(items(g, {{"a", {}}, {"b", {}}, {"c", {}}}, true), dir, w);
  auto wrong = items({{"a", at::zeros({10, 5})}}, {{"a", {}}}, false);
  hp::test::expect_error([&] { hc::load(wrong, dir); }, {"tensor 'a' was saved with shape [10, 6]", "[10, 5]"});
  auto missing = items({{"zz", at::zeros({2})}}, {{"zz", {}}}, false);
  hp::test::expect_error([&] { hc::load(missing, dir); }, {"tensor 'zz' is not in the checkpoint"});
  auto dtype = items({{"b", at::zeros({7})}}, {{"b", {}}}, false);
  hp::test::expect_error([&] { hc::load(dtype, dir); }, {"tensor 'b' was saved as BF16"});
  // A folder a save never committed (no metadata.json), as a crash would leave it.
  const std::string half = dir_for("uncommitted");
  if (w->rank() == 0) {
    fs::create_directories(half);
    hc::write_file(half + "/rank0.safetensors", {{"a@0,0", g.at("a")}});
  }
  w->barrier().wait();
  auto any = items(g, {{"a", {}}, {"b", {}}, {"c", {}}}, false);
  hp::test::expect_error([&] { hc::load(any, half); }, {"not a committed checkpoint"});
  w->barrier().wait();
}

// A save that replaces a folder and is killed between setting the old one aside and
// renaming the new one in leaves `dir` missing and `dir`.old committed (made here by hand,
// as the kill would leave it): load finds the old one; the next save to `dir` commits over
// it and removes `dir`.old.
TEST(Checkpoint, ASaveKilledMidReplaceLeavesThePreviousOne) {
  auto w = hp::world();
  std::map<std::string, at::Tensor> g = {{"a", globals().at("a")}};
  const std::string dir = dir_for("replace");
  hc::save(items(g, {{"a", {}}}, true), dir, w);
  if (w->rank() == 0) {
    hp::files::remove_tree(dir + ".old");
    fs::rename(dir, dir + ".old");
  }
  w->barrier().wait();
  EXPECT_EQ(hc::committed_dir(dir), dir + ".old");
  auto back = items({{"a", at::zeros_like(g.at("a"))}}, {{"a", {}}}, false);
  hc::load(back, dir);
  EXPECT_TRUE(at::equal(back[0].local, g.at("a").narrow(0, back[0].spec.offsets[0], back[0].spec.lengths[0])));
  std::map<std::string, at::Tensor> g2 = {{"a", g.at("a") + 1}};
  hc::save(items(g2, {{"a", {}}}, true), dir, w);
  EXPECT_EQ(hc::committed_dir(dir), dir);
  EXPECT_FALSE(fs::exists(dir + ".old"));
  hc::load(back, dir);
  EXPECT_TRUE(at::equal(back[0].local, g2.at("a").narrow(0, back[0].spec.offsets[0], back[0].spec.lengths[0])));
  w->barrier().wait();
}

// A bad item on one rank only: every rank raises (that rank with its reason, the others
// naming it) instead of the others waiting in the next collective; the communicator stays
// usable and the next save works.
TEST(Checkpoint, AFailureOnOneRankFailsEveryRank) {
  auto w = hp::world();
  if (w->size() < 2) GTEST_SKIP() << "needs a second rank";
  auto g = globals();
  auto its = items(g, {{"a", {}}, {"b", {}}, {"c", {}}}, true);
  if (w->rank() == 1) its[0].local = at::zeros({3});  // not its spec's shape
  std::string msg;
  try {
    hc::save(its, dir_for("one_fails"), w);
  } catch (const hp::Error& e) {
    msg = e.what();
  }
  if (w->rank() == 1) {
    EXPECT_NE(msg.find("tensor 'a' is [3] but its spec says"), std::string::npos) << msg;
  } else {
    EXPECT_NE(msg.find("failed on rank 1"), std::string::npos) << msg;
  }
  hc::save(items(g, {{"a", {}}, {"b", {}}, {"c", {}}}, true), dir_for("one_fails"), w);
  EXPECT_TRUE(fs::exists(dir_for("one_fails") + "/metadata.json"));
}

// Integrity: every data file is checksummed in 1 MiB blocks. A flipped byte in a tensor's
// bytes, in the file's header, a truncated or a grown file: each an error naming the file
// (and the tensor whose read found it); a load that reads only intact blocks still works.
// One process (the corruptions are made here on its only file).
TEST(Checkpoint, CorruptionIsNamed) {
  auto w = hp::world();
  if (w->size() != 1) GTEST_SKIP() << "corrupts the single rank's file";
  at::manual_seed(3);
  // a: 3 MiB (blocks 0-3), then b: 2 MiB, alone in the file's last block.
  std::map<std::string, at::Tensor> g = {{"a", at::randn({768, 1024})}, {"b", at::randn({512, 1024})}};
  const std::string dir = dir_for("corrupt");
  hc::save(items(g, {{"a", {}}, {"b", {}}}, true), dir, w);
  const std::string file = dir + "/rank0.safetensors";
  const auto size = static_cast<int64_t>(fs::file_size(file));
  auto flip = [&](int64_t at) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(at);
    f.write(&c, 1);
  };
  auto load_one = [&](const std::string& name) {
    auto it = items({{name, g.at(name)}}, {{name, {}}}, false);
    hc::load(it, dir);
    EXPECT_TRUE(at::equal(it[0].local, g.at(name))) << name;
  };
  load_one("a");
  flip(size - 10);  // in b's last bytes
  hp::test::expect_error([&] { load_one("b"); }, {file, "is corrupted", "tensor 'b'"});
  load_one("a");  // a's blocks are intact
  flip(size - 10);
  load_one("b");
  flip(20);  // in the JSON header
  hp::test::expect_error([&] { load_one("a"); }, {file, "is corrupted", "its header"});
  flip(20);
  fs::resize_file(file, static_cast<uintmax_t>(size - 1));
  hp::test::expect_error([&] { load_one("a"); }, {file, "has " + std::to_string(size - 1) + " bytes",
                                                  "wrote " + std::to_string(size), "truncated"});
  fs::resize_file(file, static_cast<uintmax_t>(size + 1));
  hp::test::expect_error([&] { load_one("a"); }, {file, "has " + std::to_string(size + 1) + " bytes"});
}

// fully_shard's shards (state_dict: local rows and spec) saved, then loaded into a freshly
// built model's shards: the same values, at any rank count.
TEST(Checkpoint, FullyShardStateRoundTrips) {
  auto w = hp::world();
  torch::manual_seed(3);
  torch::nn::Linear a(7, 5);
  auto ha = hp::fully_shard(*a);
  std::vector<hc::Item> saved;
  for (const auto& st : ha->state_dict()) saved.push_back({st.name, st.local, st.spec});
  const std::string dir = dir_for("fsdp");
  hc::save(saved, dir, w);
  torch::manual_seed(4);  // other values
  torch::nn::Linear b(7, 5);
  auto hb = hp::fully_shard(*b);
  std::vector<hc::Item> loaded;
  for (const auto& st : hb->state_dict()) loaded.push_back({st.name, st.local, st.spec});
  {
    at::NoGradGuard ng;
    hc::load(loaded, dir);
  }
  auto pa = ha->parameters(), pb = hb->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(at::equal(pa[i], pb[i])) << i;
}
