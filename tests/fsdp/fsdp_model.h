// A small transformer for the fully_shard tests: embedding, pre-norm blocks (causal
// attention, GELU MLP), final norm and an output head tied to the embedding. Children are
// called through hp::call, as a model under fully_shard must. Dims are chosen so that no
// parameter's dim 0 divides by 4 ranks.
#pragma once

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <string>
#include <vector>

#include "hp/hooks/call.h"

namespace hp::test {

struct TinyConfig {
  int64_t vocab = 37, dim = 10, heads = 2, ffn = 26, layers = 2, seq = 6;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const TinyConfig& c) : heads(c.heads) {
    n1 = register_module("n1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    // No bias: the key bias has an exactly-zero gradient (softmax ignores it), whose
    // rounding noise AdamW would amplify into arbitrary updates.
    qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(c.dim, 3 * c.dim).bias(false)));
    proj = register_module("proj", torch::nn::Linear(c.dim, c.dim));
    n2 = register_module("n2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    fc1 = register_module("fc1", torch::nn::Linear(c.dim, c.ffn));
    fc2 = register_module("fc2", torch::nn::Linear(c.ffn, c.dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2), dh = D / heads;
    auto parts = hp::call(qkv, hp::call(n1, x)).chunk(3, -1);
    auto split = [&](const at::Tensor& t) { return t.reshape({B, T, heads, dh}).transpose(1, 2); };
    at::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    at::Tensor scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
    at::Tensor mask = at::ones({T, T}, scores.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(mask, -1e9);
    at::Tensor o = scores.softmax(-1).matmul(v).transpose(1, 2).reshape({B, T, D});
    at::Tensor h = x + hp::call(proj, o);
    return h + hp::call(fc2, torch::nn::functional::gelu(hp::call(fc1, hp::call(n2, h))));
  }
  int64_t heads;
  torch::nn::LayerNorm n1{nullptr}, n2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct TinyModelImpl : torch::nn::Module {
  explicit TinyModelImpl(const TinyConfig& c) {
    emb = register_module("emb", torch::nn::Embedding(c.vocab, c.dim));
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks.push_back(register_module("blocks_" + std::to_string(i), Block(c)));
    }
    nf = register_module("nf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  }
  // Mean cross-entropy of next-token prediction over the batch.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& targets) {
    at::Tensor h = hp::call(emb, tokens);
    for (auto& b : blocks) h = hp::call(b, h);
    at::Tensor logits = hp::call(nf, h).matmul(emb->weight.t());  // tied head
    at::Tensor flat = logits.reshape({-1, logits.size(-1)});  // the loss in fp32, or fp64 for a fp64 model
    return torch::nn::functional::cross_entropy(flat.scalar_type() == at::kDouble ? flat : flat.to(at::kFloat),
                                                targets.reshape({-1}));
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm nf{nullptr};
};
TORCH_MODULE(TinyModel);

}  // namespace hp::test
