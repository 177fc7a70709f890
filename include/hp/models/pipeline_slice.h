// The part of a model one pipeline stage holds, and a model's layers split over stages:
// what every model family builds from (models/family.h) and what the pipeline places
// (pp/pipeline.h), independent of any one family.
#pragma once

#include <cstdint>
#include <vector>

namespace hp::models {

// The part of a model one pipeline stage holds (hp/pp/pipeline.h): the embedding on the
// first stage, blocks [first_layer, end_layer) under their global names (so initialization
// and checkpoints are those of the whole model), the final norm and the output head on the
// last. The default is the whole model. A stage without the embedding takes the previous
// stage's hidden states [B, T, dim] (under sequence parallelism its sequence piece); a
// stage without the head returns them.
struct PipelineSlice {
  int64_t first_layer = 0;
  int64_t end_layer = -1;  // -1: through the last layer
  bool embedding = true;
  bool head = true;

  bool whole(int64_t layers) const { return first_layer == 0 && (end_layer < 0 || end_layer == layers) && embedding && head; }
};

// The layers of `layers` split over `stages` pipeline stages: `counts` (one entry per stage,
// each at least 1, summing to `layers`) when given, else as evenly as possible (the earlier
// stages take the remainder). Raises naming the values for more stages than layers or
// counts that do not fit.
std::vector<PipelineSlice> split_layers(int64_t layers, int stages, const std::vector<int64_t>& counts = {});
// The slice's end layer (resolving -1); raises naming the values for a slice outside the model.
int64_t check_slice(const PipelineSlice& slice, int64_t layers);

}  // namespace hp::models
