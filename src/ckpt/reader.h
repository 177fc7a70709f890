// The checkpoint layer's box reader, shared by load() (hyperparallel checkpoints) and the
// consolidated-folder import (hp/ckpt/consolidated.h).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "hp/ckpt/checkpoint.h"
#include "hp/comm/agree.h"

namespace hp::ckpt::detail {

// Fills every item's `local` from the saved tensor `item.source` (or `item.name`) of the
// catalog `tensors` ({name: {"dtype", "shape", "chunks": [{"file", "key", "offsets",
// "lengths"}]}}), files relative to `dir`; `files` ({file: {"bytes", "block",
// "checksums"}}) verifies the blocks it lists. `convert`: a saved dtype other than the
// item's is cast (else an error). `source` names the kind of folder in errors.
void load_boxes(const std::vector<Item>& items, const std::string& dir, const nlohmann::json& tensors,
                const nlohmann::json& files, bool convert, const std::string& source);

// `dir`/metadata.json, checked to be a hyperparallel checkpoint's.
nlohmann::json read_metadata(const std::string& dir);

}  // namespace hp::ckpt::detail
