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
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/pp/schedule.h"

namespace hp {
class FSDPModule;
}
namespace torch::autograd {
struct Node;
}

namespace hp::pp {

struct PipelineStage {
  int stage = 0;
  // The stage's computation: the first stage gets a micro-batch of the step's inputs, every
  // other the previous stage's output (one tensor).
  std::function<at::Tensor(const at::Tensor&)> forward;
  // The module holding the stage's parameters, or null: the fully_shard handles on it and
  // inside it get the schedule's UNSHARD, REDUCE_GRAD and RESHARD.
  torch::nn::Module* module = nullptr;
};

// The last stage's loss of one micro-batch: (its output, its targets) -> a scalar mean.
using PipelineLoss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

// Under a schedule with split backwards (I, W), W computes weight gradients from the outputs
// of the modules that own them (called through hp::call), recorded during forward. A stage
// that uses parameters outside their module's call (a tied output head multiplying by the
// embedding's weight) marks the result here: `output` is computed from `params` (and W runs
// back from it to them). Outside such a forward it does nothing.
void mark_weight_output(const at::Tensor& output, std::vector<at::Tensor> params);

// One output W starts from (the implementation's): the module or mark that made it, the
// parameters it reaches.
struct RecordedOutput {
  const void* key;  // the module (or the first marked parameter's tensor): recorded once per forward
  std::string what;
  std::vector<at::Tensor> params;
  at::Tensor output;
};
using Recorded = std::vector<RecordedOutput>;

class Pipeline {
 public:
  // `schedule`: the whole pipeline's (every rank's list; lowered here when it is not); this
  // rank runs list group->rank(). `stages`: every stage the schedule places on this rank,
  // once each. A collective over `group` (whether any rank has fully_shard'ed stages).
  // Raises hp::Error for a schedule whose ranks differ from the group's size, stages not
  // matching the schedule, a missing loss on the last stage's rank, and a stage without a
  // module under a schedule with split backwards.
  Pipeline(const Schedule& schedule, std::vector<PipelineStage> stages, CommPtr group, PipelineLoss loss);
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

  const Schedule& schedule() const { return schedule_; }
  bool holds_stage(int stage) const;
  int rank() const { return rank_; }

 private:
  using Key = std::pair<int, int>;  // stage, micro-batch
  struct Meta {
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> shape;
    bool failed = false;  // the shape check's: the stage before failed
  };
  static Meta decode_header(const at::Tensor& h);
  // Splits a step's inputs and targets into the micro-batches (checked) and runs the shape
  // check the first time.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> micro_batches(const at::Tensor& inputs,
                                                                            const at::Tensor& targets,
                                                                            const char* caller);
  // Clears what a failed step or evaluation left and marks the pipeline broken.
  void abandon();
  void check_shapes(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  void run_compute(const Action& a, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  void run_forward(const Action& a, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets);
  void run_backward(const Action& a);
  void run_weight_backward(const Action& a);
  // I's gradients of `input` (null: none) and of the recorded module outputs, from `out`
  // (`grad_out` undefined: the last stage's loss).
  void input_backward(const Key& k, const at::Tensor& out, const at::Tensor& grad_out, at::Tensor* input);
  void run_transfer(const Action& a);
  // Split backwards: records the output of every module of a stage owning trainable
  // parameters (called through hp::call) during forwards.
  void watch_weights(torch::nn::Module& m);
  void run_fsdp(const Action& a);
  // Waits for the receive of `k` when it is still in flight (and makes a received
  // activation a leaf that requires grad).
  void await(std::map<Key, std::shared_ptr<Work>>& pending, const Key& k, bool make_leaf);
  PipelineStage& stage(int s);

  Schedule schedule_;
  std::vector<PipelineStage> stages_;
  CommPtr group_;
  PipelineLoss loss_;
  int rank_ = 0;
  std::map<int, CommPtr> send_link_, recv_link_;  // per neighbouring pp rank
  bool split_ = false;                             // the schedule has I and W
  bool broken_ = false;                            // a step failed part way
  bool shapes_checked_ = false;                    // check_shapes passed (at the first step)
  c10::Device device_ = c10::kCPU;                 // of the stages' parameters: received activations
  at::TensorOptions control_;                      // where headers and control values live
  std::vector<uint64_t> hooks_;                    // forward hooks of watch_weights
  // What W needs of one recorded module output: where its gradient enters the graph (not
  // the output itself, whose values W does not read) and that gradient.
  struct WeightGrad {
    std::vector<at::Tensor> params;  // what W computes the gradients of
    std::shared_ptr<torch::autograd::Node> fn;
    uint32_t output_nr = 0;
    at::Tensor grad;
  };
  void release_for_weights(const std::vector<WeightGrad>& pending);
  std::map<int, std::vector<std::shared_ptr<FSDPModule>>> fsdp_;  // per stage

  // Per step.
  std::map<Key, at::Tensor> input_;        // a stage's input (a leaf requiring grad past stage 0)
  std::map<Key, at::Tensor> output_;       // a stage's output (the last stage: its scaled loss)
  std::map<Key, at::Tensor> grad_output_;  // the gradient of a stage's output
  std::map<Key, Recorded> module_outputs_;  // split: outputs of parameter-owning modules
  std::map<Key, std::vector<WeightGrad>> weight_grads_;  // split: from I, for W
  std::map<int, Meta> input_meta_;         // per receiving stage, from its first receive's header
  std::set<int> header_sent_;              // sending stages whose header went this step
  std::map<Key, std::shared_ptr<Work>> pending_input_, pending_grad_;  // receives in flight
  std::vector<Work> sends_;
  at::Tensor loss_sum_;
};

}  // namespace hp::pp
