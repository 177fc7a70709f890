#include "collectives.h"

#include <algorithm>

namespace hp::detail {

OwnedBuffer fused_gather_input(const std::vector<at::Tensor>& padded_shards, const FusedLayout& layout,
                               at::ScalarType dt) {
  const c10::Device dev = padded_shards.empty() ? c10::Device(c10::kCPU) : padded_shards[0].device();
  OwnedBuffer in = OwnedBuffer::zeros({layout.total}, dt, dev);
  for (size_t i = 0; i < padded_shards.size(); ++i) {
    const at::Tensor flat = padded_shards[i].reshape({-1});
    in.tensor().narrow(0, layout.offsets[i], flat.numel()).copy_(flat);
  }
  return in;
}

void copy_out_gathered(const at::Tensor& gathered, const std::vector<int64_t>& offsets,
                       const std::vector<at::Tensor>& dests) {
  for (size_t i = 0; i < dests.size(); ++i) dests[i].copy_(gathered.narrow(1, offsets[i], dests[i].size(1)));
}

void scatter_padded(const at::Tensor& dst, const at::Tensor& flat) {
  const int64_t len = dst.size(1), numel = flat.numel();
  for (int64_t j = 0; j * len < numel; ++j) {
    int64_t n = std::min(len, numel - j * len);
    dst[j].narrow(0, 0, n).copy_(flat.narrow(0, j * len, n));
  }
}

}  // namespace hp::detail
