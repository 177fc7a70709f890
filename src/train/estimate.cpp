// The memory of a config's layout per rank, from sizes alone (nothing allocated): the
// figures, hp-train --estimate's report of them, and the check that a node can hold its ranks.
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/pp/schedule.h"
#include "hp/train/plan.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"

namespace hp::train {

RankMemory estimate_rank_memory(const TrainConfig& c) {
  RankMemory r;
  const int64_t ep = c.expert_parallel;
  // Under tensor parallelism fully_shard shards each tp rank's pieces. Under pipeline
  // parallelism a rank holds its stages only: the fullest pp rank's share, with tensor
  // parallelism dividing it as it divides the whole model.
  r.rank_params = c.model->params_per_tp_rank(c.tensor_parallel);
  int64_t experts = ep > 1 ? c.model->stage_expert_params(models::PipelineSlice{}) : 0;
  if (c.pipeline_parallel > 1) {
    r.stage_counts = stage_params(c);
    const pp::Schedule sched = pipeline_schedule(c);
    const auto slices = models::split_layers(c.model->layers(), static_cast<int>(r.stage_counts.size()),
                                             c.pipeline_stage_layers);
    std::vector<int64_t> held(static_cast<size_t>(c.pipeline_parallel), 0), held_experts(held.size(), 0);
    for (size_t k = 0; k < r.stage_counts.size(); ++k) {
      const auto q = static_cast<size_t>(sched.rank_of(static_cast<int>(k)));
      held[q] += r.stage_counts[k];
      if (ep > 1) held_experts[q] += c.model->stage_expert_params(slices[k]);
    }
    const size_t fullest = static_cast<size_t>(std::max_element(held.begin(), held.end()) - held.begin());
    r.rank_params = static_cast<int64_t>(static_cast<double>(held[fullest]) * static_cast<double>(r.rank_params) /
                                         static_cast<double>(c.model->num_params()));
    experts = held_experts[fullest];
  }
  const auto mp = mixed_precision(c);
  // optim_grads keeps parameters gathered until backward: a group of 1.
  const int64_t group =
      c.data_parallel_shard_strategy == ShardStrategy::kOptimGradsParams ? c.reshard_after_forward_group_size : 1;
  // A pipeline's stages stay whole through the step, and under optim the whole model does,
  // with its unsharded gradients.
  // (With one micro-batch optim holds nothing longer than optim_grads does.)
  const bool pipeline = c.pipeline_parallel > 1 ||
                        (c.data_parallel_shard_strategy == ShardStrategy::kOptim && c.micro_batch_num > 1);
  // fully_shard's groups, as the trainer makes them: the dense parameters over dp_shard x
  // cp, the routed experts over the expert_shard ranks holding the same experts.
  const ParallelDims dims = c.parallel_dims();
  const int64_t shard = dims.size(Group::kShard);
  if (ep == 1) {
    r.estimate = estimate_memory(r.rank_params, c.model->largest_block_params_per_tp_rank(c.tensor_parallel),
                                 c.params_dtype, mp, {c.data_parallel, shard, group, pipeline});
  } else {
    // Two kinds of fully_shard unit: the rest of the model over dp_shard x cp, and each MoE's
    // experts (1/ep of them, whole) over the dp_shard x cp x tp / ep ranks holding the same ones.
    // A block's forward runs its experts inside it, so backward holds one of each at its
    // peak. The tensor-parallel share counted every expert split over tp; beside expert
    // parallelism the routed experts are placed whole and the shared ones replicated.
    const int64_t tp = c.tensor_parallel;
    const int64_t per_block = c.model->block_expert_params();
    const int64_t shared = per_block > 0 ? experts / per_block * c.model->block_shared_expert_params() : 0;
    const int64_t dense = r.rank_params - experts / tp + shared - shared / tp;
    r.expert_params = experts / ep;
    r.rank_params = dense + r.expert_params;
    const MemoryEstimate d =
        estimate_memory(dense, std::min(dense, c.model->largest_block_params_outside_experts()), c.params_dtype, mp,
                        {c.data_parallel, shard, group, pipeline});
    const MemoryEstimate e =
        estimate_memory(r.expert_params, std::min(r.expert_params, c.model->block_expert_params() / ep), c.params_dtype,
                        mp, {c.data_parallel, dims.size(Group::kExpertShard), group, pipeline});
    r.estimate = d;
    r.estimate.params += e.params;
    r.estimate.sharded_params += e.sharded_params;
    r.estimate.sharded_grads += e.sharded_grads;
    r.estimate.optimizer_state += e.optimizer_state;
    r.estimate.fp32_masters += e.fp32_masters;
    r.estimate.backward_peak_extra += e.backward_peak_extra;
    r.estimate.post_forward_shares += e.post_forward_shares;
  }
  if (c.optimizer == OptimizerKind::kMuon) {
    // Muon keeps one buffer (its momentum) where AdamW keeps two: the matrices it takes are
    // all parameters but the token tables (the embedding and an untied head) and the norms
    // and vectors, which are left out of this share (a fraction of a percent).
    const double tables = static_cast<double>(c.model->vocab()) * static_cast<double>(c.model->dim()) *
                          (c.model->tied_parameters().empty() ? 2.0 : 1.0);
    const double f = std::clamp(1.0 - tables / static_cast<double>(c.model->num_params()), 0.0, 1.0);
    r.estimate.optimizer_state = static_cast<int64_t>(static_cast<double>(r.estimate.optimizer_state) * (1.0 - f / 2));
  }
  // Each rank builds the model without storage and materializes its shards one parameter at
  // a time: its shards plus the largest parameter in fp32 (and its low-precision cast).
  const double largest = 4.0 * static_cast<double>(c.model->largest_param());
  r.construction = static_cast<double>(r.estimate.sharded_params) + largest * (c.params_dtype == at::kFloat ? 1 : 2);
  return r;
}

std::string describe_estimate(const TrainConfig& c, const RankMemory& rm) {
  const MemoryEstimate& est = rm.estimate;
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "parameters: %lld (%.3g B); largest block %lld\n",
                static_cast<long long>(c.model->num_params()), static_cast<double>(c.model->num_params()) / 1e9,
                static_cast<long long>(c.model->largest_block_params()));
  os << line;
  if (c.tensor_parallel > 1) {
    std::snprintf(line, sizeof line,
                  "per tensor-parallel rank, before fully_shard: %lld parameters, largest block %lld (%s whole)\n",
                  static_cast<long long>(c.model->params_per_tp_rank(c.tensor_parallel)),
                  static_cast<long long>(c.model->largest_block_params_per_tp_rank(c.tensor_parallel)),
                  c.model->whole_under_tp().c_str());
    os << line;
  }
  if (!rm.stage_counts.empty()) {
    os << "pipeline: " << rm.stage_counts.size() << " stages, parameters per stage (before tensor parallelism):";
    for (int64_t n : rm.stage_counts) os << " " << n;
    if (c.pipeline_schedule == PipelineScheduleKind::kZBV || c.pipeline_schedule == PipelineScheduleKind::kDualPipeV) {
      os << "; rank r holds stages r and " << rm.stage_counts.size() - 1 << " - r\n";
    } else {
      os << "; a rank holds stages r, r + " << c.pipeline_parallel << ", ...\n";
    }
  }
  if (c.expert_parallel > 1) {
    os << "expert parallel " << c.expert_parallel << ": a rank holds " << rm.expert_params
       << " routed-expert parameters before fully_shard (1/" << c.expert_parallel << " of its stages', whole), sharded over "
       << c.parallel_dims().size(Group::kExpertShard) << " ranks, and " << rm.rank_params - rm.expert_params
       << " others, sharded over " << c.parallel_dims().size(Group::kShard) << "\n";
  }
  if (c.pipeline_parallel > 1) {
    os << "pipeline: a rank's stages stay gathered (with their unsharded gradients) from their first micro-batch to "
          "their last: " << rm.rank_params << " parameters\n";
  } else if (c.data_parallel_shard_strategy == ShardStrategy::kOptim && c.micro_batch_num > 1) {
    os << "optim (ZeRO-1): the model stays gathered (with its unsharded gradients) from the first micro-batch to the "
          "last: " << rm.rank_params << " parameters\n";
  }
  os << "per rank, without activations: sharded params " << format_bytes(est.sharded_params) << ", grads "
     << format_bytes(est.sharded_grads) << ", optimizer " << format_bytes(est.optimizer_state) << ", fp32 masters "
     << format_bytes(est.fp32_masters) << ", backward peak " << format_bytes(est.backward_peak_extra)
     << (est.post_forward_shares ? ", kept from forward to backward " + format_bytes(est.post_forward_shares) : "")
     << "; total " << format_bytes(est.total()) << "\n";
  os << "per rank while building the model: its shards plus one parameter in fp32 (the largest, "
     << c.model->largest_param() << " elements): " << format_bytes(static_cast<int64_t>(std::min(rm.construction, 9e18)))
     << "\n";
  // One micro-batch's activations as the family counts them (what --plan uses for a model it
  // does not time): attention keeps no S x S (hp/attn), only its tiles while computing.
  const models::ActivationCount a = c.model->activations_per_token(c.seq_length);
  const double tokens = static_cast<double>(c.micro_batch_size() * c.seq_length);
  const double elem = static_cast<double>(c10::elementSize(c.compute_dtype));
  os << "activations of one micro-batch (" << c.micro_batch_size() << " x " << c.seq_length
     << " tokens, counted from the shapes, before tensor or context parallelism): a block keeps "
     << format_bytes(static_cast<int64_t>(tokens * elem * a.block)) << " (attention: its output and "
     << format_bytes(static_cast<int64_t>(tokens * 4.0 * a.attention))
     << " of log-sum-exps, no S x S; recompute full keeps its input, "
     << format_bytes(static_cast<int64_t>(tokens * elem * static_cast<double>(c.model->dim()))) << ", light "
     << format_bytes(static_cast<int64_t>(tokens * elem * a.light)) << "), its attention tiles hold "
     << format_bytes(static_cast<int64_t>(static_cast<double>(c.micro_batch_size()) * a.attention_workspace * 4.0))
     << " while it computes (model.attention_tile)\n";
  if (const double kept = light_kept_exchange_bytes(c); kept > 0) {
    os << "recompute light under expert parallelism also keeps, per MoE block, what the experts' exchange delivered "
          "(the rows received and the outputs returned, balanced routing): "
       << format_bytes(static_cast<int64_t>(kept)) << "\n";
  }
  os << "activations per layout: hp-train --plan measures them (and predicts the step time) for every layout";
  return os.str();
}

void check_fits_node(const TrainConfig& c, const RankMemory& rm, int local_ranks) {
  // Each rank builds the model without storage and materializes its shards one parameter at
  // a time: the sharded state plus one fp32 parameter, then training's.
  const double need = std::max(rm.construction, static_cast<double>(rm.estimate.total()));
  const double avail = static_cast<double>(memory::available_bytes());
  HP_CHECK(avail == 0 || need * local_ranks < avail, "the model (", c.model->num_params(), " parameters) needs about ",
           format_bytes(static_cast<int64_t>(std::min(need, 9e18))), " per rank (", format_bytes(rm.estimate.total()),
           " sharded, without activations), but this node has ", format_bytes(static_cast<int64_t>(avail)),
           " available for ", local_ranks, " rank(s); see hp-train --estimate");
}

}  // namespace hp::train
