// A third model family, defined here and nowhere in the library: an embedding, residual
// MLP blocks (x + down(tanh(up(x)))) and an output head. It exists to show that a family
// plugs into hp-train's code paths (config keys, fully_shard, tensor and pipeline
// parallelism, the planner's arithmetic) through hp/models/family.h alone.
//
// Tensor parallelism: the embedding vocabulary-parallel, each block's mlp.up colwise and
// mlp.down rowwise, the head colwise with its logits gathered; with sequence parallelism the
// residual stream between blocks is split on the sequence.
#pragma once

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hp/core/memory.h"
#include "hp/hooks/call.h"
#include "hp/hooks/recompute.h"
#include "hp/models/family.h"
#include "hp/models/llama.h"  // the reference models' helpers: init_parameters, cross_entropy_of_logits
#include "hp/tp/parallelize.h"

namespace hp::test {

struct ToyConfig {
  int64_t vocab = 64;
  int64_t dim = 16;
  int64_t layers = 3;
  int64_t hidden = 32;
  int64_t max_seq = 64;
};

struct ToyMLPImpl : torch::nn::Module {
  explicit ToyMLPImpl(const ToyConfig& c) {
    up = register_module("up", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.hidden).bias(false)));
    down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.dim).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x) { return hp::call(down, at::tanh(hp::call(up, x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(ToyMLP);

struct ToyBlockImpl : torch::nn::Module {
  explicit ToyBlockImpl(const ToyConfig& c) { mlp = register_module("mlp", ToyMLP(c)); }
  at::Tensor forward(const at::Tensor& x) { return x + hp::call(mlp, x); }
  ToyMLP mlp{nullptr};
};
TORCH_MODULE(ToyBlock);

struct ToyImpl : torch::nn::Module {
  ToyImpl(const ToyConfig& c, const models::PipelineSlice& sl) : slice(sl) {
    const int64_t end = models::check_slice(sl, c.layers);
    if (sl.embedding) tok_emb = register_module("tok_emb", torch::nn::Embedding(c.vocab, c.dim));
    for (int64_t i = sl.first_layer; i < end; ++i) {
      blocks.push_back(register_module("layers_" + std::to_string(i), ToyBlock(c)));
    }
    if (sl.head) {
      output = register_module("output", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
    }
    if (!hp::memory::deferring()) models::init_parameters(*this, 0);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = slice.embedding ? hp::call(tok_emb, x) : x;
    for (auto& b : blocks) h = recompute ? hp::recompute_with(*recompute, b, h) : hp::call(b, h);
    return output ? hp::call(output, h) : h;
  }
  models::PipelineSlice slice;
  c10::optional<RecomputePolicy> recompute;
  torch::nn::Embedding tok_emb{nullptr};
  std::vector<ToyBlock> blocks;
  torch::nn::Linear output{nullptr};
};
TORCH_MODULE(Toy);

class ToyModel : public models::Model {
 public:
  explicit ToyModel(Toy m) : m_(std::move(m)) {}
  torch::nn::Module& root() override { return *m_; }
  std::vector<torch::nn::Module*> blocks() override {
    std::vector<torch::nn::Module*> out;
    for (auto& b : m_->blocks) out.push_back(b.get());
    return out;
  }
  at::Tensor forward(const at::Tensor& tokens, bool hooked) override {
    return hooked ? hp::call(m_, tokens) : m_->forward(tokens);
  }
  at::Tensor loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) override {
    return models::cross_entropy_of_logits(logits, targets, nullptr);
  }
  void init_weights(uint64_t seed) override { models::init_parameters(*m_, seed); }
  void parallelize(const CommPtr& tp, bool sequence_parallel, c10::optional<at::ScalarType> reduce_dtype) override {
    using namespace hp::tp;
    const Placement stream = sequence_parallel ? Placement(Shard(1)) : Placement(Replicate());
    ParallelizePlan plan;
    if (m_->tok_emb) plan.push_back({"tok_emb", RowwiseParallel().input(Replicate()).output(stream)});
    if (!m_->blocks.empty()) {
      plan.push_back({"layers_*.mlp", PrepareModuleInput({stream}, {Replicate()})});
      plan.push_back({"layers_*.mlp.up", ColwiseParallel()});
      plan.push_back({"layers_*.mlp.down", RowwiseParallel().output(stream)});
    }
    if (m_->output) plan.push_back({"output", ColwiseParallel().input(stream).output(Replicate())});
    parallelize_module(*m_, tp, plan, {reduce_dtype});
  }

 private:
  Toy m_;
};

class ToyArgs : public models::ArgsOf<ToyConfig> {
 public:
  ToyArgs(const models::ModelFamily& f, ToyConfig c) : ArgsOf(c), family_(f) {}
  std::unique_ptr<models::ModelArgs> clone() const override { return std::make_unique<ToyArgs>(*this); }
  const models::ModelFamily& family() const override { return family_; }
  int64_t vocab() const override { return config.vocab; }
  int64_t dim() const override { return config.dim; }
  int64_t layers() const override { return config.layers; }
  int64_t max_seq() const override { return config.max_seq; }
  int64_t ffn_hidden() const override { return config.hidden; }
  int64_t block() const { return 2 * config.dim * config.hidden; }
  int64_t num_params() const override { return 2 * config.vocab * config.dim + config.layers * block(); }
  int64_t largest_param() const override { return std::max(config.vocab, config.hidden) * config.dim; }
  int64_t largest_block_params() const override { return block(); }
  int64_t stage_params(const models::PipelineSlice& sl) const override {
    const int64_t end = models::check_slice(sl, config.layers);
    return (sl.embedding + sl.head) * config.vocab * config.dim + (end - sl.first_layer) * block();
  }
  // Every parameter is split.
  int64_t params_per_tp_rank(int64_t tp) const override { return num_params() / tp; }
  int64_t largest_block_params_per_tp_rank(int64_t tp) const override { return block() / tp; }
  std::string whole_under_tp() const override { return "nothing"; }
  models::FlopCount flops_per_token(int64_t) const override {
    return {2.0 * static_cast<double>(block()), 2.0 * static_cast<double>(config.vocab * config.dim)};
  }
  models::ActivationCount activations_per_token(int64_t) const override {
    return {static_cast<double>(2 * config.dim + 2 * config.hidden), static_cast<double>(config.vocab)};
  }
  void set_layers(int64_t layers) override { config.layers = layers; }
  void validate() const override {
    HP_CHECK(config.vocab >= 2 && config.dim > 0 && config.layers > 0 && config.hidden > 0, "toy: bad sizes");
  }
  void check_tensor_parallel(int64_t tp) const override {
    HP_CHECK(config.hidden % tp == 0 && config.vocab % tp == 0, "toy: hidden=", config.hidden, " or vocab=",
             config.vocab, " is not divisible by tensor_parallel=", tp);
  }
  std::unique_ptr<models::Model> build(const models::PipelineSlice& slice,
                                       c10::optional<RecomputePolicy> recompute) const override {
    Toy m(config, slice);
    m->recompute = recompute;
    return std::make_unique<ToyModel>(m);
  }

 private:
  const models::ModelFamily& family_;
};

class ToyFamily : public models::ModelFamily {
 public:
  std::string name() const override { return "toy"; }
  std::vector<std::string> presets() const override { return {"small"}; }
  std::unique_ptr<models::ModelArgs> preset(const std::string& name) const override {
    HP_CHECK(name == "small", "toy: no preset '", name, "'");
    return std::make_unique<ToyArgs>(*this, ToyConfig{});
  }
  const std::vector<models::ModelKey>& keys() const override {
    static const std::vector<models::ModelKey> k = {
        models::int_key<ToyConfig>("vocab", &ToyConfig::vocab, 2, "vocabulary size"),
        models::int_key<ToyConfig>("layers", &ToyConfig::layers, 1, "blocks"),
        models::int_key<ToyConfig>("toy_hidden", &ToyConfig::hidden, 1, "the blocks' hidden size"),
    };
    return k;
  }
};

// Registers the toy family once per process.
inline void register_toy_family() {
  static std::once_flag once;
  std::call_once(once, [] { models::register_model_family(std::make_shared<ToyFamily>()); });
}

}  // namespace hp::test
