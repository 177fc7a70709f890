// Consolidated checkpoints in the Hugging Face layout: whole tensors (not shards) under the
// model's public names, in safetensors files `model-0000k-of-0000n.safetensors` of at most
// `max_shard_bytes` each (a tensor larger than that gets a file of its own), with the index
// `model.safetensors.index.json` ({"metadata": {"total_size": bytes of all tensors},
// "weight_map": {tensor: file}}) and whatever files the model adds (its config.json).
//
// The model-specific part (which tensor is called what, the config file) belongs to the
// model (hp/models/llama.h's hf_* functions); this layer moves the bytes.
#pragma once

#include <c10/util/Optional.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "hp/ckpt/checkpoint.h"

namespace hp::ckpt {

struct ExportOptions {
  int64_t max_shard_bytes = 5'000'000'000;  // Hugging Face's default file size ("5GB")
  c10::optional<at::ScalarType> dtype;      // unset: each tensor's dtype in the checkpoint
  // Tensors (by their name in the checkpoint) written in their own dtype whatever `dtype`
  // says: buffers such as DeepSeek's balancing bias, kept in fp32 as their readers expect.
  std::set<std::string> keep_dtype;
  // Written as FP8 (hp/ckpt/float8.h), by the name in the checkpoint: float8_e4m3fn bytes and
  // an fp32 `<name>_scale_inv` of one scale per 128 x 128 block (the block's largest
  // magnitude / 448; 1 for a block of zeros), beside it in the same file. 2-D tensors only.
  std::set<std::string> float8_names;
  bool float8 = false;  // export_hf: float8_names are the model's projections (Hugging Face names *proj.weight)
};

// Writes the tensors `tensors` (pairs: the name in the committed checkpoint `ckpt_dir`, the
// name to write it under) to the new folder `out_dir` in the layout above, in the order
// given, plus `extra_files` (file name -> contents). Collective over `world`: file k is
// written by rank k % size, which reads only that file's tensors from the checkpoint (from
// whatever layout it was saved in) and holds one file's tensors at a time: no rank holds
// the whole model. Crash-safe like save(): written to `out_dir`.tmp, renamed when every rank
// finished. Raises (on every rank) for an `out_dir` that already exists (nothing of the
// user's is replaced), a tensor the checkpoint lacks, or a failed write.
void export_consolidated(const std::string& ckpt_dir, const std::vector<std::pair<std::string, std::string>>& tensors,
                         const std::string& out_dir, const CommPtr& world, const ExportOptions& options = {},
                         const std::map<std::string, std::string>& extra_files = {});

// Fills each item's box (any sharding) from the consolidated folder `dir` (its index, or a
// single `model.safetensors`), reading only the byte ranges the box covers: `item.source`
// (or `item.name`) names the tensor in the folder. A saved dtype other than the item's is
// cast. Raises naming the tensor and the file for a tensor the folder lacks, a shape that
// differs, or a broken file (header, offsets, truncation).
void load_consolidated(const std::vector<Item>& items, const std::string& dir);

// The tensors of the consolidated folder `dir`: name -> the file holding it, from its index,
// or every tensor of a single `model.safetensors`. Raises naming the file for a folder with
// neither or an index that is not one.
std::map<std::string, std::string> consolidated_tensors(const std::string& dir);

}  // namespace hp::ckpt
