// DeepSeek's forward with its multi-token prediction module, written out for the tests
// (only the blocks' own forwards are the model's).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <utility>

#include "hp/models/deepseek.h"

namespace hp::test {

// DeepSeek's forward written out here (only its blocks' forwards are the model's), with its
// multi-token prediction module (DeepSeek-V3 section 2.2): the logits of x, and the MTP loss
// of position i of the first T-1 from the last block's output h_i and the embedding of the
// next token (y_i), predicting the one after it (y_{i+1}), through enorm/hnorm, eh_proj over
// their concatenation, the module's block, its norm and the shared head.
inline std::pair<at::Tensor, at::Tensor> naive_deepseek_mtp(hp::models::DeepSeekImpl& m, const at::Tensor& x,
                                                     const at::Tensor& y) {
  const int64_t T = x.size(1);
  const double eps = m.config.norm_eps;
  auto [cos, sin] = hp::models::rotary_tables(T, m.config.qk_rope_dim, m.config.rope());
  auto rms = [eps](const at::Tensor& v, const at::Tensor& w) { return v * at::rsqrt(v.pow(2).mean(-1, true) + eps) * w; };
  at::Tensor h = at::embedding(m.tok_emb->weight, x);
  for (auto& b : m.blocks) h = b->forward(h, cos, sin);
  at::Tensor logits = at::matmul(rms(h, m.norm->weight), m.output->weight.t());
  hp::models::MTPImpl& p = *m.mtp.at(0);
  at::Tensor e = rms(at::embedding(m.tok_emb->weight, y.narrow(1, 0, T - 1)), p.enorm->weight);
  at::Tensor z = at::matmul(at::cat({e, rms(h.narrow(1, 0, T - 1), p.hnorm->weight)}, -1), p.eh_proj->weight.t());
  z = p.block->forward(z, cos.narrow(0, 0, T - 1), sin.narrow(0, 0, T - 1));
  at::Tensor mtp_logits = at::matmul(rms(z, p.norm->weight), m.output->weight.t());
  at::Tensor mtp = torch::nn::functional::cross_entropy(mtp_logits.reshape({-1, m.config.vocab}),
                                                        y.narrow(1, 1, T - 1).reshape({-1}));
  return {logits, mtp};
}

}  // namespace hp::test
