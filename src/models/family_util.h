// What the built-in families share: the Model wrapper of a reference model and the
// per-block parameter arithmetic under tensor parallelism.
#pragma once

#include <algorithm>
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

}  // namespace hp::models::detail
