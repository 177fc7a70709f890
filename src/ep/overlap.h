// Inside the ep layer: the chunked, overlapped exchange behind InFlight.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "hp/comm/communicator.h"
#include "hp/ep/dispatch.h"

namespace hp::ep {

// Issues the row all-to-alls of `sent` ([rows, dim], expert-major: every rank's experts in
// turn, as the sort leaves them) in `chunks` chunks of each rank's `local_experts`:
// send_counts [ranks * local_experts] rows of this rank per expert, recv_counts the same
// received from each rank (rank-major). `group` null: one rank, the rows move by a copy.
// p[inverse(p)[i]] = i for a permutation p of [0, n).
at::Tensor inverse_permutation(const at::Tensor& p);

InFlight launch_chunks(const at::Tensor& sent, const CommPtr& group, const at::Tensor& send_counts,
                       const at::Tensor& recv_counts, int64_t local_experts, int chunks);

}  // namespace hp::ep
