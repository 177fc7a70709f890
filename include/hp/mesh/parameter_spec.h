// Parameters that hold a piece of a larger tensor (tensor parallel's shards) carry the spec
// of their box in the global tensor. Tensor parallelism records it when it splits a
// parameter; initialization by name (models::parameter_initializer), fully_shard's
// state_dict (the nested spec: the piece split again over dp_shard) and checkpoints read it.
// Keyed by the parameter's identity (its TensorImpl, which set_data and fully_shard keep);
// an entry goes away with its parameter. Thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "hp/mesh/shard_spec.h"

namespace hp {

void set_parameter_spec(const at::Tensor& param, ShardSpec spec);
// nullopt when `param` is not a registered piece.
c10::optional<ShardSpec> parameter_spec(const at::Tensor& param);

}  // namespace hp
