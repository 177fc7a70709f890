#include "parallelize.h"

#include "hp/core/error.h"
#include "hp/models/family.h"
#include "hp/models/llama.h"  // parameter_initializer
#include "hp/tp/dtensor.h"

namespace hp::train::internal {

namespace {

// fully_shard's options for the config's dense units.
FullyShardOptions dense_options(const TrainConfig& c, TrainModel& m, const ParallelMesh& mesh, c10::Device device) {
  FullyShardOptions o;
  o.param_init = models::parameter_initializer(m.root(), c.seed);
  o.device = device;  // the model is built on the host, without storage: its shards go there
  o.mesh = mesh.fsdp_mesh();
  o.reshard_after_forward = c.data_parallel_shard_strategy == ShardStrategy::kOptimGradsParams;
  o.reshard_after_forward_group_size = static_cast<int>(c.reshard_after_forward_group_size);
  o.comm_fusion = c.comm_fusion;
  o.mp_policy = mixed_precision(c);
  return o;
}

// The records of the parameters of `out.handles[first..]`, named by their modules' place in
// `root`; those of the handles before `pieces_end` (experts spread over tp) are tp pieces.
void add_records(torch::nn::Module& root, size_t first, size_t pieces_end, int stage, ShardedModel& out) {
  for (size_t k = first; k < out.handles.size(); ++k) {
    const FSDPHandle& h = out.handles[k];
    // The module's name in the model ("layers_3."), for the whole model's parameter names.
    std::string prefix;
    for (const auto& item : root.named_modules("", /*include_self=*/false)) {
      if (item.value().get() == &h->module()) prefix = item.key() + ".";
    }
    const std::vector<at::Tensor> sharded = h->parameters();
    const std::vector<ShardedTensor> entries = h->state_dict();
    auto module_params = h->module().named_parameters();
    HP_INTERNAL_ASSERT(sharded.size() == entries.size(), "fully_shard handle: parameters and state_dict differ");
    for (size_t i = 0; i < sharded.size(); ++i) {
      ShardedParam r;
      r.param = sharded[i];
      r.name = prefix + entries[i].name;
      r.box = entries[i].spec;
      r.tp_piece = tp::parameter_spec(module_params[entries[i].name]) || k < pieces_end;
      r.main_grad = h->main_grads()[i];
      r.stage = stage;
      out.params.push_back(std::move(r));
    }
  }
}

}  // namespace

void parallelize(TrainModel& m, const TrainConfig& c, const ParallelMesh& mesh,
                 const std::shared_ptr<cp::ContextParallel>& context, c10::Device device, int stage,
                 ShardedModel& out) {
  // Expert parallelism first: tensor parallelism then keeps the placed experts whole.
  if (c.expert_parallel > 1) m.expert_parallel(mesh.group(Group::kEp), {c.moe_dispatcher, c.moe_overlap_chunks});
  if (context) m.context_parallel(context);
  if (c.tensor_parallel > 1) {
    // Before fully_shard, which then shards each rank's pieces; the initializer reads each
    // piece's box of the global tensor.
    m.parallelize(mesh.group(Group::kTp), c.sequence_parallel, mixed_precision(c).reduce_dtype);
  }
  const FullyShardOptions o = dense_options(c, m, mesh, device);
  const size_t first = out.handles.size();
  FullyShardOptions block_o = o;
  // The blocks only: the root's gather is small, and a tied head on a pipeline's last stage
  // reads the embedding's weight without the embedding's call (safe today only because the
  // schedule gathers each stage's root before its micro-batches).
  block_o.wait_per_submodule = c.wait_per_submodule;
  if (c.expert_parallel > 1) {
    // Each MoE's experts: a unit of their own over the ranks holding the same experts. An
    // expert's gradient already sums every EP rank's tokens (they came through the
    // all-to-all), so it is divided by the whole data degree, not by that group's size (nor
    // by tp's: each tp rank's tokens are its own piece of the sequence).
    FullyShardOptions expert_o = o;
    expert_o.mesh = mesh.expert_fsdp_mesh();
    for (torch::nn::Module* e : m.expert_modules()) {
      out.handles.push_back(fully_shard(*e, expert_o));
      out.handles.back()->set_gradient_divide_factor(static_cast<double>(c.dp_size() * c.context_parallel));
    }
  }
  // Under tensor parallelism the experts an EP group spreads over the tp ranks differ
  // between them, as split pieces do: the gradient norm sums them over tp too.
  const size_t experts_end = c.tensor_parallel > 1 ? out.handles.size() : first;
  for (torch::nn::Module* b : m.blocks()) out.handles.push_back(fully_shard(*b, block_o));
  out.handles.push_back(fully_shard(m.root(), o));
  materialize_deferred_buffers(m.root(), device);
  out.roots.push_back(&m.root());
  add_records(m.root(), first, experts_end, stage, out);
}

}  // namespace hp::train::internal
