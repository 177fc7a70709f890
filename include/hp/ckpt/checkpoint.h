// Distributed checkpoints of sharded tensors: every rank writes its own boxes, and a load
// reshards by box intersection into whatever layout the loading job has.
//
// save(items, dir, world): each rank writes `dir`/rank<R>.safetensors with the boxes it
// owns (a box held by several ranks, as HSDP replicas hold theirs, is written once, by one
// of them chosen by the tensor's name so that the bytes spread over the holders); rank 0
// writes `dir`/metadata.json: for every tensor its global shape, dtype, and chunks (file,
// key, offsets, lengths), every file's size and block checksums, the caller's string
// values, and a checksum of the document itself. Collective over `world`.
// Crash-safe: everything goes to `dir`.tmp first, every file is fsynced, and after every
// rank finished rank 0 renames the folder to `dir` (an existing `dir` is replaced only
// then). A folder without metadata.json is not a checkpoint. Every write goes through
// `storage` (hp/ckpt/storage.h), which is told the points of the save as it reaches them; a
// write that fails on any rank (a full disk, a failed fsync) raises on every rank, naming
// it, and leaves an existing `dir` as it was.
//
// load(items, dir): each item's `local` (allocated, the box's shape) is filled from the
// chunks that intersect its spec: each rank reads only those byte ranges, from any saved
// layout (rank counts, shard dims) into any other. Raises naming the tensor for a tensor
// missing from the checkpoint, a global shape or dtype that differs, or a box not covered
// by the saved chunks. metadata.json is untrusted input: its checksum, its schema (types,
// ranges, boxes inside their tensors) and its file names (inside `dir`, no symbolic links)
// are checked first, an error naming the file, the key and the value (docs/ckpt.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "hp/ckpt/storage.h"
#include "hp/comm/communicator.h"
#include "hp/mesh/shard_spec.h"

namespace hp::ckpt {

struct Item {
  std::string name;
  at::Tensor local;  // this rank's box of the tensor (contiguous or not; CPU)
  ShardSpec spec;    // where the box lies in the global tensor
  // load(): the saved tensor to read, when it is not `name` (empty: `name`).
  std::string source = {};
};

// A tensor as the checkpoint's metadata lists it.
struct SavedTensor {
  std::string dtype;  // safetensors' dtype string ("F32", "BF16", ...)
  std::vector<int64_t> shape;
};

void save(const std::vector<Item>& items, const std::string& dir, const CommPtr& world,
          const std::map<std::string, std::string>& values = {}, Storage& storage = *local_storage());

// Fills every item's `local` in place; returns the saved string values. With no items it
// reads the values only (the metadata).
std::map<std::string, std::string> load(const std::vector<Item>& items, const std::string& dir);

// The folder holding the checkpoint committed as `dir`: `dir`, or `dir`.old where a save
// replacing `dir` was killed between setting the old one aside and renaming the new one in
// (load() and saved_tensors() look there by themselves).
std::string committed_dir(const std::string& dir);

// The tensors of the committed checkpoint `dir`, by name (its metadata alone).
std::map<std::string, SavedTensor> saved_tensors(const std::string& dir);

// The format of the committed checkpoint `dir`: 2 (its metadata and data files carry
// checksums, checked on load), or 1 (written before checksums: loaded unchecked).
int format_version(const std::string& dir);
// Rewrites a format-1 checkpoint's metadata.json as format 2, atomically: the data files'
// checksums taken from the files as they are now (damage done before cannot be found; from
// now on it is), and the document's own. Returns what it did ("already format 2" too).
// Raises naming the folder for anything else than a committed checkpoint of format 1 or 2.
std::string upgrade(const std::string& dir, Storage& storage = *local_storage());

// Each item's tensor on the host, as save() takes it: a device tensor copied to the host, a
// host one cloned when `copy` (so that later changes to the live tensor do not reach it) or
// left as it is.
void to_host(std::vector<Item>& items, bool copy);

// A state a checkpoint is made of and restored into (hp::train::Trainer is one; a
// train::CheckpointManager saves any): its tensors as items, the string values beside
// them, and a load of both.
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  struct State {
    std::vector<Item> items;  // aliasing the live tensors, on whatever device they are
    std::map<std::string, std::string> values;
  };
  // The steps trained: a checkpoint manager names the checkpoint after them.
  virtual int64_t steps_done() const = 0;
  // This rank's part of the state as it is now.
  virtual State checkpoint_state() const = 0;
  // Restores the state from the committed checkpoint `dir`, saved from a State of the same
  // names (in any layout). Collective where save() is.
  virtual void load_checkpoint(const std::string& dir) = 0;
};

}  // namespace hp::ckpt
