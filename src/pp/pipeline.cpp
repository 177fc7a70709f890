#include "hp/pp/pipeline.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <set>

#include "hp/core/error.h"
#include "hp/core/trace.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"

namespace hp::pp {

namespace {

// The recording of the forward running on this thread under a split schedule, or null.
thread_local Recorded* t_recording = nullptr;

constexpr int kMaxDims = 8;
constexpr int64_t kHeaderLen = 2 + kMaxDims;  // dtype, ndim, dims
constexpr int64_t kFailedStage = -1;          // in the dtype slot: the stage before failed

// The shape and dtype of a stage's output, sent ahead of its first activation.
at::Tensor encode_header(int stage, const at::Tensor& out, const at::TensorOptions& where) {
  HP_CHECK(out.dim() <= kMaxDims, "Pipeline: stage ", stage, "'s output has ", out.dim(), " dims (at most ", kMaxDims,
           " supported)");
  at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
  auto* p = h.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(out.scalar_type());
  p[1] = out.dim();
  for (int64_t d = 0; d < out.dim(); ++d) p[2 + d] = out.size(d);
  return h.to(where.device());
}

}  // namespace

void mark_weight_output(const at::Tensor& output, std::vector<at::Tensor> params) {
  if (t_recording == nullptr || !output.requires_grad()) return;
  std::vector<at::Tensor> trained;
  for (auto& p : params) {
    if (p.requires_grad()) trained.push_back(std::move(p));
  }
  if (trained.empty()) return;
  const void* key = trained[0].unsafeGetTensorImpl();
  t_recording->push_back({key, "a marked weight output", std::move(trained), output});
}

Pipeline::Pipeline(const Schedule& schedule, std::vector<PipelineStage> stages, CommPtr group, PipelineLoss loss)
    : stages_(std::move(stages)), group_(std::move(group)), loss_(std::move(loss)) {
  HP_CHECK(group_ != nullptr, "Pipeline: no pp group");
  HP_CHECK(schedule.ranks == group_->size(), "Pipeline: the schedule is for ", schedule.ranks,
           " ranks, the pp group '", group_->name(), "' has ", group_->size());
  rank_ = group_->rank();
  for (const auto& list : schedule.actions) {
    for (const auto& a : list) split_ = split_ || a.kind == ActionKind::kBackwardInput;
  }
  std::set<int> mine;
  for (const auto& st : stages_) {
    HP_CHECK(st.stage >= 0 && st.stage < schedule.stages, "Pipeline: stage ", st.stage, " is not one of the schedule's ",
             schedule.stages);
    HP_CHECK(schedule.rank_of(st.stage) == rank_, "Pipeline: stage ", st.stage, " runs on pp rank ",
             schedule.rank_of(st.stage), ", this is pp rank ", rank_);
    HP_CHECK(mine.insert(st.stage).second, "Pipeline: stage ", st.stage, " given twice");
    HP_CHECK(st.forward != nullptr, "Pipeline: stage ", st.stage, " has no forward");
    HP_CHECK(!split_ || st.module != nullptr, "Pipeline: stage ", st.stage,
             " has no module: a schedule with split backwards (I, W) needs each stage's module");
    if (st.module) {
      for (const auto& m : st.module->modules(/*include_self=*/true)) {
        if (auto h = fsdp_handle(*m)) fsdp_[st.stage].push_back(h);
        if (split_) watch_weights(*m);
      }
      auto params = st.module->parameters(/*recurse=*/true);
      if (!params.empty() && device_.is_cpu()) device_ = params[0].device();
    }
  }
  // The headers and the few control values move on the CPU where the backend can (mpi),
  // else on the stages' device (nccl moves device tensors only).
  control_ = at::TensorOptions().device(group_->control_device());
  for (int s : schedule.stages_of(rank_)) {
    HP_CHECK(mine.count(s), "Pipeline: the schedule runs stage ", s, " on pp rank ", rank_, ", which was not given");
  }
  HP_CHECK(!holds_stage(schedule.stages - 1) || loss_ != nullptr, "Pipeline: pp rank ", rank_,
           " holds the last stage but no loss function was given");
  // Every rank must run the same lowered schedule: fully_shard verbs where any rank has them.
  at::Tensor any = at::full({1}, fsdp_.empty() ? 0 : 1, control_.dtype(at::kInt));
  group_->all_reduce(any, {ReduceOp::MAX}).wait();
  schedule_ = lower(schedule, LowerOptions{any.item<int>() == 1});
  // One communicator per ordered pair of neighbouring pp ranks (stage s talks only to s - 1
  // and s + 1): its sender only sends on it, its receiver only receives, so a receive posted
  // early waits on its own link without holding up anything else. Made by splitting the pp
  // group, the same list of pairs on every rank.
  const int p = schedule_.ranks;
  std::set<std::pair<int, int>> pairs;
  for (int a = 0; a < p && p > 1; ++a) {
    pairs.insert({a, (a + 1) % p});
    pairs.insert({(a + 1) % p, a});
  }
  for (const auto& [from, to] : pairs) {
    const bool member = rank_ == from || rank_ == to;
    CommOptions o;
    o.name = group_->name() + " " + std::to_string(from) + "->" + std::to_string(to);
    CommPtr c = group_->split(member ? 1 : -1, rank_ == from ? 0 : 1, o);  // the sender is rank 0 of it
    if (rank_ == from) send_link_[to] = c;
    if (rank_ == to) recv_link_[from] = c;
  }
}

Pipeline::~Pipeline() {
  for (HookHandle h : hooks_) remove_forward_hooks(h);
}

void Pipeline::watch_weights(torch::nn::Module& m) {
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

bool Pipeline::holds_stage(int s) const {
  return std::any_of(stages_.begin(), stages_.end(), [&](const PipelineStage& st) { return st.stage == s; });
}

PipelineStage& Pipeline::stage(int s) {
  for (auto& st : stages_) {
    if (st.stage == s) return st;
  }
  HP_INTERNAL_ASSERT(false, "stage ", s, " not held (validated schedule)");
  return stages_.front();
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> Pipeline::micro_batches(const at::Tensor& inputs,
                                                                                    const at::Tensor& targets,
                                                                                    const char* caller) {
  HP_CHECK(!broken_, "Pipeline::", caller, ": an earlier step failed part way; its transfers may still be posted on ",
           "the links and fully_shard's settings changed, so this pipeline cannot run again (build a new one)");
  const int m = schedule_.microbatches;
  auto split = [&](const at::Tensor& t, const char* what) {
    std::vector<at::Tensor> out;
    if (!t.defined()) return out;
    HP_CHECK(t.dim() >= 1 && t.size(0) % m == 0, "Pipeline::", caller, ": ", what, " of ",
             t.dim() >= 1 ? t.size(0) : 0, " rows does not split into ", m, " equal micro-batches");
    return t.split(t.size(0) / m);
  };
  auto in_mb = split(inputs, "inputs");
  auto tgt_mb = split(targets, "targets");
  HP_CHECK(!holds_stage(0) || !in_mb.empty(), "Pipeline::", caller, ": pp rank ", rank_,
           " holds the first stage and needs the inputs");
  HP_CHECK(!holds_stage(schedule_.stages - 1) || !tgt_mb.empty(), "Pipeline::", caller, ": pp rank ", rank_,
           " holds the last stage and needs the targets");
  if (!shapes_checked_) {
    check_shapes(in_mb, tgt_mb);
    shapes_checked_ = true;
  }
  loss_sum_ = at::Tensor();
  input_meta_.clear();
  header_sent_.clear();
  return {std::move(in_mb), std::move(tgt_mb)};
}

void Pipeline::abandon() {
  broken_ = true;
  t_recording = nullptr;
  weight_grads_.clear();
  module_outputs_.clear();
  sends_.clear();
  pending_input_.clear();
  pending_grad_.clear();
  input_.clear();
  output_.clear();
  grad_output_.clear();
}

at::Tensor Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const auto [in_mb, tgt_mb] = micro_batches(inputs, targets, "step");
  const auto& list = schedule_.actions[rank_];
  try {
    for (size_t i = 0; i < list.size();) {
      const Action& a = list[i];
      if (a.is_comm()) {
        run_transfer(a);
      } else if (a.is_compute()) {
        run_compute(a, in_mb, tgt_mb);
      } else {
        run_fsdp(a);
      }
      ++i;
    }
    for (auto& w : sends_) w.wait();
  } catch (...) {
    abandon();
    throw;
  }
  sends_.clear();
  HP_INTERNAL_ASSERT(input_.empty() && output_.empty() && grad_output_.empty() && weight_grads_.empty() &&
                         module_outputs_.empty(),
                     "pipeline step ended with tensors of unfinished micro-batches");
  return loss_sum_;
}

at::Tensor Pipeline::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  const auto [in_mb, tgt_mb] = micro_batches(inputs, targets, "evaluate");
  const int m = schedule_.microbatches, last = schedule_.stages - 1;
  at::NoGradGuard no_grad;
  try {
    for (int s : schedule_.stages_of(rank_)) {
      auto handles = fsdp_.find(s);
      if (handles != fsdp_.end()) {
        for (auto& h : handles->second) {
          h->set_reshard_after_forward(false, /*recurse=*/false);
          h->unshard(/*async=*/true);
        }
        for (auto& h : handles->second) h->wait_for_unshard();
      }
      for (int j = 0; j < m; ++j) {
        const Key k{s, j};
        at::Tensor in;
        if (s == 0) {
          in = in_mb[static_cast<size_t>(j)];
        } else {
          if (!holds_stage(s - 1)) {
            run_transfer(Action{s, ActionKind::kRecvForward, j});
            await(pending_input_, k, /*make_leaf=*/false);
          }
          auto it = input_.find(k);
          HP_INTERNAL_ASSERT(it != input_.end(), "no input for stage ", s, " micro-batch ", j);
          in = it->second;
          input_.erase(it);
        }
        at::Tensor out;
        {
          trace::Span span("pp evaluate " + Action{s, ActionKind::kForward, j}.to_string(), "compute");
          try {
            out = stage(s).forward(in);
          } catch (const std::exception& e) {
            throw Error(detail::str_cat("Pipeline: stage ", s, "'s forward of micro-batch ", j,
                                        " (evaluate) failed on its input of shape ", in.sizes(), ": ", e.what()));
          }
        }
        if (s == last) {
          at::Tensor l = loss_(out, tgt_mb[static_cast<size_t>(j)]) / m;
          HP_CHECK(l.numel() == 1, "Pipeline: the loss of stage ", s, " micro-batch ", j, " has ", l.numel(),
                   " elements, not one");
          loss_sum_ = loss_sum_.defined() ? loss_sum_ + l : l;
        } else if (holds_stage(s + 1)) {
          input_[Key{s + 1, j}] = out;
        } else {
          output_[k] = out;
          run_transfer(Action{s, ActionKind::kSendForward, j});
          output_.erase(k);
        }
      }
      if (handles != fsdp_.end()) {
        for (auto& h : handles->second) {
          h->reshard();
          h->set_reshard_after_forward(true, /*recurse=*/false);  // as the step's REDUCE_GRAD leaves it
        }
      }
    }
    for (auto& w : sends_) w.wait();
  } catch (...) {
    abandon();
    throw;
  }
  sends_.clear();
  HP_INTERNAL_ASSERT(input_.empty() && output_.empty(), "pipeline evaluation ended with unused activations");
  return loss_sum_;
}

// After I, the graph is kept only for W, which runs back from each recorded module output to
// that module's own parameters: the nodes on those paths are all W executes. Every other node
// still reachable from the outputs (attention's softmax, the norms, the activations between
// modules) has its saved tensors released now rather than when W ends.
void Pipeline::release_for_weights(const std::vector<WeightGrad>& pending) {
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

Pipeline::Meta Pipeline::decode_header(const at::Tensor& header) {
  const at::Tensor h = header.cpu();
  const auto* p = h.data_ptr<int64_t>();
  if (p[0] == kFailedStage) return Meta{at::kFloat, {}, /*failed=*/true};
  return Meta{static_cast<at::ScalarType>(p[0]), std::vector<int64_t>(p + 2, p + 2 + p[1])};
}

// Before the first step, micro-batch 0 goes through every stage once without gradients, in
// stage order, each stage handing its output's shape to the next, which runs on zeros of that
// shape (the last one also runs the loss on the targets). A stage that does not fit the one
// before it fails here, before any transfer of the step; the stages after it are told to skip,
// and every rank learns the outcome in one collective, so none is left waiting for a transfer
// that will never come. Nothing of the check stays: the generator and the stage modules'
// buffers (running statistics, MoE load counts) are put back as they were.
void Pipeline::check_shapes(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) {
  trace::Span span("pp shape check", "compute");
  const int last = schedule_.stages - 1;
  PointToPointOptions o;
  o.tag = 0;  // every message of the check is received before the step's first one
  std::map<int, at::Tensor> local_header;  // of stages whose next stage is here too
  std::vector<Work> sends;
  std::string error;
  int failed = -1;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor rng_state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_state = gen.get_state();
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // each buffer, and its value now
  for (const auto& st : stages_) {
    if (st.module == nullptr) continue;
    for (const auto& b : st.module->buffers(/*recurse=*/true)) {
      if (b.defined()) buffers.emplace_back(b, b.clone());
    }
  }
  {
    at::NoGradGuard no_grad;
    for (int s : schedule_.stages_of(rank_)) {
      at::Tensor in;
      bool skip = false;
      if (s == 0) {
        in = inputs[0];
      } else {
        at::Tensor h;
        if (holds_stage(s - 1)) {
          h = local_header.at(s - 1);
        } else {
          h = at::empty({kHeaderLen}, control_.dtype(at::kLong));
          recv_link_.at(schedule_.rank_of(s - 1))->recv(h, 0, o).wait();
        }
        const Meta m = decode_header(h);
        skip = m.failed;
        if (!skip) in = at::zeros(m.shape, at::TensorOptions().dtype(m.dtype).device(device_));
      }
      at::Tensor out;
      if (!skip) {
        try {
          out = stage(s).forward(in);
        } catch (const std::exception& e) {
          failed = s;
          error = detail::str_cat("Pipeline: stage ", s, "'s forward of micro-batch 0 failed on its input of shape ",
                                  in.sizes(), " (", in.scalar_type(), ")",
                                  s > 0 ? detail::str_cat(", stage ", s - 1, "'s output") : std::string(),
                                  ", in the shape check before the first step: ", e.what());
        }
        if (failed < 0 && s == last) {
          try {
            loss_(out, targets[0]);
          } catch (const std::exception& e) {
            failed = s;
            error = detail::str_cat("Pipeline: the loss of the last stage's output of shape ", out.sizes(),
                                    " and targets of shape ", targets[0].sizes(),
                                    " failed in the shape check before the first step: ", e.what());
          }
        }
      }
      if (s == last) continue;
      const at::Tensor marker = at::full({kHeaderLen}, kFailedStage, control_.dtype(at::kLong));
      at::Tensor h = marker;
      if (failed != s && !skip) {
        try {
          h = encode_header(s, out, control_);  // raises for an output it cannot describe
        } catch (const std::exception& e) {
          failed = s;
          error = e.what();
        }
      }
      if (holds_stage(s + 1)) {
        local_header[s] = h;
      } else {
        sends.push_back(send_link_.at(schedule_.rank_of(s + 1))->send(h, 1, o));
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng_state);
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [b, was] : buffers) b.copy_(was);
  }
  for (auto& w : sends) w.wait();
  at::Tensor worst = at::full({1}, failed, control_.dtype(at::kInt));
  group_->all_reduce(worst, {ReduceOp::MAX}).wait();
  const int bad = worst.item<int>();
  if (bad < 0) return;
  HP_CHECK(error.empty(), error);
  HP_CHECK(false, "Pipeline: stage ", bad, " (pp rank ", schedule_.rank_of(bad), ") failed in the shape check before ",
           "the first step; that rank's error names the shapes");
}

void Pipeline::run_compute(const Action& a, const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& targets) {
  const Key k{a.stage, a.microbatch};
  const int last = schedule_.stages - 1;
  auto local = [&](int s) { return s >= 0 && s <= last && holds_stage(s); };
  // What this action reads, if it is still being received (outside the compute spans).
  if (a.kind == ActionKind::kForward) {
    await(pending_input_, k, /*make_leaf=*/true);
  } else {
    await(pending_grad_, k, /*make_leaf=*/false);
  }
  if (a.kind == ActionKind::kForward) {
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
      if (split_) t_recording = &module_outputs_[k];
      out = stage(a.stage).forward(in);
      t_recording = nullptr;
    } catch (const std::exception& e) {
      t_recording = nullptr;
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
    } else if (local(a.stage + 1)) {
      input_[Key{a.stage + 1, a.microbatch}] = out.detach().requires_grad_(out.requires_grad());
    }
    output_[k] = out;
    return;
  }
  if (a.kind == ActionKind::kBackwardWeight) {
    // The weight gradients: from each recorded module output and the gradient the input
    // backward left on it, down to that module's own parameters only.
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
    return;
  }
  // A full backward, or (I) the input gradient only, keeping what the weight gradients need.
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
    // Gradients of the stage's input and of every recorded module output, not of any
    // parameter (autograd skips the weight halves of the nodes); the graph is kept for W.
    std::vector<at::Tensor> wrt;
    const bool has_input = in != input_.end() && in->second.requires_grad();
    if (has_input) wrt.push_back(in->second);
    auto rec = module_outputs_.find(k);
    if (rec != module_outputs_.end()) {
      std::set<const void*> seen;
      for (const auto& r : rec->second) {
        // W runs back from each output to the module's weights: from a second call's output
        // that path would run through the first call too and count it twice.
        HP_CHECK(seen.insert(r.key).second, "Pipeline: ", r.what, " ran more than once in stage ", a.stage,
                 "'s forward; a split backward (I, W) of a module called twice is not supported yet");
        wrt.push_back(r.output);
      }
    }
    std::vector<at::Tensor> grads;
    if (!wrt.empty()) {
      grads = torch::autograd::grad({out->second}, wrt, a.stage == last ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{grad_out},
                                    /*retain_graph=*/true, /*create_graph=*/false, /*allow_unused=*/true);
    }
    size_t j = 0;
    if (has_input) in->second.mutable_grad() = grads[j++];
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
  module_outputs_.erase(k);
  output_.erase(out);
  if (in != input_.end()) {
    if (a.stage > 0 && local(a.stage - 1)) {
      at::Tensor g = in->second.grad();
      grad_output_[Key{a.stage - 1, a.microbatch}] = g.defined() ? g : at::zeros_like(in->second);
    } else if (a.stage > 0) {
      return;  // SEND_B reads the gradient, then drops the input
    }
    input_.erase(in);
  }
}

void Pipeline::run_transfer(const Action& a) {
  const Key k{a.stage, a.microbatch};
  const int peer = schedule_.rank_of(a.peer_stage());
  const int tag = transfer_tag(schedule_, a);
  PointToPointOptions o;
  o.tag = tag;
  switch (a.kind) {
    case ActionKind::kSendForward: {
      const CommPtr& link = send_link_.at(peer);
      at::Tensor out = output_.at(k).detach().contiguous();
      if (header_sent_.insert(a.stage).second) {
        // The header first, with the stage's first activation sent this step (the link carries
        // them in the order the receiver posts them, so that is also its first receive): the
        // receiver learns the shape and dtype of the stage's input.
        sends_.push_back(link->send(encode_header(a.stage, out, control_), 1, o));
      }
      sends_.push_back(link->send(out, 1, o));  // its tensor stays alive in the op
      break;
    }
    case ActionKind::kSendBackward: {
      auto in = input_.find(k);
      HP_INTERNAL_ASSERT(in != input_.end(), "no input to send the gradient of for ", a.to_string());
      at::Tensor g = in->second.grad();
      sends_.push_back(send_link_.at(peer)->send(g.defined() ? g.contiguous() : at::zeros_like(in->second), 1, o));
      input_.erase(in);
      break;
    }
    case ActionKind::kRecvForward: {
      const CommPtr& link = recv_link_.at(peer);
      if (!input_meta_.count(a.stage)) {  // the stage's first receive this step: the header first
        at::Tensor h = at::empty({kHeaderLen}, control_.dtype(at::kLong));
        {
          trace::Span span("pp wait header", "wait");
          link->recv(h, 0, o).wait();
        }
        input_meta_[a.stage] = decode_header(h);
      }
      auto meta = input_meta_.find(a.stage);
      HP_INTERNAL_ASSERT(meta != input_meta_.end(), "no header for ", a.to_string());
      at::Tensor buf = at::empty(meta->second.shape, at::TensorOptions().dtype(meta->second.dtype).device(device_));
      input_[k] = buf;
      pending_input_[k] = std::make_shared<Work>(link->recv(buf, 0, o));
      break;
    }
    case ActionKind::kRecvBackward: {
      const at::Tensor& out = output_.at(k);
      at::Tensor buf = at::empty(out.sizes(), out.options().requires_grad(false));
      grad_output_[k] = buf;
      pending_grad_[k] = std::make_shared<Work>(recv_link_.at(peer)->recv(buf, 0, o));
      break;
    }
    default:
      HP_INTERNAL_ASSERT(false, "not a transfer: ", a.to_string());
  }
}

void Pipeline::await(std::map<Key, std::shared_ptr<Work>>& pending, const Key& k, bool make_leaf) {
  auto it = pending.find(k);
  if (it == pending.end()) return;
  {
    trace::Span span("pp wait recv", "wait");
    it->second->wait();
  }
  pending.erase(it);
  if (make_leaf) {
    at::Tensor& t = input_.at(k);
    if (t.is_floating_point()) t.requires_grad_(true);
  }
}

void Pipeline::run_fsdp(const Action& a) {
  auto it = fsdp_.find(a.stage);
  if (it == fsdp_.end()) return;  // this stage has no fully_shard'ed modules (another rank's have)
  auto& handles = it->second;
  switch (a.kind) {
    case ActionKind::kUnshard:
      for (auto& h : handles) {
        h->set_reshard_after_forward(false, /*recurse=*/false);
        h->set_reshard_after_backward(false, /*recurse=*/false);
        h->set_requires_gradient_sync(false, /*recurse=*/false);
        h->unshard(/*async=*/true);
      }
      for (auto& h : handles) h->wait_for_unshard();
      break;
    case ActionKind::kReduceGrad:
      for (auto& h : handles) h->reduce_grads();
      for (auto& h : handles) {
        h->finalize_backward();
        h->set_requires_gradient_sync(true, /*recurse=*/false);
        h->set_reshard_after_backward(true, /*recurse=*/false);
        h->set_reshard_after_forward(true, /*recurse=*/false);
      }
      break;
    case ActionKind::kReshard:
      for (auto& h : handles) h->reshard();
      break;
    default:
      HP_INTERNAL_ASSERT(false, "not a fully_shard verb: ", a.to_string());
  }
}

}  // namespace hp::pp
