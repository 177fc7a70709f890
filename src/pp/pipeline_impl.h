// Pipeline's implementation (hp/pp/pipeline.h): its state per step and the actions it runs;
// pipeline.cpp (the step, transfers, shape check, evaluation) and pipeline_compute.cpp (F,
// B, I and W, and the recording W runs back from).
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "hp/pp/pipeline.h"

namespace hp {
class FSDPModule;
}
namespace torch::autograd {
struct Node;
}

namespace hp::pp {

// Ends any recording of module outputs on this thread (after a forward that failed part
// way); pipeline_compute.cpp.
void stop_recording();

// One output W starts from (the implementation's): the module or mark that made it, the
// parameters it reaches.
struct RecordedOutput {
  const void* key;  // the module (or the first marked parameter's tensor): recorded once per forward
  std::string what;
  std::vector<at::Tensor> params;
  at::Tensor output;
};
using Recorded = std::vector<RecordedOutput>;

class Pipeline::Impl {
 public:
  Impl(const Schedule& schedule, std::vector<PipelineStage> stages, CommPtr group, PipelineLoss loss,
       const PipelineOptions& options);
  ~Impl();
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);
  at::Tensor evaluate(const at::Tensor& inputs, const at::Tensor& targets);
  bool holds_stage(int stage) const;

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
  // A paired forward `f` and the backward `b` right after it, as PipelineOptions says.
  void run_pair(const Action& f, const Action& b, const std::vector<at::Tensor>& inputs,
                const std::vector<at::Tensor>& targets);
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
  PipelineOptions options_;
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
