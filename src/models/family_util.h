// What the built-in families share: the Model wrapper of a reference model and the
// per-block parameter arithmetic under tensor parallelism.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hp/hooks/call.h"
#include "hp/models/family.h"
#include "hp/models/tensor_parallel.h"

namespace hp::models::detail {

// A reference model (Llama, DeepSeek) as a Model.
template <typename Holder>
class ModelOf : public Model {
 public:
  explicit ModelOf(Holder m) : m_(std::move(m)) {}
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
    return m_->loss_of_logits(logits, targets);
  }
  void init_weights(uint64_t seed) override { m_->init_weights(seed); }
  void parallelize(const CommPtr& tp, bool sequence_parallel, c10::optional<at::ScalarType> reduce_dtype) override {
    TensorParallelOptions o;
    o.sequence_parallel = sequence_parallel;
    o.reduce_dtype = reduce_dtype;
    models::parallelize(m_, tp, o);
  }
  void context_parallel(std::shared_ptr<cp::ContextParallel> ctx) override { models::context_parallel(*m_, std::move(ctx)); }

 protected:
  Holder m_;
};

// A reference model with MoE blocks (DeepSeek, MoELlama: blocks with a `moe`, null in a
// dense block) as a Model: balancing after each step, the loss scale for a loss the MoE
// adds, expert parallelism, the experts' modules and their load.
template <typename Holder>
class MoEModelOf : public ModelOf<Holder> {
 public:
  using ModelOf<Holder>::ModelOf;
  void after_step(const CommPtr& dp) override { this->m_->update_balancing_bias(dp); }
  void set_loss_scale(double scale) override {
    for (auto& [layer, moe] : this->m_->moes()) moe->loss_scale = scale;
  }
  void expert_parallel(const CommPtr& ep, const ep::DispatchOptions& o) override {
    models::expert_parallel(*this->m_, ep, o);
  }
  std::vector<ExpertLoad> expert_load() const override {
    std::vector<ExpertLoad> out;
    for (const auto& [layer, moe] : this->m_->moes()) {
      if (moe->last_load.defined()) out.push_back({layer, moe->last_load, moe->last_dropped});
    }
    return out;
  }
  std::vector<torch::nn::Module*> expert_modules() override {
    std::vector<torch::nn::Module*> out;
    for (auto& [layer, moe] : this->m_->moes()) out.push_back(moe->experts.get());
    return out;
  }
};

// The rotary scaling's keys of a config with rope_of()'s fields (Llama's and DeepSeek's),
// written once.
template <typename C>
std::vector<ModelKey> rope_keys() {
  return {
      choice_key<C>("rope_scaling", &C::rope_scaling, {"none", "linear", "llama3", "yarn"},
                    "rotary frequencies stretched for longer contexts: none, all by rope_factor (linear), Llama "
                    "3.1's (llama3) or YaRN's (yarn, as DeepSeek-V3 publishes)"),
      float_key<C>("rope_factor", &C::rope_factor, 0, true, "rope_scaling's factor"),
      float_key<C>("rope_low_freq_factor", &C::rope_low_freq_factor, 0, true, "llama3 scaling's low_freq_factor"),
      float_key<C>("rope_high_freq_factor", &C::rope_high_freq_factor, 0, true, "llama3 scaling's high_freq_factor"),
      int_key<C>("rope_original_max_seq", &C::rope_original_max_seq, 1,
                 "llama3 and yarn scalings' original_max_position_embeddings"),
      float_key<C>("rope_beta_fast", &C::rope_beta_fast, 0, true,
                   "yarn: dims turning more than this many times over rope_original_max_seq are kept"),
      float_key<C>("rope_beta_slow", &C::rope_beta_slow, 0, true,
                   "yarn: dims turning fewer than this many times are divided by rope_factor"),
      float_key<C>("rope_mscale", &C::rope_mscale, 0, false, "yarn's mscale (0: not given)"),
      float_key<C>("rope_mscale_all_dim", &C::rope_mscale_all_dim, 0, false,
                   "yarn's mscale_all_dim (0: not given; DeepSeek's attention scale times its mscale squared)"),
  };
}

// The capacity limit's keys of a config with DeepSeekConfig's capacity_factor and
// drop_policy (DeepSeek's, MoELlama's), written once.
template <typename C>
std::vector<ModelKey> capacity_keys() {
  return {
      on_resume(float_key<C>("capacity_factor", &C::capacity_factor, 0, false,
                             "each expert takes at most this x its even share of a rank's routed slots (0: no limit)"),
                ResumeRule::kTrajectory),
      on_resume(choice_key<C>("drop_policy", &C::drop_policy, {"probs", "position"},
                              "over capacity, keep an expert's highest-scored slots (probs) or its first tokens "
                              "(position)"),
                ResumeRule::kTrajectory),
  };
}

// One kind of block: its parameters, those tensor parallelism keeps whole on every rank, and
// how many blocks of the kind the model has.
struct BlockKind {
  int64_t total = 0, whole = 0, layers = 0;
  int64_t per_rank(int64_t tp) const { return (total - whole) / tp + whole; }
};

// Parameters per tensor-parallel rank of a model of `num_params` whose blocks are `kinds`
// and whose other whole parameters (the final norm) are `other_whole`.
inline int64_t params_per_tp_rank(int64_t num_params, int64_t other_whole, const std::vector<BlockKind>& kinds,
                                  int64_t tp) {
  if (tp <= 1) return num_params;
  int64_t whole = other_whole;
  for (const auto& k : kinds) whole += k.layers * k.whole;
  return (num_params - whole) / tp + whole;
}

inline int64_t largest_block_per_tp_rank(const std::vector<BlockKind>& kinds, int64_t tp) {
  int64_t biggest = 0;
  for (const auto& k : kinds) biggest = std::max(biggest, k.per_rank(std::max<int64_t>(tp, 1)));
  return biggest;
}

// What a reference family's ModelArgs forwards to its config and its model, written once:
// the sizes and counts its config computes, validation and tensor parallelism's check (the
// config's free functions), the per-tensor-parallel-rank counts from Self::kinds(), Hugging
// Face interchange through the config's free functions, and build() (Holder(config, slice),
// every block checkpointed with `recompute`, wrapped as Wrapper). Self (CRTP) adds what is
// its own: stage_params, FLOPs, activations, ...
template <typename Self, typename Config, typename Holder, typename Wrapper = ModelOf<Holder>>
class ReferenceArgs : public ArgsOf<Config> {
 public:
  ReferenceArgs(const ModelFamily& family, Config c) : ArgsOf<Config>(std::move(c)), family_(&family) {}
  std::unique_ptr<ModelArgs> clone() const override { return std::make_unique<Self>(self()); }
  const ModelFamily& family() const override { return *family_; }

  int64_t vocab() const override { return this->config.vocab; }
  int64_t dim() const override { return this->config.dim; }
  int64_t layers() const override { return this->config.layers; }
  int64_t max_seq() const override { return this->config.max_seq; }
  int64_t num_params() const override { return this->config.num_params(); }
  int64_t largest_param() const override { return this->config.largest_param(); }
  int64_t params_per_tp_rank(int64_t tp) const override {
    return detail::params_per_tp_rank(this->num_params(), this->config.dim, self().kinds(), tp);
  }
  int64_t largest_block_params_per_tp_rank(int64_t tp) const override {
    return tp <= 1 ? this->largest_block_params() : largest_block_per_tp_rank(self().kinds(), tp);
  }

  void set_layers(int64_t layers) override { this->config.layers = layers; }
  void validate() const override { this->config.validate(); }
  void check_tensor_parallel(int64_t tp) const override { models::check_tensor_parallel(this->config, tp); }

  std::unique_ptr<Model> build(const PipelineSlice& slice, c10::optional<RecomputePolicy> recompute) const override {
    Holder m(this->config, slice);
    m->recompute = recompute;
    return std::make_unique<Wrapper>(m);
  }

  bool supports_hf() const override { return true; }
  std::vector<std::pair<std::string, std::string>> hf_names() const override { return models::hf_names(this->config); }
  std::string hf_config(at::ScalarType dtype) const override { return models::hf_config(this->config, dtype); }
  void check_hf_config(const std::string& text, const std::string& path) const override {
    models::check_hf_config(this->config, text, path);
  }

 private:
  const Self& self() const { return static_cast<const Self&>(*this); }
  const ModelFamily* family_;
};

}  // namespace hp::models::detail
