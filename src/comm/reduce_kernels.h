// Private: elementwise reduction kernels used by the transports' own reduce algorithms.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "hp/comm/communicator.h"

namespace hp::detail {

// out[i] = op(a[i], b[i]) for i < n; out may alias a or b. op is SUM, MAX or MIN.
// bfloat16 and float16 compute in float32 and round to nearest-even. For bool (0/1
// bytes) MAX / MIN are or / and. NaN propagates through MAX and MIN.
// `streaming`: out is written past the caches (non-temporal stores) where the kernel can
// (float32 and bfloat16 SUM with AVX2): for outputs far larger than the caches, whose
// lines would only be read in to be overwritten.
void reduce_kernel(void* out, const void* a, const void* b, int64_t n, at::ScalarType dtype,
                   ReduceOp op, bool streaming = false);

// Round-to-nearest-even float32 -> bfloat16 bits, and back (exact).
uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(uint16_t b);

}  // namespace hp::detail
