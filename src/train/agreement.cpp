// Whether every rank of a run resolved the same config (or was given the same flags).
#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <sstream>

#include "hp/comm/agree.h"
#include "hp/core/hash.h"
#include "hp/train/config.h"

namespace hp::train {

std::string settings_mismatch(const CommPtr& world, const std::vector<std::pair<std::string, std::string>>& mine,
                              const std::string& what, const std::string& remedy) {
  std::string text;
  for (const auto& [k, v] : mine) text += k + "=" + v + "\n";
  // One hash compared first: the whole text goes round only when some rank differs.
  const at::Tensor h = at::full({1}, static_cast<int64_t>(fnv1a(text) >> 1), at::kLong);
  if (all_ranks_equal(world, h)) return "";
  const auto on = at::TensorOptions().device(control_device(world));
  at::Tensor len = at::full({1}, static_cast<int64_t>(text.size()), on.dtype(at::kLong));
  world->broadcast(len, 0).wait();
  at::Tensor bytes = at::zeros({len.item<int64_t>()}, at::kByte);
  if (world->rank() == 0 && !text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  bytes = bytes.to(on.device());
  world->broadcast(bytes, 0).wait();
  bytes = bytes.cpu();
  std::istringstream theirs(std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel()));
  std::map<std::string, std::string> on0;
  for (std::string line; std::getline(theirs, line);) {
    auto eq = line.find('=');
    if (eq != std::string::npos) on0[line.substr(0, eq)] = line.substr(eq + 1);
  }
  for (const auto& [k, v] : mine) {
    auto it = on0.find(k);
    const std::string other = it == on0.end() ? "(not set)" : it->second;
    if (other != v) {
      return "the ranks were started with different " + what + ": " + k + "=" + v + " on rank " +
             std::to_string(world->rank()) + " but " + k + "=" + other + " on rank 0; " + remedy;
    }
  }
  return "";
}

}  // namespace hp::train
