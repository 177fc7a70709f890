// Pipeline parallel runtime: runs a schedule (hp/pp/schedule.h) on this rank's stages,
// moving activations and their gradients between the ranks of the pp group.
//
//   auto slices = hp::models::split_layers(cfg.layers, pp);            // or explicit counts
//   hp::models::DeepSeek stage(cfg, slices[pp_rank]);                   // this rank's part
//   ... parallelize / fully_shard the stage as a whole model ...
//   hp::pp::Pipeline pipe(hp::pp::one_f_one_b(pp, m),
//                         {{pp_rank, [&](const at::Tensor& x) { return hp::call(stage, x); }, stage.ptr().get()}},
//                         mesh->group("pp"), loss_fn);
//   at::Tensor loss = pipe.step(tokens, targets);   // forward and backward of m micro-batches
//   optimizer.step();
//
// Communication: each ordered pair of neighbouring pp ranks has its own communicator (split
// from the pp group), on which one only sends and the other only receives. The schedule is
// lowered (hp::pp::lower) so that on every link the receives are posted in the order the
// sends go, early enough that the order completes even when every send waits for its
// receive. Posting never blocks the rank; a received tensor is waited for only by the compute
// action that reads it, and the sends at the end of the step. The
// shape and dtype of each stage's input are sent ahead of micro-batch 0's activation every
// step (one small message per stage boundary); the other micro-batches reuse them. A
// received activation lives until its backward has run; a gradient until it was used.
//
// fully_shard inside a stage: when any stage of the pipeline holds fully_shard'ed modules
// (the stage's module or modules inside it), the schedule gets UNSHARD, REDUCE_GRAD and
// RESHARD per stage: the parameters are gathered once per step, stay gathered across the
// micro-batches, the gradients accumulate unreduced and are reduce-scattered once, after
// the stage's last backward.
//
// Loss scaling: each micro-batch's loss is divided by the micro-batch count, so the
// gradients are those of the mean loss over the step's batch (micro-batches of equal size),
// as one process computing the loss of the whole batch gets them.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

struct PipelineStage {
  int stage = 0;
  // The stage's computation: the first stage gets a micro-batch of the step's inputs, every
  // other the previous stage's output (one tensor).
  std::function<at::Tensor(const at::Tensor&)> forward;
  // The module holding the stage's parameters, or null: the fully_shard handles on it and
  // inside it get the schedule's UNSHARD, REDUCE_GRAD and RESHARD.
  torch::nn::Module* module = nullptr;
  // Optional, on the last stage: given each micro-batch's targets just before its forward
  // (a model whose training forward reads them: DeepSeek-V3's multi-token prediction).
  std::function<void(const at::Tensor& targets)> targets;
};

// How a paired forward and backward ("0F3+ 1B1", DualPipeV's F&B) run.
struct PipelineOptions {
  // true: as one unit taking turns (hp::take_turns, hp/core/turns.h): both inputs awaited
  // first, the forward on this thread and the backward on a helper thread, one running at a
  // time, each handing the turn to the other where it waits for an expert all-to-all it has
  // issued (hp::yield_turn in hp/ep), so one computes while the other's exchange travels;
  // the pair's sends go after both. false: one after the other. The results are bitwise the
  // same either way: each runs the same operations in the same order, and only one runs at a
  // time. lower() keeps a pair adjacent (its receives before it, its sends after it) and
  // validate() replays it as one unit, so the order is checked as it runs.
  bool pairs_take_turns = true;
};

// The last stage's loss of one micro-batch: (its output, its targets) -> a scalar mean.
using PipelineLoss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

// Under a schedule with split backwards (I, W), W computes weight gradients from the outputs
// of the modules that own them (called through hp::call), recorded during forward, and from
// the outputs a stage marks with hp::mark_weight_output (hooks/call.h: parameters used
// outside their module's call, as a tied output head uses the embedding's weight).

class Pipeline {
 public:
  // `schedule`: the whole pipeline's (every rank's list; lowered here when it is not); this
  // rank runs list group->rank(). `stages`: every stage the schedule places on this rank,
  // once each. A collective over `group` (whether any rank has fully_shard'ed stages).
  // Raises hp::Error for a schedule whose ranks differ from the group's size, stages not
  // matching the schedule, a missing loss on the last stage's rank, and a stage without a
  // module under a schedule with split backwards.
  Pipeline(const Schedule& schedule, std::vector<PipelineStage> stages, CommPtr group, PipelineLoss loss,
           const PipelineOptions& options = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One step's forwards and backwards: `inputs` and `targets` are the step's batch, split on
  // dim 0 into schedule.microbatches equal micro-batches (an error naming the sizes when
  // they do not divide). The first stage's rank reads inputs, the last stage's targets;
  // other ranks may pass undefined tensors. Returns the mean loss over the micro-batches on
  // the rank holding the last stage, an undefined tensor elsewhere. Gradients are left
  // where the stages' parameters hold them (.grad; under fully_shard the reduced shards).
  // The first step begins with a shape check: micro-batch 0 through every stage without
  // gradients (later stages on zeros of the shape the stage before produced, the last one
  // also through the loss), so a stage that does not fit the one before it raises on every
  // rank before any transfer (the failing rank's error names the shapes). The generator
  // and the stage modules' buffers are restored after it; a stage given without a module
  // must not change state in its forward.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);

  // The mean loss of a batch split as step() splits it, forwards only, without gradients (a
  // validation loss): each rank runs its stages in stage order, all micro-batches of one
  // stage before the next, the activations moving on the same links as step()'s; a
  // fully_shard'ed stage is gathered once for its micro-batches and resharded after them.
  // Every wait is for a stage-micro-batch earlier in (stage, micro-batch) order, in which
  // every rank runs its own and every link carries its messages, so the order completes.
  // Gradients and the optimizer's inputs are left as they are; the stages must not change
  // state in a forward without grad mode. Returns what step() returns (the mean on the last
  // stage's rank). The first call of either runs step()'s shape check first.
  at::Tensor evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  const Schedule& schedule() const;
  bool holds_stage(int stage) const;
  int rank() const;

  class Impl;  // src/pp/pipeline_impl.h

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hp::pp
