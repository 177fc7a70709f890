#include "hp/models/pipeline_slice.h"

#include "hp/core/error.h"

namespace hp::models {

std::vector<PipelineSlice> split_layers(int64_t layers, int stages, const std::vector<int64_t>& counts) {
  HP_CHECK(stages >= 1, "pipeline stages must be at least 1, got ", stages);
  HP_CHECK(stages <= layers, "pipeline of ", stages, " stages over ", layers,
           " layers: each stage needs at least one layer (more stages than layers)");
  std::vector<int64_t> n = counts;
  if (n.empty()) {
    for (int s = 0; s < stages; ++s) n.push_back(layers / stages + (s < layers % stages ? 1 : 0));
  }
  HP_CHECK(static_cast<int>(n.size()) == stages, "pipeline layer counts: ", n.size(), " entries for ", stages,
           " stages");
  int64_t sum = 0;
  for (size_t s = 0; s < n.size(); ++s) {
    HP_CHECK(n[s] >= 1, "pipeline layer counts: stage ", s, " has ", n[s], " layers (each needs at least one)");
    sum += n[s];
  }
  HP_CHECK(sum == layers, "pipeline layer counts sum to ", sum, ", the model has ", layers, " layers");
  std::vector<PipelineSlice> out;
  int64_t first = 0;
  for (int s = 0; s < stages; ++s) {
    out.push_back(PipelineSlice{first, first + n[s], s == 0, s == stages - 1});
    first += n[s];
  }
  return out;
}

int64_t check_slice(const PipelineSlice& sl, int64_t layers) {
  const int64_t end = sl.end_layer < 0 ? layers : sl.end_layer;
  HP_CHECK(sl.first_layer >= 0 && sl.first_layer <= end && end <= layers, "pipeline slice: layers [",
           sl.first_layer, ", ", end, ") are not within the model's ", layers, " layers");
  return end;
}

}  // namespace hp::models
