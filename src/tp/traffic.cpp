#include "hp/tp/traffic.h"

#include "hp/core/error.h"

namespace hp::tp {

BlockCost block_traffic(const BlockShape& s) {
  HP_CHECK(s.tp >= 1, "tp::block_traffic: tp=", s.tp, " must be positive");
  BlockCost c;
  if (s.tp == 1) return c;
  const double stream = s.tokens * s.row_bytes;
  if (s.sequence_parallel) {
    c.forward = {{CommOp::kAllGather, stream, s.tp, 2}, {CommOp::kReduceScatter, stream, s.tp, 2}};
  } else {
    c.forward = {{CommOp::kAllReduce, stream, s.tp, 2}};
  }
  c.backward = c.forward;
  if (s.summed_tensors > 0) {
    const double per = s.summed_elements / static_cast<double>(s.summed_tensors) * s.grad_bytes;
    c.backward.push_back({CommOp::kAllReduce, per, s.tp, static_cast<double>(s.summed_tensors)});
  }
  return c;
}

}  // namespace hp::tp
