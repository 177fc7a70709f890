#include "hp/ckpt/consolidated.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "hp/ckpt/float8.h"
#include "hp/ckpt/safetensors.h"
#include "hp/core/error.h"
#include "hp/core/untrusted.h"
#include "reader.h"

namespace hp::ckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kIndex = "model.safetensors.index.json";

std::string shard_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

}  // namespace

void export_consolidated(const std::string& ckpt_dir, const std::vector<std::pair<std::string, std::string>>& tensors,
                         const std::string& out_dir, const CommPtr& world, const ExportOptions& o,
                         const std::map<std::string, std::string>& extra_files) {
  const int rank = world->rank(), size = world->size();
  const std::string what = "export of '" + ckpt_dir + "' to '" + out_dir + "'";
  const std::string tmp = out_dir + ".tmp";
  const std::string from = committed_dir(ckpt_dir);
  // Everything checked (and the folder made) before any rank writes.
  std::string problem;
  json meta;
  struct Planned {
    std::string source, name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t bytes;
    bool float8 = false;  // written as its FP8 bytes and `name`_scale_inv beside them
  };
  std::vector<Planned> plan;
  try {
    HP_CHECK(o.max_shard_bytes > 0, what, ": max_shard_bytes must be positive, got ", o.max_shard_bytes);
    HP_CHECK(!fs::exists(out_dir), what, ": '", out_dir, "' already exists (choose a new folder; nothing is overwritten)");
    meta = detail::read_metadata(from);
    std::set<std::string> seen;
    for (const auto& [source, name] : tensors) {
      HP_CHECK(meta["tensors"].contains(source), what, ": tensor '", source, "' is not in the checkpoint");
      HP_CHECK(!name.empty() && seen.insert(name).second, what, ": the output name '", name, "' is empty or repeated");
      const json& t = meta["tensors"][source];
      const at::ScalarType saved = dtype_from_string(t["dtype"].get<std::string>());
      Planned p{source, name, o.keep_dtype.count(source) ? saved : o.dtype.value_or(saved),
                t["shape"].get<std::vector<int64_t>>(), 0};
      p.float8 = o.float8_names.count(source) > 0;
      HP_CHECK(!p.float8 || p.shape.size() == 2, what, ": '", source, "' of shape ", c10::IntArrayRef(p.shape),
               " cannot be written as FP8 with block scales (2-D weights only)");
      if (p.float8) p.dtype = at::kFloat;  // read in fp32, then quantized
      p.bytes = p.float8 ? 1 : static_cast<int64_t>(c10::elementSize(p.dtype));
      for (int64_t d : p.shape) p.bytes *= d;
      if (p.float8) p.bytes += 4 * ((p.shape[0] + 127) / 128) * ((p.shape[1] + 127) / 128);  // its scales
      plan.push_back(std::move(p));
    }
    if (rank == 0) {
      Storage& storage = *local_storage();
      storage.remove_tree(tmp);
      storage.make_folders(tmp);
    }
  } catch (const std::exception& e) {
    problem = e.what();
  }
  raise_if_any_failed(world, problem, what);
  // Files filled in order up to max_shard_bytes.
  std::vector<std::vector<size_t>> files;
  int64_t in_file = 0, total = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (files.empty() || (in_file > 0 && in_file + plan[i].bytes > o.max_shard_bytes)) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(i);
    in_file += plan[i].bytes;
    total += plan[i].bytes;
  }
  std::string error;
  try {
    for (size_t k = static_cast<size_t>(rank); k < files.size(); k += static_cast<size_t>(size)) {
      std::vector<Item> items;
      for (size_t i : files[k]) {
        const Planned& p = plan[i];
        items.push_back({p.name, at::empty(p.shape, at::TensorOptions().dtype(p.dtype)),
                         make_shard_spec(p.shape, {}), p.source});
      }
      detail::load_boxes(items, from, meta["tensors"], meta.contains("files") ? meta["files"] : json::object(),
                         /*convert=*/true, "the checkpoint");
      std::vector<std::pair<std::string, at::Tensor>> out;
      std::set<std::string> float8;
      for (size_t j = 0; j < items.size(); ++j) {
        if (!plan[files[k][j]].float8) {
          out.emplace_back(items[j].name, items[j].local);
          continue;
        }
        auto [codes, scales] = quantize_e4m3fn_blocks(items[j].local);
        out.emplace_back(items[j].name, codes);
        out.emplace_back(float8_scale_name(items[j].name), scales);
        float8.insert(items[j].name);
      }
      write_file(tmp + "/" + shard_name(k, files.size()), out, {{"format", "pt"}}, *local_storage(), float8);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  raise_if_any_failed(world, error, what);
  std::string commit_error;
  if (rank == 0) try {
    json index;
    index["metadata"] = {{"total_size", total}};
    json map = json::object();
    for (size_t k = 0; k < files.size(); ++k) {
      for (size_t i : files[k]) {
        map[plan[i].name] = shard_name(k, files.size());
        if (plan[i].float8) map[float8_scale_name(plan[i].name)] = shard_name(k, files.size());
      }
    }
    index["weight_map"] = map;
    Storage& storage = *local_storage();
    write_atomically(storage, tmp + "/" + kIndex, tmp + "/" + kIndex + ".partial", index.dump(2) + "\n");
    for (const auto& [name, text] : extra_files) write_atomically(storage, tmp + "/" + name, tmp + "/" + name + ".partial", text);
    storage.rename(tmp, out_dir);
    storage.sync(fs::absolute(out_dir).parent_path().string());
  } catch (const std::exception& e) {
    commit_error = e.what();
  }
  raise_if_any_failed(world, commit_error, what);
}

std::map<std::string, std::string> consolidated_tensors(const std::string& dir) {
  std::map<std::string, std::string> where;
  const std::string index_path = dir + "/" + kIndex;
  if (fs::exists(index_path)) {
    const std::string text = hp::files::read_regular(index_path, "safetensors index");
    hp::text::check_json_nesting(text, "'" + index_path + "'");
    json index;
    try {
      index = json::parse(text);
      for (const auto& [name, file] : index.at("weight_map").items()) where[name] = file.get<std::string>();
    } catch (const std::exception& e) {
      HP_CHECK(false, "'", index_path, "' is not a safetensors index (a JSON object with a weight_map of file names): ",
               e.what());
    }
    // The shards agree with the index: a tensor a shard holds that the index does not list
    // would be passed over, and one two shards hold would be read from the index's without a
    // word. Each shard the index names is read (its header alone) to check.
    std::set<std::string> files;
    for (const auto& [name, file] : where) files.insert(file);
    for (const std::string& file : files) {
      HP_CHECK(detail::is_plain_file_name(file), "'", index_path, "' names the file '", file,
               "' (a file name in the folder is expected)");
      SafetensorsHeader header;
      try {
        header = read_header(dir + "/" + file);
      } catch (const Error& e) {
        throw Error(hp::detail::str_cat("'", index_path, "' names the shard '", file, "': ", e.what()));
      }
      for (const TensorEntry& t : header.tensors) {
        auto w = where.find(t.name);
        HP_CHECK(w != where.end(), "'", dir, "/", file, "' holds the tensor '", t.name, "', which ", kIndex,
                 " does not list (an index that describes less than its shards hold)");
        HP_CHECK(w->second == file, "the tensor '", t.name, "' is in both '", file, "' and '", w->second, "' of '", dir,
                 "' (", kIndex, " names '", w->second, "'): which one holds it is not clear");
      }
    }
  } else {
    HP_CHECK(fs::exists(dir + "/model.safetensors"), "'", dir, "' holds neither ", kIndex,
             " nor model.safetensors: not a consolidated checkpoint");
    for (const auto& t : read_header(dir + "/model.safetensors").tensors) where[t.name] = "model.safetensors";
  }
  return where;
}

namespace {

// A weight stored as float8_e4m3fn bytes (hp/ckpt/float8.h), read for `item`: its bytes and
// the scales of the blocks its box touches, then dequantized into item.local.
struct Float8Read {
  const Item* item;
  std::string name, scale_name;
  Item bytes, scales;
};

}  // namespace

void load_consolidated(const std::vector<Item>& items, const std::string& dir) {
  const std::map<std::string, std::string> where = consolidated_tensors(dir);
  const std::string index_path = dir + "/" + kIndex;
  // FP8 weights with block scales where config.json says so (checked; none without it).
  c10::optional<Float8Blocks> blocks;
  if (fs::exists(dir + "/config.json")) {
    blocks = hf_float8_blocks(hp::files::read_regular(dir + "/config.json", "config.json"), dir + "/config.json");
  }
  // The catalog of the tensors asked for: each a single chunk, the whole tensor.
  json tensors = json::object();
  std::map<std::string, SafetensorsHeader> headers;
  const auto entry = [&](const std::string& name) -> const TensorEntry& {
    auto w = where.find(name);
    HP_CHECK(w != where.end(), "load of '", dir, "': tensor '", name, "' is not in it");
    const std::string& file = w->second;  // a plain file name: consolidated_tensors checked it
    auto h = headers.find(file);
    if (h == headers.end()) h = headers.emplace(file, read_header(dir + "/" + file)).first;
    const TensorEntry* e = h->second.find(name);
    HP_CHECK(e != nullptr, "load of '", dir, "': '", file, "' lacks the tensor '", name, "' its index maps to it");
    if (!tensors.contains(name)) {
      tensors[name] = {{"dtype", dtype_string(e->dtype)},
                       {"shape", e->shape},
                       {"chunks", json::array({{{"file", file},
                                                {"key", name},
                                                {"offsets", std::vector<int64_t>(e->shape.size(), 0)},
                                                {"lengths", e->shape}}})}};
    }
    return *e;
  };
  std::vector<Item> plain;
  std::vector<Float8Read> float8;
  for (const auto& it : items) {
    const std::string& name = it.source.empty() ? it.name : it.source;
    const TensorEntry& e = entry(name);
    if (!e.e4m3fn) {
      plain.push_back(it);
      continue;
    }
    const std::string at = "load of '" + dir + "': tensor '" + name + "' (in '" + where.at(name) + "') is F8_E4M3";
    HP_CHECK(blocks.has_value(), at, ", but config.json has no quantization_config to say how it is scaled");
    HP_CHECK(e.shape.size() == 2, at, " of shape ", c10::IntArrayRef(e.shape),
             ": only 2-D weights with block scales are supported yet");
    Float8Read r{&it, name, float8_scale_name(name), {}, {}};
    HP_CHECK(where.count(r.scale_name), at, ", but the folder has no '", r.scale_name, "' (its block scales)");
    const TensorEntry& se = entry(r.scale_name);
    const std::vector<int64_t> want = {(e.shape[0] + blocks->rows - 1) / blocks->rows,
                                       (e.shape[1] + blocks->cols - 1) / blocks->cols};
    HP_CHECK(!se.e4m3fn && at::isFloatingType(se.dtype) && se.shape == want, "load of '", dir, "': the scales '",
             r.scale_name, "' (in '", where.at(r.scale_name), "') are ", se.dtype_name(), " of shape ",
             c10::IntArrayRef(se.shape), "; the ", blocks->rows, " x ", blocks->cols, " blocks of '", name, "' ",
             c10::IntArrayRef(e.shape), " need floating-point scales of shape ", c10::IntArrayRef(want));
    const ShardSpec& box = it.spec;
    r.bytes = {it.name + " (float8 bytes)", at::Tensor(), box, name};  // allocated when it is read
    if (box.empty()) continue;  // nothing of it on this rank
    const int64_t first_row = box.offsets[0] / blocks->rows, first_col = box.offsets[1] / blocks->cols;
    const int64_t last_row = (box.offsets[0] + box.lengths[0] - 1) / blocks->rows;
    const int64_t last_col = (box.offsets[1] + box.lengths[1] - 1) / blocks->cols;
    ShardSpec scale_box = make_shard_spec(want, {});
    scale_box.offsets = {first_row, first_col};
    scale_box.lengths = {last_row - first_row + 1, last_col - first_col + 1};
    r.scales = {it.name + " (float8 scales)", at::Tensor(), scale_box, r.scale_name};
    float8.push_back(std::move(r));
  }
  // The hub's cache links a snapshot's files to blobs elsewhere: links are followed here.
  detail::load_boxes(plain, dir, tensors, json::object(), /*convert=*/true, "the folder", detail::FileLinks::kFollow);
  // FP8 weights one at a time: their bytes and scales held only while each is decoded.
  for (Float8Read& r : float8) {
    r.bytes.local = at::empty(r.bytes.spec.lengths, at::TensorOptions().dtype(at::kByte));
    r.scales.local = at::empty(r.scales.spec.lengths, at::TensorOptions().dtype(at::kFloat));
    detail::load_boxes({r.bytes, r.scales}, dir, tensors, json::object(), /*convert=*/true, "the folder",
                       detail::FileLinks::kFollow);
    const at::Tensor& b = r.bytes.local;
    const at::Tensor& sc = r.scales.local;
    const int64_t bad = sc.numel() - (at::isfinite(sc) & (sc > 0)).sum().item<int64_t>();
    HP_CHECK(bad == 0, "load of '", dir, "': the scales '", r.scale_name, "' (in '", where.at(r.scale_name),
             "') hold ", bad, " value(s) that are 0, negative, infinite or NaN among the ", sc.numel(),
             " this rank read: a block's weights cannot be recovered from them");
    // Each element times its block's scale, in fp32 (the product a reader in PyTorch forms),
    // then cast to the item's dtype.
    const ShardSpec& box = r.bytes.spec;
    int64_t nan = 0;
    dequantize_e4m3fn_blocks_into(b, sc, box.offsets[0], box.offsets[1], *blocks, r.item->local, &nan);
    HP_CHECK(nan == 0, "load of '", dir, "': tensor '", r.name, "' (in '", where.at(r.name), "') holds ", nan,
             " float8 NaN byte(s) (0x7f or 0xff) among the ", b.numel(), " this rank read: the folder's weights are "
             "damaged");
    r.bytes.local = r.scales.local = at::Tensor();
  }
  // A folder from elsewhere may hold damaged weights: a NaN or infinity would only show as
  // a diverged first step, blamed on the learning rate.
  for (const auto& it : items) {
    if (!at::isFloatingType(it.local.scalar_type()) || it.local.numel() == 0) continue;
    const int64_t bad = it.local.numel() - at::isfinite(it.local).sum().item<int64_t>();
    const std::string& name = it.source.empty() ? it.name : it.source;
    HP_CHECK(bad == 0, "load of '", dir, "': tensor '", name, "' (in '", where.at(name), "') holds ", bad,
             bad == 1 ? " value that is" : " values that are", " not finite (NaN or infinity) among the ",
             it.local.numel(), " this rank read: the folder's weights are damaged");
  }
}

}  // namespace hp::ckpt
