// Cross-entropy over vocabulary-split logits (loss parallel).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/core/error.h"
#include "hp/tp/parallelize.h"

namespace hp::tp {
namespace {

// Forward: three all-reduces (row max, sum of exponentials, target logit). Backward: the
// local slice of softmax - one_hot(target), scaled: no communication.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, const CommPtr& g) {
    const at::ScalarType ct = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor z = logits.to(ct);
    const int64_t per = z.size(1), lo = per * g->rank();
    at::Tensor max = std::get<0>(z.max(1));
    g->all_reduce(max, ReduceOptions{ReduceOp::MAX}).wait();
    z = z - max.unsqueeze(1);
    at::Tensor e = z.exp();
    at::Tensor sum = e.sum(1);
    at::Tensor local_t = targets - lo;
    at::Tensor inside = (local_t >= 0).logical_and(local_t < per);
    at::Tensor safe = local_t.masked_fill(inside.logical_not(), 0);
    at::Tensor target_logit = z.gather(1, safe.unsqueeze(1)).squeeze(1).masked_fill(inside.logical_not(), 0);
    // One reduction carries both sums: [sum of exponentials, target logit] per row.
    at::Tensor both = at::stack({sum, target_logit}).contiguous();
    g->all_reduce(both).wait();
    at::Tensor loss = (both[0].log() - both[1]).mean();
    ctx->save_for_backward({e / both[0].unsqueeze(1), safe, inside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], safe = saved[1], inside = saved[2];
    at::Tensor one_hot = at::zeros_like(softmax).scatter_(1, safe.unsqueeze(1), inside.unsqueeze(1).to(softmax.scalar_type()));
    at::Tensor g = (softmax - one_hot) * (grads[0] / static_cast<double>(softmax.size(0)));
    const auto dt = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {g.to(dt), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const CommPtr& group) {
  HP_CHECK(group, "vocab_parallel_cross_entropy without a group");
  HP_CHECK(local_logits.dim() >= 1, "vocab_parallel_cross_entropy: logits need a vocabulary dim");
  at::Tensor flat = local_logits.reshape({-1, local_logits.size(-1)});
  at::Tensor t = targets.reshape({-1});
  HP_CHECK(t.size(0) == flat.size(0), "vocab_parallel_cross_entropy: ", flat.size(0), " rows of logits but ",
           t.size(0), " targets");
  HP_CHECK(t.scalar_type() == at::kLong, "vocab_parallel_cross_entropy: targets must be int64, got ",
           t.scalar_type());
  const int64_t vocab = flat.size(1) * group->size();
  if (t.numel() > 0) {
    const int64_t lo = t.min().item<int64_t>(), hi = t.max().item<int64_t>();
    HP_CHECK(lo >= 0 && hi < vocab, "vocab_parallel_cross_entropy: target id ", lo < 0 ? lo : hi,
             " is outside the vocabulary [0, ", vocab, ")");
  }
  return VocabParallelCrossEntropy::apply(flat, t, group);
}

}  // namespace hp::tp
