// Distributed checkpoints: saved from one layout, loaded into another, against slices of
// the global tensors made here (the same on every rank); replicated boxes written once; a
// folder without metadata is not a checkpoint; fully_shard's shards round-trip; a damaged
// or hostile metadata.json is refused naming the file, the key and the value.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "hp/ckpt/checkpoint.h"
#include "hp/ckpt/safetensors.h"
#include "hp/core/files.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/runtime.h"
#include "ckpt/faulty_storage.h"
#include "ckpt/metadata_edit.h"
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

// A save through a storage that fails one call (tests/ckpt/faulty_storage.h): every rank
// raises, the failing one naming the file and the system's error; the checkpoint committed
// before under the same name loads as it was. Short writes (3 bytes at a time) save the same
// tensors. The failing rank is the last one (rank 0 alone at one rank).
void expect_failed_save_keeps_previous(const hp::test::StorageFault& f, int failing_rank, const std::string& label,
                                       const std::string& expected) {
  auto w = hp::world();
  const std::string dir = dir_for("storage_" + label);
  auto g = globals();
  const std::map<std::string, std::vector<std::vector<hp::DimSplit>>> by_rank = {
      {"a", {{{"world", w->size(), w->rank()}}}}, {"b", {}}, {"c", {}}};
  hc::save(items(g, by_rank, true), dir, w);
  std::map<std::string, at::Tensor> changed;
  for (const auto& [k, t] : g) changed[k] = t + 1;
  auto storage = w->rank() == failing_rank ? std::make_shared<hp::test::FaultyStorage>(hc::local_storage(), f)
                                           : nullptr;
  std::string msg;
  try {
    hc::save(items(changed, by_rank, true), dir, w, {}, storage ? *storage : *hc::local_storage());
  } catch (const hp::Error& e) {
    msg = e.what();
  }
  if (storage) {
    EXPECT_GE(storage->counted(), f.nth) << label << ": the fault was never reached";
  }
  if (w->rank() == failing_rank) {
    EXPECT_NE(msg.find(expected), std::string::npos) << label << ": " << msg;
  } else {
    EXPECT_NE(msg.find("failed on rank " + std::to_string(failing_rank)), std::string::npos) << label << ": " << msg;
  }
  auto back = items(g, by_rank, false);
  hc::load(back, dir);
  auto want = items(g, by_rank, true);
  for (size_t i = 0; i < back.size(); ++i) EXPECT_TRUE(at::equal(back[i].local, want[i].local)) << label << " " << back[i].name;
  w->barrier().wait();
}

TEST(Checkpoint, AFailedWriteOrSyncKeepsThePreviousCheckpoint) {
  auto w = hp::world();
  const int last = w->size() - 1;
  hp::test::StorageFault full;  // the disk fills during the last rank's data file
  full.op = hp::test::StorageFault::Op::kWrite;
  full.path_has = "rank" + std::to_string(last) + ".safetensors";
  full.nth = 2;
  full.error = ENOSPC;
  expect_failed_save_keeps_previous(full, last, "enospc", "No space left on device");
  hp::test::StorageFault fsync_fails;  // metadata.json's fsync (rank 0 commits)
  fsync_fails.op = hp::test::StorageFault::Op::kSync;
  fsync_fails.path_has = "metadata.json";
  expect_failed_save_keeps_previous(fsync_fails, 0, "fsync", "Input/output error");
  // The rename that commits, after the previous folder was set aside (found as <dir>.old).
  // Rank 0's renames from inside <dir>.tmp come first: its data file's, metadata.json's.
  hp::test::StorageFault swap_fails;
  swap_fails.op = hp::test::StorageFault::Op::kRename;
  swap_fails.path_has = ".tmp";
  swap_fails.nth = 3;
  expect_failed_save_keeps_previous(swap_fails, 0, "rename", "Input/output error");
}

TEST(Checkpoint, ShortWritesSaveTheSameTensors) {
  auto w = hp::world();
  const std::string dir = dir_for("short_writes");
  auto g = globals();
  const std::map<std::string, std::vector<std::vector<hp::DimSplit>>> by_rank = {
      {"a", {{{"world", w->size(), w->rank()}}}}, {"b", {}}, {"c", {}}};
  hp::test::StorageFault f;
  f.short_writes = 3;
  hp::test::FaultyStorage storage(hc::local_storage(), f);
  hc::save(items(g, by_rank, true), dir, w, {{"k", "v"}}, storage);
  auto back = items(g, by_rank, false);
  EXPECT_EQ(hc::load(back, dir).at("k"), "v");
  auto want = items(g, by_rank, true);
  for (size_t i = 0; i < back.size(); ++i) EXPECT_TRUE(at::equal(back[i].local, want[i].local)) << back[i].name;
  w->barrier().wait();
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
  // In a's bytes in the header's block: the header's read finds it, and says the block
  // holds more than the header (it named the header alone).
  uint64_t hlen = 0;
  {
    std::ifstream f(file, std::ios::binary);
    f.read(reinterpret_cast<char*>(&hlen), 8);
  }
  flip(static_cast<int64_t>(8 + hlen + 100));
  hp::test::expect_error([&] { load_one("a"); },
                         {file, "bytes 0-1048576 do not match", "its header; the block also holds other bytes"});
  flip(static_cast<int64_t>(8 + hlen + 100));
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

// Hostile metadata.json: what a load reads from disk is untrusted. One process (the edits are
// made on its own folder); each edit is undone before the next.
namespace {

using json = nlohmann::json;

struct Saved {
  std::string dir, mpath, text;
  json meta;
  std::map<std::string, at::Tensor> g;
};

// a, b and c saved whole by the one process, with the value step = 10.
Saved save_plain(const std::string& name) {
  Saved s;
  s.g = globals();
  s.dir = dir_for(name);
  hp::files::remove_tree(s.dir);
  hc::save(items(s.g, {{"a", {}}, {"b", {}}, {"c", {}}}, true), s.dir, hp::world(), {{"step", "10"}});
  s.mpath = s.dir + "/metadata.json";
  s.text = hp::test::read_text(s.mpath);
  s.meta = json::parse(s.text);
  return s;
}

std::map<std::string, std::string> load_all(const Saved& s) {
  auto back = items(s.g, {{"a", {}}, {"b", {}}, {"c", {}}}, false);
  auto values = hc::load(back, s.dir);
  for (const auto& it : back) EXPECT_TRUE(at::equal(it.local, s.g.at(it.name))) << it.name;
  return values;
}

}  // namespace

// metadata.json carries a checksum of its own (the block hash of its compact dump, written
// here from docs/ckpt.md): a changed character is refused, also one that would be read
// without complaint (a value), and a missing or malformed checksum.
TEST(CheckpointHostile, MetadataChecksumCatchesDamage) {
  if (hp::world()->size() != 1) GTEST_SKIP() << "edits the single rank's folder";
  Saved s = save_plain("hostile_sum");
  ASSERT_TRUE(s.meta.contains("checksum"));
  EXPECT_EQ(s.meta["format"], "hyperparallel-checkpoint-2");
  EXPECT_EQ(s.meta["checksum"], hp::test::doc_checksum(s.meta));
  // Damage: the saved value "10" read back as "19", a dtype, a byte count.
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"step\": \"10\"", "\"step\": \"19\""}, {"\"F32\"", "\"F64\""}, {"\"bytes\": ", "\"bytes\": 1"}}) {
    std::string text = s.text;
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    hp::test::write_text(s.mpath, text);
    hp::test::expect_error([&] { load_all(s); }, {s.mpath, "was altered or damaged", "the checksum it was written with"});
    hp::test::expect_error([&] { hc::saved_tensors(s.dir); }, {s.mpath, "was altered or damaged"});
  }
  json m = s.meta;
  m["checksum"] = "123";
  hp::test::write_text(s.mpath, m.dump(1));
  hp::test::expect_error([&] { load_all(s); }, {s.mpath, "altered or damaged", "written with is 123"});
  m["checksum"] = "-5";
  hp::test::write_text(s.mpath, m.dump(1));
  hp::test::expect_error([&] { load_all(s); }, {s.mpath, "checksum is \"-5\"", "decimal digits"});
  m.erase("checksum");
  hp::test::write_text(s.mpath, m.dump(1));
  hp::test::expect_error([&] { load_all(s); }, {s.mpath, "checksum is missing"});
  hp::test::write_text(s.mpath, s.text);
  EXPECT_EQ(load_all(s).at("step"), "10");
}

// The schema, with the checksum recomputed after each edit (a consistent file, as a tool
// could write): every type, count and range is checked, and the error names the file, the
// key and the value. Before these checks a block of 0 raised SIGFPE, a missing member was
// undefined behaviour, a value of another type a bare nlohmann message.
TEST(CheckpointHostile, MetadataSchemaNamesTheKeyAndValue) {
  if (hp::world()->size() != 1) GTEST_SKIP() << "edits the single rank's folder";
  Saved s = save_plain("hostile_schema");
  const std::string f = "files[\"rank0.safetensors\"]", a = "tensors[\"a\"]", c0 = a + "[\"chunks\"][0]";
  struct Case {
    std::function<void(json&)> edit;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {[](json& m) { m["files"]["rank0.safetensors"]["block"] = 0; }, {f + "[\"block\"] is 0", "at least 1"}},
      {[](json& m) { m["files"]["rank0.safetensors"]["block"] = -1048576; }, {f + "[\"block\"] is -1048576"}},
      {[](json& m) { m["files"]["rank0.safetensors"].erase("block"); }, {f + "[\"block\"] is missing"}},
      {[](json& m) { m["files"]["rank0.safetensors"]["bytes"] = "934"; }, {f + "[\"bytes\"] is \"934\"", "an integer"}},
      {[](json& m) { m["files"]["rank0.safetensors"]["bytes"] = -1; }, {f + "[\"bytes\"] is -1", "at least 0"}},
      {[](json& m) { m["files"]["rank0.safetensors"]["checksums"] = json::array(); }, {f + "[\"checksums\"] is []", "0 checksums"}},
      {[](json& m) { m["files"]["rank0.safetensors"]["checksums"][0] = "12x"; }, {f + "[\"checksums\"][0] is \"12x\""}},
      {[](json& m) { m["files"]["rank0.safetensors"]["checksums"][0] = 12; }, {f + "[\"checksums\"][0] is 12", "a string"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["offsets"] = {-1, 0}; }, {c0 + "[\"offsets\"][0] is -1", "at least 0"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["offsets"] = {5, 0}; }, {c0 + " is ", "runs past the tensor's shape [10, 6] in dim 0"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["offsets"] = {uint64_t(18446744073709551615ULL), 0}; },
       {c0 + "[\"offsets\"][0] is 18446744073709551615", "at most"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["lengths"] = {0, 6}; }, {c0 + "[\"lengths\"][0] is 0", "at least 1"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["lengths"] = {10, 7}; }, {c0 + " is ", "in dim 1"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["lengths"] = {10}; }, {c0 + "[\"lengths\"] is [10]", "expected 2 entries"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["lengths"] = {10, 6.0}; }, {c0 + "[\"lengths\"][1] is 6.0", "an integer"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0].erase("key"); }, {c0 + "[\"key\"] is missing"}},
      {[](json& m) { m["tensors"]["a"]["chunks"][0]["file"] = "rank7.safetensors"; },
       {c0 + "[\"file\"] is \"rank7.safetensors\"", "not listed under 'files'"}},
      {[](json& m) { m["tensors"]["a"]["shape"] = {-10, 6}; }, {a + "[\"shape\"][0] is -10"}},
      {[](json& m) { m["tensors"]["a"]["dtype"] = "F99"; }, {a + "[\"dtype\"] is \"F99\"", "not a safetensors dtype"}},
      {[](json& m) { m["tensors"]["a"]["chunks"] = "none"; }, {a + "[\"chunks\"] is \"none\""}},
      {[](json& m) { m["tensors"] = json::array(); }, {"tensors is []"}},
      {[](json& m) { m["values"]["step"] = 10; }, {"values[\"step\"] is 10", "expected a string"}},
      {[](json& m) { m["extra"] = 1; }, {"'extra' is not a member"}},
      {[](json& m) { m["format"] = "hyperparallel-checkpoint-9"; }, {"format is \"hyperparallel-checkpoint-9\""}},
  };
  for (const auto& cs : cases) {
    json m = s.meta;
    cs.edit(m);
    hp::test::write_metadata(s.dir, m);
    try {
      load_all(s);
      ADD_FAILURE() << "loaded after the edit that should give '" << cs.parts[0] << "'";
    } catch (const hp::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(s.mpath), std::string::npos) << what;
      for (const auto& p : cs.parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << what << "' lacks '" << p << "'";
    }
  }
  hp::test::write_text(s.mpath, s.text);
  EXPECT_EQ(load_all(s).at("step"), "10");
}

// A chunk's file is a name inside the checkpoint's folder: not a path to another checkpoint
// (which loaded its bytes without a word), not an absolute path, not a symbolic link out.
TEST(CheckpointHostile, ChunkFilesStayInTheFolder) {
  if (hp::world()->size() != 1) GTEST_SKIP() << "edits the single rank's folder";
  Saved s = save_plain("hostile_paths");
  // Another checkpoint of the same layout, other values.
  const std::string other = dir_for("hostile_paths_other");
  hp::files::remove_tree(other);
  std::map<std::string, at::Tensor> g2;
  for (const auto& [n, t] : s.g) g2[n] = t + 1;
  hc::save(items(g2, {{"a", {}}, {"b", {}}, {"c", {}}}, true), other, hp::world());
  const json other_meta = json::parse(hp::test::read_text(other + "/metadata.json"));
  const std::string rel = "../" + fs::path(other).filename().string() + "/rank0.safetensors";
  const std::string abs = fs::absolute(other + "/rank0.safetensors").string();
  for (const std::string& file : {rel, abs, std::string(".."), std::string("")}) {
    // The chunks moved to the path, its checksums listed under it (what the old reader
    // followed), and the chunks alone.
    json m = s.meta;
    for (auto& [name, t] : m["tensors"].items()) t["chunks"][0]["file"] = file;
    json listed = m;
    listed["files"] = {{file, other_meta["files"]["rank0.safetensors"]}};
    hp::test::write_metadata(s.dir, listed);
    hp::test::expect_error([&] { load_all(s); }, {s.mpath, "files[\"" + file + "\"] is \"" + file + "\"",
                                                  "not a file name inside"});
    hp::test::write_metadata(s.dir, m);
    hp::test::expect_error([&] { load_all(s); }, {s.mpath, "[\"chunks\"][0][\"file\"] is \"" + file + "\"",
                                                  "not a file name inside"});
  }
  hp::test::write_text(s.mpath, s.text);
  // A symbolic link in the folder to the other checkpoint's file, its checksums copied (so
  // the file checks would pass): refused, not followed.
  const std::string mine = s.dir + "/rank0.safetensors";
  fs::rename(mine, mine + ".set_aside");
  fs::create_symlink(fs::absolute(other + "/rank0.safetensors"), mine);
  json m = s.meta;
  m["files"]["rank0.safetensors"] = other_meta["files"]["rank0.safetensors"];
  hp::test::write_metadata(s.dir, m);
  hp::test::expect_error([&] { load_all(s); }, {mine, "is a symbolic link"});
  fs::remove(mine);
  fs::rename(mine + ".set_aside", mine);
  // metadata.json itself a link (to the other checkpoint's).
  fs::remove(s.mpath);
  fs::create_symlink(fs::absolute(other + "/metadata.json"), s.mpath);
  hp::test::expect_error([&] { load_all(s); }, {s.mpath, "is a symbolic link"});
  fs::remove(s.mpath);
  hp::test::write_text(s.mpath, s.text);
  EXPECT_EQ(load_all(s).at("step"), "10");
}

// Two chunks covering the same elements: counted twice, they hid elements never read (the
// box kept whatever it held). Refused, naming both.
TEST(CheckpointHostile, OverlappingChunksAreRefused) {
  if (hp::world()->size() != 1) GTEST_SKIP() << "edits the single rank's folder";
  at::manual_seed(5);
  const at::Tensor a = at::randn({10, 6});
  const std::string dir = dir_for("hostile_overlap");
  hp::files::remove_tree(dir);
  // The two halves of a's rows, as two ranks would hold them.
  std::vector<hc::Item> halves;
  for (int k = 0; k < 2; ++k) {
    hp::ShardSpec sp = hp::make_shard_spec({10, 6}, {{{"world", 2, k}}});
    halves.push_back({"a", box(a, sp).clone(), sp});
  }
  hc::save(halves, dir, hp::world());
  json m = json::parse(hp::test::read_text(dir + "/metadata.json"));
  ASSERT_EQ(m["tensors"]["a"]["chunks"].size(), 2u);
  auto whole = [&] {
    std::vector<hc::Item> it = {{"a", at::full({10, 6}, -7.0), hp::make_shard_spec({10, 6}, {})}};
    hc::load(it, dir);
    EXPECT_TRUE(at::equal(it[0].local, a));
  };
  whole();
  m["tensors"]["a"]["chunks"][1] = m["tensors"]["a"]["chunks"][0];
  hp::test::write_metadata(dir, m);
  hp::test::expect_error(whole, {"tensor 'a'", "rank0.safetensors:a@0,0 and rank0.safetensors:a@0,0 overlap"});
}

// Checkpoints written before the checksum (format 1, no "checksum") still load: their owners
// keep them. The schema applies to them the same.
TEST(CheckpointHostile, Format1WithoutChecksumLoadsSchemaChecked) {
  if (hp::world()->size() != 1) GTEST_SKIP() << "edits the single rank's folder";
  Saved s = save_plain("hostile_v1");
  json m = s.meta;
  m["format"] = "hyperparallel-checkpoint-1";
  m.erase("checksum");
  hp::test::write_metadata(s.dir, m);
  EXPECT_EQ(load_all(s).at("step"), "10");
  EXPECT_EQ(hc::saved_tensors(s.dir).at("a").shape, (std::vector<int64_t>{10, 6}));
  m["checksum"] = hp::test::doc_checksum(m);  // format 1 has none: a member it does not know
  hp::test::write_metadata(s.dir, m);
  hp::test::expect_error([&] { load_all(s); }, {s.mpath, "'checksum' is not a member"});
  m.erase("checksum");
  m["files"]["rank0.safetensors"]["block"] = 0;
  hp::test::write_metadata(s.dir, m);
  hp::test::expect_error([&] { load_all(s); }, {s.mpath, "files[\"rank0.safetensors\"][\"block\"] is 0"});
  hp::test::write_text(s.mpath, s.text);
}
