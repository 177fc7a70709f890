// What tensor parallelism exchanges over its group for one transformer block, as a pure
// function of the block's shape: the planner sums it (hp-train --plan), and each model's
// tensor-parallel test checks it against what the communicator counts for a block.
//
// A block is two sublayers (attention and the MLP or MoE), each entered through one
// column-parallel input and left through one row-parallel output (parallelize.h's styles):
//   forward   with sequence parallelism 2 all-gathers of the residual stream (each sublayer's
//             input made whole) and 2 reduce-scatters (its output back to sequence pieces);
//             without it 2 all-reduces of the output;
//   backward  the same exchanges of the gradients reversed, and one all-reduce per parameter
//             tensor the block keeps whole whose gradient arrives partial (ModelArgs::
//             tp_summed_params: the norms and row-parallel biases on sequence pieces, MLA's
//             down-projections and the router always).
#pragma once

#include <cstdint>
#include <vector>

#include "hp/comm/simulated_network.h"

namespace hp::tp {

struct BlockShape {
  int tp = 1;
  bool sequence_parallel = false;
  double tokens = 0;          // of one micro-batch, whole sequences
  double row_bytes = 0;       // a token's residual-stream row (the compute dtype)
  int64_t summed_tensors = 0; // parameters whose gradients are summed over the group
  double summed_elements = 0; // ... their elements in all
  double grad_bytes = 4;      // an element of those sums (the reduce dtype)
};

struct BlockCost {
  std::vector<CollectiveCost> forward, backward;
};

// Empty at tp 1; raises for tp < 1.
BlockCost block_traffic(const BlockShape& s);

}  // namespace hp::tp
