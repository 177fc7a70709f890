// Helpers of the tensor-parallel model tests: a whole parameter put together from its
// pieces (here, not with the library's collectives), and training runs of a reference
// model in one process and under tensor parallelism (alone, or inside fully_shard) with the
// same AdamW steps.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/fsdp/fully_shard.h"
#include "hp/hooks/call.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/family.h"
#include "hp/models/tensor_parallel.h"
#include "hp/tp/traffic.h"
#include "hp/tp/parallelize.h"

namespace hp::test {


inline double rel(const at::Tensor& a, const at::Tensor& b) {
  if (!a.sizes().equals(b.sizes())) return 1e30;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
         (b.to(at::kDouble).abs().max().item<double>() + 1e-300);
}

// The tensor-parallel dim of a piece, or -1 for a whole parameter.
inline int64_t split_dim(const at::Tensor& p) {
  auto spec = hp::tp::parameter_spec(p);
  if (!spec) return -1;
  for (size_t d = 0; d < spec->splits.size(); ++d) {
    if (!spec->splits[d].empty()) return static_cast<int64_t>(d);
  }
  return -1;
}

// The whole parameter from every rank's piece (rank r's piece at r * len along `dim`),
// assembled here; a whole parameter must be bitwise the same on every rank.
inline at::Tensor whole(const at::Tensor& piece, int64_t dim, const hp::CommPtr& g, double* spread) {
  if (dim < 0) {
    at::Tensor r0 = piece.detach().to(at::kDouble).clone().contiguous();
    g->broadcast(r0, 0).wait();
    at::Tensor d = (piece.detach().to(at::kDouble) - r0).abs().max().reshape({1});
    g->all_reduce(d, hp::ReduceOptions{hp::ReduceOp::MAX}).wait();
    *spread = std::max(*spread, d.item<double>());
    return r0;
  }
  auto shape = piece.sizes().vec();
  shape[dim] *= g->size();
  at::Tensor full = at::zeros(shape, at::kDouble);
  full.narrow(dim, g->rank() * piece.size(dim), piece.size(dim)).copy_(piece.detach());
  g->all_reduce(full).wait();
  return full;
}

struct Batch {
  at::Tensor x, y;
};
inline Batch batch(int step, int64_t B, int64_t T, int64_t vocab) {
  at::Tensor all = at::randint(vocab, {B, T + 1}, at::detail::createCPUGenerator(100 + step), at::kLong);
  return {all.narrow(1, 0, T), all.narrow(1, 1, T)};
}

// One process and the parallel model, trained `steps` AdamW steps in float64 on the same
// batches (the parallel model sees rows [dp_rank * B / dp, ...) of each); `after_step`
// runs after each optimizer step with the data-parallel group (null for one process).
// Returns the largest relative differences of the losses (the global batch's mean) and of
// the reassembled parameters, and the largest difference of a whole parameter across tp
// ranks (0: bitwise the same everywhere).
struct TpRun {
  double loss = 0, params = 0, spread = 0;
};

template <typename Model, typename Config>
TpRun train_tp_against_one_process(const Config& c, const models::TensorParallelOptions& o, const CommPtr& tp,
                                   const std::shared_ptr<DeviceMesh>& fsdp_mesh, int64_t dp, int64_t dp_rank,
                                   const std::function<void(Model&, const CommPtr&)>& after_step, int steps = 3) {
  const int64_t B = 2 * dp, T = 8, local = B / dp;
  Model ref(c), m(c);
  ref->init_weights(7);
  ref->to(at::kDouble);
  models::parallelize(m, tp, o);
  m->init_weights(7);  // each piece gets its box of the layout-independent values
  m->to(at::kDouble);
  std::vector<FSDPHandle> handles;
  std::vector<at::Tensor> params = m->parameters();
  if (fsdp_mesh) {
    FullyShardOptions fo;
    fo.mesh = fsdp_mesh;
    fo.comm_fusion = true;
    for (auto& blk : m->blocks) handles.push_back(fully_shard(*blk, fo));
    handles.push_back(fully_shard(*m, fo));
    params.clear();
    for (auto& h : handles) {
      for (auto& p : h->parameters()) params.push_back(p);
    }
  }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  CommPtr dp_group = fsdp_mesh ? fsdp_mesh->group("dp_shard") : nullptr;
  TpRun out;
  for (int step = 0; step < steps; ++step) {
    Batch b = batch(step, B, T, c.vocab);
    ref_opt.zero_grad();
    at::Tensor want = ref->loss_of_logits(ref->forward(b.x), b.y);
    want.backward();
    ref_opt.step();
    after_step(ref, nullptr);
    opt.zero_grad();
    at::Tensor x = b.x.narrow(0, dp_rank * local, local), y = b.y.narrow(0, dp_rank * local, local);
    at::Tensor got = m->loss_of_logits(hp::call(m, x), y);
    got.backward();
    opt.step();
    after_step(m, dp_group);
    // The mean over the global batch: the data-parallel ranks' means, averaged.
    at::Tensor mean = got.detach().reshape({1}).clone();
    if (dp_group) dp_group->all_reduce(mean, ReduceOptions{ReduceOp::AVG}).wait();
    out.loss = std::max(out.loss, rel(mean, want.detach().reshape({1})));
  }
  auto full_params = ref->named_parameters();
  if (!fsdp_mesh) {
    for (const auto& item : m->named_parameters()) {
      at::Tensor full = whole(item.value(), split_dim(item.value()), tp, &out.spread);
      out.params = std::max(out.params, rel(full, full_params[item.key()]));
    }
    return out;
  }
  // Each sharded parameter: its dp_shard rows put together here, then its tp pieces.
  for (size_t i = 0; i < handles.size(); ++i) {
    auto mine = handles[i]->module().named_parameters();
    auto want = i + 1 < handles.size() ? ref->blocks[i]->named_parameters() : ref->named_parameters();
    for (const auto& st : handles[i]->state_dict()) {
      at::Tensor piece = at::zeros(st.global_shape, at::kDouble);
      if (st.local.dim() > 0 && st.local.size(0) > 0) piece.narrow(0, st.row_offset, st.local.size(0)).copy_(st.local);
      dp_group->all_reduce(piece).wait();
      at::Tensor full = whole(piece, split_dim(mine[st.name]), tp, &out.spread);
      out.params = std::max(out.params, rel(full, want[st.name]));
    }
  }
  return out;
}

// One block's exchanges over `g` as the communicator counts them (ops, bytes this rank
// sends), forward and backward of the loss: a model of 2 blocks less the same model of 1
// (the embedding, head and loss cancel), built through the family seam and parallelized
// over `g` with or without sequence parallelism; and as tp::block_traffic estimates them
// from the family's own account (ModelArgs::tp_summed_params). The model computes in
// float64 (8-byte rows and gradient sums).
struct BlockTraffic {
  hp::CommTraffic forward, backward;
};
inline BlockTraffic measured_block_traffic(const hp::models::ModelArgs& args, const CommPtr& g, bool sp,
                                           const Batch& b) {
  auto run = [&](int64_t layers) {
    auto a = args.clone();
    a->set_layers(layers);
    auto m = a->build(hp::models::PipelineSlice{}, c10::nullopt);
    m->parallelize(g, sp, c10::nullopt);
    m->init_weights(1);
    m->root().to(at::kDouble);
    const hp::CommTraffic t0 = g->traffic();
    at::Tensor loss = m->loss_of_logits(m->forward(b.x, true), b.y);
    const hp::CommTraffic t1 = g->traffic();
    loss.backward();
    const hp::CommTraffic t2 = g->traffic();
    return BlockTraffic{{t1.ops - t0.ops, t1.bytes_sent - t0.bytes_sent}, {t2.ops - t1.ops, t2.bytes_sent - t1.bytes_sent}};
  };
  const BlockTraffic two = run(2), one = run(1);
  return {{two.forward.ops - one.forward.ops, two.forward.bytes_sent - one.forward.bytes_sent},
          {two.backward.ops - one.backward.ops, two.backward.bytes_sent - one.backward.bytes_sent}};
}
inline void expect_block_traffic_is_the_estimators(const hp::models::ModelArgs& args, const CommPtr& g, bool sp,
                                                   const Batch& b) {
  const BlockTraffic got = measured_block_traffic(args, g, sp, b);
  const hp::models::ModelArgs::SummedParams summed = args.tp_summed_params(sp);
  hp::tp::BlockShape shape;
  shape.tp = g->size();
  shape.sequence_parallel = sp;
  shape.tokens = static_cast<double>(b.x.numel());
  shape.row_bytes = static_cast<double>(args.dim()) * 8;
  shape.summed_tensors = summed.tensors;
  shape.summed_elements = static_cast<double>(summed.elements);
  shape.grad_bytes = 8;
  const hp::tp::BlockCost want = hp::tp::block_traffic(shape);
  EXPECT_EQ(static_cast<double>(got.forward.ops), hp::op_count(want.forward));
  EXPECT_EQ(static_cast<double>(got.forward.bytes_sent), hp::bytes_sent(want.forward));
  EXPECT_EQ(static_cast<double>(got.backward.ops), hp::op_count(want.backward));
  EXPECT_EQ(static_cast<double>(got.backward.bytes_sent), hp::bytes_sent(want.backward));
}

}  // namespace hp::test
