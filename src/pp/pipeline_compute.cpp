// The pipeline's compute actions: F, B, and the split backward's I and W, with the recording
// of parameter-owning modules' outputs during a forward that W runs back from.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <map>
#include <set>

#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/core/turns.h"
#include "hp/hooks/call.h"
#include "hp/pp/pipeline.h"
#include "pipeline_impl.h"

namespace hp::pp {
namespace {

// The recording of the forward running on this thread under a split schedule, or null.
thread_local Recorded* t_recording = nullptr;

// hp::mark_weight_output's observer while a forward records.
void record_weight_output(const at::Tensor& output, std::vector<at::Tensor> params) {
  if (t_recording == nullptr || !output.requires_grad()) return;
  std::vector<at::Tensor> trained;
  for (auto& p : params) {
    if (p.requires_grad()) trained.push_back(std::move(p));
  }
  if (trained.empty()) return;
  const void* key = trained[0].unsafeGetTensorImpl();
  t_recording->push_back({key, "a marked weight output", std::move(trained), output});
}

// Records this thread's module outputs (and marked ones) into `r` until stop_recording.
void start_recording(Recorded* r) {
  t_recording = r;
  hp::detail::set_weight_output_observer(&record_weight_output);
}

}  // namespace

void stop_recording() {
  t_recording = nullptr;
  hp::detail::set_weight_output_observer(nullptr);
}

void Pipeline::Impl::watch_weights(torch::nn::Module& m) {
  std::vector<at::Tensor> own;
  for (const auto& p : m.parameters(/*recurse=*/false)) {
    if (p.requires_grad()) own.push_back(p);
  }
  if (own.empty()) return;
  torch::nn::Module* mp = &m;
  ForwardHooks h;
  h.cast_output = [mp, own](torch::nn::Module&, const at::Tensor& out) {
    if (t_recording != nullptr && out.requires_grad()) t_recording->push_back({mp, describe_module(*mp), own, out});
    return out;
  };
  hooks_.push_back(register_forward_hooks(m, std::move(h)));
}

void Pipeline::Impl::run_compute(const Action& a, const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& targets) {
  const Key k{a.stage, a.microbatch};
  // What this action reads, if it is still being received (outside the compute spans).
  if (a.kind == ActionKind::kForward) {
    await(pending_input_, k, /*make_leaf=*/true);
    run_forward(a, inputs, targets);
    return;
  }
  await(pending_grad_, k, /*make_leaf=*/false);
  if (a.kind == ActionKind::kBackwardWeight) {
    run_weight_backward(a);
  } else {
    run_backward(a);
  }
}

void Pipeline::Impl::run_pair(const Action& f, const Action& b, const std::vector<at::Tensor>& inputs,
                              const std::vector<at::Tensor>& targets) {
  if (!options_.pairs_take_turns) {
    run_compute(f, inputs, targets);
    run_compute(b, inputs, targets);
    return;
  }
  // Both inputs first (the unit starts once both are there, as validate() replays it), so
  // neither waits on a transfer while the other holds the turn.
  await(pending_input_, Key{f.stage, f.microbatch}, /*make_leaf=*/true);
  await(pending_grad_, Key{b.stage, b.microbatch}, /*make_leaf=*/false);
  take_turns([&] { run_compute(f, inputs, targets); }, [&] { run_compute(b, inputs, targets); });
}

void Pipeline::Impl::run_forward(const Action& a, const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& targets) {
  const Key k{a.stage, a.microbatch};
  const int last = schedule_.stages - 1;
  trace::Span span("pp forward " + a.to_string(), "compute");
  at::Tensor in;
  if (a.stage == 0) {
    in = inputs[static_cast<size_t>(a.microbatch)];
  } else {
    auto it = input_.find(k);
    HP_INTERNAL_ASSERT(it != input_.end(), "no input for ", a.to_string());
    in = it->second;
  }
  if (a.stage == 0) input_[k] = in;
  at::Tensor out;
  try {
    if (split_) start_recording(&module_outputs_[k]);
    if (a.stage == last && stage(a.stage).targets) stage(a.stage).targets(targets[static_cast<size_t>(a.microbatch)]);
    out = stage(a.stage).forward(in);
    stop_recording();
  } catch (const std::exception& e) {
    stop_recording();
    // Name the stage and what it was given: a stage whose input does not fit (the
    // previous stage's output shape) fails here.
    throw Error(detail::str_cat("Pipeline: stage ", a.stage, "'s forward of micro-batch ", a.microbatch,
                                " failed on its input of shape ", in.sizes(), " (", in.scalar_type(), ")",
                                a.stage > 0 ? detail::str_cat(", stage ", a.stage - 1, "'s output") : std::string(),
                                ": ", e.what()));
  }
  if (a.stage == last) {
    at::Tensor l = loss_(out, targets[static_cast<size_t>(a.microbatch)]) / schedule_.microbatches;
    HP_CHECK(l.numel() == 1, "Pipeline: the loss of ", a.to_string(), " has ", l.numel(), " elements, not one");
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + l.detach() : l.detach();
    out = l;
  } else if (a.stage + 1 <= last && holds_stage(a.stage + 1)) {
    input_[Key{a.stage + 1, a.microbatch}] = out.detach().requires_grad_(out.requires_grad());
  }
  output_[k] = out;
}

// W: the weight gradients, from each recorded module output and the gradient the input
// backward left on it, down to that module's own parameters only.
void Pipeline::Impl::run_weight_backward(const Action& a) {
  const Key k{a.stage, a.microbatch};
  trace::Span span("pp backward " + a.to_string(), "compute");
  auto it = weight_grads_.find(k);
  HP_INTERNAL_ASSERT(it != weight_grads_.end(), "no input backward before ", a.to_string());
  for (auto& w : it->second) {
    torch::autograd::edge_list own;  // the parameters, as backward(inputs=...) names them
    for (const auto& p : w.params) own.emplace_back(torch::autograd::impl::grad_accumulator(p), 0);
    torch::autograd::Engine::get_default_engine().execute({torch::autograd::Edge(w.fn, w.output_nr)}, {w.grad},
                                                          /*keep_graph=*/true, /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, own);
  }
  weight_grads_.erase(it);
}

// I: the gradients of the stage's input and of every recorded module output, not of any
// parameter (autograd skips the weight halves of the nodes); the graph is kept for W, which
// finds in weight_grads_ where each module's gradient enters it.
void Pipeline::Impl::input_backward(const Key& k, const at::Tensor& out, const at::Tensor& grad_out, at::Tensor* input) {
  std::vector<at::Tensor> wrt;
  const bool has_input = input != nullptr && input->requires_grad();
  if (has_input) wrt.push_back(*input);
  auto rec = module_outputs_.find(k);
  if (rec != module_outputs_.end()) {
    std::set<const void*> seen;
    for (const auto& r : rec->second) {
      // W runs back from each output to the module's weights: from a second call's output
      // that path would run through the first call too and count it twice.
      HP_CHECK(seen.insert(r.key).second, "Pipeline: ", r.what, " ran more than once in stage ", k.first,
               "'s forward; a split backward (I, W) of a module called twice is not supported yet");
      wrt.push_back(r.output);
    }
  }
  std::vector<at::Tensor> grads;
  if (!wrt.empty()) {
    grads = torch::autograd::grad({out}, wrt, grad_out.defined() ? std::vector<at::Tensor>{grad_out} : std::vector<at::Tensor>{},
                                  /*retain_graph=*/true, /*create_graph=*/false, /*allow_unused=*/true);
  }
  size_t j = 0;
  if (has_input) input->mutable_grad() = grads[j++];
  auto& pending = weight_grads_[k];
  if (rec != module_outputs_.end()) {
    for (const auto& r : rec->second) {
      if (grads[j].defined()) {
        const at::Tensor& y = r.output;
        auto fn = y.grad_fn() ? y.grad_fn() : torch::autograd::impl::grad_accumulator(y);
        pending.push_back({r.params, fn, static_cast<uint32_t>(y.output_nr()), grads[j]});
      }
      ++j;
    }
  }
  release_for_weights(pending);
}

// B (a full backward) or I (the input gradient only, keeping what the weight gradients need),
// then the input's gradient handed to the stage before when this rank holds it.
void Pipeline::Impl::run_backward(const Action& a) {
  const Key k{a.stage, a.microbatch};
  const int last = schedule_.stages - 1;
  trace::Span span("pp backward " + a.to_string(), "compute");
  auto out = output_.find(k);
  HP_INTERNAL_ASSERT(out != output_.end(), "no output for ", a.to_string());
  auto in = input_.find(k);
  at::Tensor grad_out;
  if (a.stage != last) {
    auto g = grad_output_.find(k);
    HP_INTERNAL_ASSERT(g != grad_output_.end(), "no output gradient for ", a.to_string());
    grad_out = g->second;
    grad_output_.erase(g);
  }
  if (a.kind == ActionKind::kBackward) {
    if (a.stage == last) {
      torch::autograd::backward({out->second});
    } else if (out->second.requires_grad()) {
      torch::autograd::backward({out->second}, {grad_out});
    }
  } else if (!out->second.requires_grad()) {
    weight_grads_[k];  // nothing for W to do
  } else {
    input_backward(k, out->second, grad_out, in != input_.end() ? &in->second : nullptr);
  }
  module_outputs_.erase(k);
  output_.erase(out);
  if (in != input_.end()) {
    if (a.stage > 0 && holds_stage(a.stage - 1)) {
      at::Tensor g = in->second.grad();
      grad_output_[Key{a.stage - 1, a.microbatch}] = g.defined() ? g : at::zeros_like(in->second);
    } else if (a.stage > 0) {
      return;  // SEND_B reads the gradient, then drops the input
    }
    input_.erase(in);
  }
}

// After I, the graph is kept only for W, which runs back from each recorded module output to
// that module's own parameters: the nodes on those paths are all W executes. Every other node
// still reachable from the outputs (attention's softmax, the norms, the activations between
// modules) has its saved tensors released now rather than when W ends.
void Pipeline::Impl::release_for_weights(const std::vector<WeightGrad>& pending) {
  using Node = torch::autograd::Node;
  std::set<Node*> needed, all;
  for (const auto& w : pending) {
    std::set<Node*> targets;
    for (const auto& p : w.params) targets.insert(torch::autograd::impl::grad_accumulator(p).get());
    // Whether a node reaches one of the module's parameters, memoized; every node met.
    std::map<Node*, bool> reaches;
    std::function<bool(Node*)> visit = [&](Node* n) -> bool {
      auto it = reaches.find(n);
      if (it != reaches.end()) return it->second;
      reaches[n] = false;  // a graph has no cycles; this only guards the recursion
      all.insert(n);
      bool r = targets.count(n) > 0;
      for (const auto& e : n->next_edges()) {
        if (e.function && visit(e.function.get())) r = true;
      }
      reaches[n] = r;
      if (r) needed.insert(n);
      return r;
    };
    if (w.fn) visit(w.fn.get());
  }
  for (Node* n : all) {
    if (!needed.count(n)) n->release_variables();
  }
}

}  // namespace hp::pp
