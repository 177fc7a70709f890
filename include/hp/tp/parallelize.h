// Tensor and sequence parallelism applied to a module tree by a plan.
//
//   hp::tp::parallelize_module(*model, mesh.group("tp"), {
//       {"tok_emb", RowwiseParallel().output(Shard(1))},
//       {"layers_*.attn_norm", SequenceParallel()},
//       {"layers_*.attn", PrepareModuleInput({Shard(1)}, {Replicate()})},
//       {"layers_*.attn.wq", ColwiseParallel()},
//       {"layers_*.attn.wo", RowwiseParallel().output(Shard(1))},
//       ...});
//
// Each entry's pattern is matched against the dotted names of the submodules (as
// named_modules() gives them: "layers_0.attn.wq"); `*` matches any run of characters
// other than '.', and "" names the root. Every matching entry's style is applied, in plan
// order (a module may get a PrepareModuleInput and a PrepareModuleOutput): the module's parameters are replaced, in place (the same tensors, so optimizers and
// fully_shard built later see them), by this rank's pieces, and hooks are registered at
// the call boundary (hp::call), where the activations are redistributed. Apply tensor
// parallelism before fully_shard; fully_shard then shards each rank's pieces again.
//
// Styles (the local tensors keep their placements implicit; see dtensor.h):
// - ColwiseParallel: Linear weight and bias split on dim 0 (Embedding weight on dim 1).
//   The input (default Replicate; Shard(1) for sequence-sharded input, gathered) is made
//   Replicate with a Partial gradient, so its gradient is all-reduced (or reduce-scattered
//   back to sequence pieces); the output stays split on its last dim unless `output`
//   asks for Replicate. An input made Replicate by an enclosing PrepareModuleInput is used
//   as it is (q, k and v of one attention share one gather and one gradient reduction).
// - RowwiseParallel: Linear weight split on dim 1, bias whole and added once after the
//   reduction; the output is Partial and is all-reduced (Replicate, the default),
//   reduce-scattered on the sequence dim (Shard(1)) or left Partial. Embedding weight split
//   on dim 0 (vocabulary-parallel): ids outside the rank's range give zeros before the
//   reduction.
// - SequenceParallel: the module (a norm, dropout) runs on sequence pieces; its parameters
//   stay whole, and their gradients, Partial over the group, are summed over it before
//   anything reads them (accumulated into .grad already summed). A Dropout's mask is one
//   process's mask of the whole tensor, cut to the rank's piece (CPU tensors; other dropout
//   modules are not supported yet).
// - PrepareModuleInput / PrepareModuleOutput: per tensor argument (by position) or for the
//   output, declare its placement and the one wanted. A tensor made Replicate at a module's
//   input is taken to feed tensor-parallel compute: its gradient arrives Partial.
//
// Errors, raised when the plan is applied: a pattern that matches no module, a style on a
// module type it does not support, a split dim not divisible by the group size (naming the
// module, the parameter, the dim and both sizes), a module parallelized twice. At run
// time: a sequence length not divisible by the group size.
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "hp/tp/dtensor.h"

namespace hp::tp {

struct ColwiseParallel {
  Placement input_layout = Replicate();
  Placement output_layout = Shard(-1);
  // The input is a replicated activation computed inside a region whose entry (a
  // PrepareModuleInput upstream) reduces the gradient: nothing is moved here and the
  // input's gradient leaves Partial (MLA's up-projections after the replicated
  // down-projections, MoE experts on routed rows).
  bool input_prepared = false;
  ColwiseParallel& input(Placement p) { input_layout = p; return *this; }
  ColwiseParallel& output(Placement p) { output_layout = p; return *this; }
  ColwiseParallel& prepared_input() { input_prepared = true; return *this; }
};

struct RowwiseParallel {
  Placement input_layout = Shard(-1);
  Placement output_layout = Replicate();
  RowwiseParallel& input(Placement p) { input_layout = p; return *this; }
  RowwiseParallel& output(Placement p) { output_layout = p; return *this; }
};

struct SequenceParallel {
  int64_t sequence_dim = 1;
  // Shard(sequence_dim): the input arrives in sequence pieces; Replicate: it is sliced here.
  Placement input_layout = Shard(1);
};

// Parameters whole on every rank, used inside a tensor-parallel region where each rank
// computes only a part of their gradient (MLA's down-projections and their norms, the MoE
// router): the gradients are summed over the group, as SequenceParallel's are. Nothing
// is done to activations.
struct ReplicateParallel {};

struct PrepareModuleInput {
  // One entry per argument position; nullopt leaves that argument alone.
  std::vector<c10::optional<Placement>> input_layouts;
  std::vector<c10::optional<Placement>> desired_input_layouts;
  PrepareModuleInput(std::vector<c10::optional<Placement>> in, std::vector<c10::optional<Placement>> desired)
      : input_layouts(std::move(in)), desired_input_layouts(std::move(desired)) {}
};

struct PrepareModuleOutput {
  Placement output_layout;
  Placement desired_output_layout;
  PrepareModuleOutput(Placement out, Placement desired) : output_layout(out), desired_output_layout(desired) {}
};

using ParallelStyle = std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, ReplicateParallel,
                                   PrepareModuleInput, PrepareModuleOutput>;
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

struct ParallelizeOptions {
  // Dtype of the gradient reductions the styles add (the mixed-precision policy's reduce
  // dtype); unset: the gradient's own dtype.
  c10::optional<at::ScalarType> reduce_dtype;
};

// Applies `plan` to `root`'s submodules (see the file comment). Collective only in that
// every rank of `group` must apply the same plan; nothing is communicated here.
void parallelize_module(torch::nn::Module& root, const CommPtr& group, const ParallelizePlan& plan,
                        const ParallelizeOptions& o = {});

// Whether `pattern` (with `*` for any run of non-'.' characters) matches the whole of `name`.
bool match_module_name(const std::string& pattern, const std::string& name);

// Registers a gradient hook on `param` that sums its gradient over `group` before it is
// accumulated: for a parameter whole on every rank whose gradient each rank computes only
// a part of (SequenceParallel's norms, a bias added to sequence pieces).
void sum_gradient_over(const at::Tensor& param, const CommPtr& group, c10::optional<at::ScalarType> reduce_dtype);

// Mean cross-entropy of logits split on their last (vocabulary) dim over `group`, without
// gathering them: the row maximum, the sum of exponentials and the target's logit are each
// reduced over the group (three all-reduces); the backward needs no communication.
// `local_logits` [N, V / size] (any leading dims are flattened), `targets` [N] with ids in
// [0, V), the same on every rank of the group. Computed in float32 (float64 for float64
// logits).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const CommPtr& group);

}  // namespace hp::tp
