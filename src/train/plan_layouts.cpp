// hp-train --plan's ranking (plan.h has the model): enumerate the layouts of a world, then
// cost each by composing its layers' own counts (tp::block_traffic, ep::dispatch_traffic,
// cp::attention_traffic, optim::muon_workload, fsdp's estimate_collectives and
// estimate_memory, the pipeline's simulate) with the compute profile and the link model,
// then sort.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/memory_estimate.h"
#include "hp/optim/muon.h"
#include "hp/pp/schedule.h"
#include "hp/runtime.h"
#include "hp/tp/traffic.h"
#include "hp/train/plan.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"

namespace hp::train {

namespace {

// optimizer: muon. The owner scheme spreads the matrices over the world (each computed
// once): a rank's share of the iterations is the total over the world, at least the largest
// matrix's; each iteration step is optim::newton_schulz_cost multiply-adds of 2 FLOPs.
struct MuonWork {
  std::vector<std::pair<int64_t, int64_t>> shapes;
  double steps = 0;  // Newton-Schulz steps
};

MuonWork muon_work(const TrainConfig& base) {
  MuonWork w;
  w.shapes = muon_matrix_shapes(base);
  w.steps = static_cast<double>(optim::ns_steps(base.muon_ns_coefficients, base.muon_ns_steps).size());
  return w;
}

// What every layout of one plan shares: the world, the node's cores and threads, the links.
struct Setting {
  const TrainConfig& base;
  const PlanOptions& o;
  const ComputeModel& compute;
  int N = 1, cores = 1, per_node = 1, threads = 1;
  double oversubscribed = 1;  // a node running more compute threads than cores
  bool overlap = false;       // fully_shard's, as HP_FSDP_OVERLAP=auto decides
  int64_t memory = 0;
  int64_t experts = 0;
  models::AttentionWidths widths;
  MuonWork muon;

  // The link of a group: the inter-node one when its ranks span nodes. The groups are the
  // trainer's own (ParallelDims), so their placement is the run's.
  LinkModel link_of(const std::vector<int>& ranks) const {
    return o.network.spans_nodes(ranks) ? o.network.inter : o.network.intra;
  }
};

Setting make_setting(const TrainConfig& base, const PlanOptions& o, const ComputeModel& compute) {
  HP_CHECK(o.world >= 1, "--plan: --world must be at least 1, got ", o.world);
  Setting st{base, o, compute};
  st.N = o.world;
  st.cores = o.cores_per_node > 0 ? o.cores_per_node : usable_cores();
  st.per_node = o.network.ranks_per_node > 0 ? std::min(o.network.ranks_per_node, st.N) : st.N;
  st.threads = o.threads_per_rank > 0 ? o.threads_per_rank : std::max(1, st.cores / st.per_node);
  // A node running more compute threads than cores: every rank waits for the slowest.
  st.oversubscribed = o.device ? 1.0
                               : std::max(1.0, static_cast<double>(st.per_node) * st.threads /
                                                   static_cast<double>(st.cores));
  st.overlap = fsdp_overlap_auto(o.device, st.cores, st.per_node, st.threads);
  st.memory = o.memory_per_rank;
  HP_CHECK(st.memory > 0 || !o.device, "plan_layouts: a plan for devices (PlanOptions::device) needs "
           "memory_per_rank: this machine's memory says nothing about a device's");
  if (st.memory == 0) st.memory = memory::available_bytes() / st.per_node;
  st.experts = base.model->routed_experts();
  st.widths = base.model->attention_widths();
  st.muon = muon_work(base);
  return st;
}

// `ops` equal ops of `bytes` in all.
double comm(CommOp op, double bytes, int n, const LinkModel& link, double ops) {
  if (ops <= 0) return 0.0;
  return ops * SimulatedNetwork::seconds(op, static_cast<int64_t>(bytes / ops), n, link);
}

struct Layout {
  int p, t, cpd, r, s, e;
  ShardStrategy z;
};

// Every layout: pp x dp_replicate x dp_shard x cp x tp = N (context_parallel for a family
// with attention widths), and for a model with routed experts every expert_parallel
// dividing both dp_shard x cp and the experts (tensor_parallel 1: expert parallelism beside
// tensor parallelism trains, but is not modelled here yet). Each layout has the config's
// fully_shard strategy; one without a pipeline, with shards and micro-batches, is also
// listed under optim (ZeRO-1: gathered once and reduced once a step, for the memory of the
// whole model and its gradients).
std::vector<Layout> enumerate_layouts(const Setting& st) {
  const int N = st.N;
  std::vector<Layout> layouts;
  for (int p = 1; p <= N; ++p) {
    if (N % p || (st.o.pipeline_parallel > 0 && p != st.o.pipeline_parallel)) continue;
    for (int t = 1; t <= N / p; ++t) {
      if ((N / p) % t || (st.o.tensor_parallel > 0 && t != st.o.tensor_parallel)) continue;
      for (int cpd = 1; cpd <= N / p / t; ++cpd) {
        if ((N / p / t) % cpd || (cpd > 1 && st.widths.kv <= 0)) continue;
        for (int r = 1; r <= N / p / t / cpd; ++r) {
          if ((N / p / t / cpd) % r) continue;
          const int s = N / p / t / cpd / r;
          for (int e = 1; e <= s * cpd; ++e) {
            if ((s * cpd) % e == 0 && (e == 1 || (t == 1 && st.experts > 0 && st.experts % e == 0))) {
              const ShardStrategy z = st.base.data_parallel_shard_strategy;
              layouts.push_back({p, t, cpd, r, s, e, z});
              if (p == 1 && s * cpd > 1 && st.base.micro_batch_num > 1 && z != ShardStrategy::kOptim) {
                layouts.push_back({p, t, cpd, r, s, e, ShardStrategy::kOptim});
              }
            }
          }
        }
      }
    }
  }
  return layouts;
}

// The row of `lay`: the base config at its degrees, validated as a run would be, its memory
// without activations. False (the reason in the row) when it cannot run or cannot fit.
bool admit(const Setting& st, const Layout& lay, PlanRow& row) {
  TrainConfig& c = row.config;
  c = st.base;
  c.data_parallel = lay.r;
  c.data_parallel_shard = lay.s;
  c.context_parallel = lay.cpd;
  if (lay.cpd == 1) c.context_parallel_method = cp::Method::kRing;
  c.tensor_parallel = lay.t;
  c.pipeline_parallel = lay.p;
  c.expert_parallel = lay.e;
  if (lay.z != c.data_parallel_shard_strategy) {
    c.data_parallel_shard_strategy = lay.z;
    c.reshard_after_forward_group_size = 0;
  }
  if (lay.e == 1) c.moe_dispatcher = ep::DispatcherKind::kAllToAll;
  // The configured overlap chunks, at most the experts a rank holds at this degree.
  c.moe_overlap_chunks = lay.e == 1 ? 1 : std::min<int64_t>(c.moe_overlap_chunks, st.experts / lay.e);
  if (lay.t == 1) c.sequence_parallel = false;
  if (lay.p != st.base.pipeline_parallel) c.pipeline_stage_layers.clear();
  if (lay.p == 1) {
    c.pipeline_parallel_interleave_num = 1;
    c.pipeline_schedule = PipelineScheduleKind::kAuto;
  }
  row.threads = st.o.device ? 0 : st.threads;
  row.overlap = st.overlap;
  if (const int64_t m = st.o.micro_batch_samples; m > 0) {
    const int64_t dp = static_cast<int64_t>(lay.r) * lay.s;
    if (c.global_batch_size % (dp * m) != 0) {
      row.reason = detail::str_cat("global_batch_size=", c.global_batch_size, " is not a whole number of micro-batches of ",
                                   m, " sample(s) over ", dp, " data-parallel rank(s)");
      return false;
    }
    c.micro_batch_num = c.global_batch_size / (dp * m);
  }
  try {
    c.validate(st.N);
    row.memory = estimate_rank_memory(c);
  } catch (const std::exception& e) {
    row.reason = e.what();
    const std::string src = st.base.source + ": ";
    if (row.reason.rfind(src, 0) == 0) row.reason = row.reason.substr(src.size());
    return false;
  }
  const double need = std::max(row.memory.construction, static_cast<double>(row.memory.estimate.total()));
  if (st.memory > 0 && need > static_cast<double>(st.memory)) {
    row.reason = "needs " + format_bytes(static_cast<int64_t>(std::min(need, 9e18))) +
                 " per rank without activations; " + format_bytes(st.memory) + " available";
    return false;
  }
  row.feasible = true;
  return true;
}

// One admitted layout's quantities, which its parts' costs share and add to.
struct Costing {
  const TrainConfig& c;
  const Layout lay;
  const ParallelDims dims;
  int64_t m = 1, L = 1;
  ComputeProfile prof;
  double slower = 1;  // oversubscription's slowdown, unless the profile was timed under it
  double act_elem = 0, dim = 0, act_bytes = 0;
  double optimizer = 0;  // seconds
  // Tensor parallelism: the activations kept whole, the compute's scale, a block's exchanges
  // forward and backward.
  double whole = 0, tp_scale = 1, tp_forward = 0, tp_backward = 0;
  double ep_forward = 0, ep_backward = 0;  // per MoE block and micro-batch
  // Context parallelism: compute and activation scales, a block's exchanges per
  // micro-batch, and what of them is exposed.
  double cp_scale = 1;  // of the compute and the activations
  double cp_forward = 0, cp_backward = 0, cp_exposed_forward = 0, cp_exposed_backward = 0;
  double act_layer = 0, act_head = 0;
  int64_t rank_layers = 0, rank_moe = 0;  // the fullest rank's blocks and MoE blocks

  Costing(const TrainConfig& config, const Layout& l) : c(config), lay(l), dims(config.parallel_dims()) {}
  // Rank 0's group of kind `g` (every group of a kind has the same shape).
  LinkModel link_over(const Setting& st, Group g) const { return st.link_of(dims.ranks(g, 0)); }
  // MoE blocks of a pipeline slice.
  int64_t moe_blocks(const models::PipelineSlice& sl) const {
    const int64_t per = c.model->block_expert_params();
    return per > 0 ? c.model->stage_expert_params(sl) / per : 0;
  }
};

// The optimizer over the rank's shards: the experts' over dp_shard x cp / ep, the rest over
// dp_shard x cp. Muon: the rank's share of the iterations at the block's matmul rate (the
// profile's: its matrix products' FLOPs over their time), and the owner scheme's two
// all-to-alls over the world (optim::muon_workload's pieces to their owners and results
// back, fp32, a rank's average share of each), on the critical path between backward and
// the next forward.
void optimizer_cost(const Setting& st, Costing& k, PlanRow& row) {
  const TrainConfig& c = k.c;
  const Layout& y = k.lay;
  const double rank_params = static_cast<double>(row.memory.rank_params);
  k.optimizer = k.prof.optimizer_per_param * (rank_params + static_cast<double>(row.memory.expert_params) * (y.e - 1)) /
                static_cast<double>(y.s * y.cpd);
  if (st.muon.shapes.empty()) return;
  const optim::MuonWorkload w = optim::muon_workload(st.muon.shapes, static_cast<int64_t>(y.s) * y.cpd * y.t, y.r);
  const double tokens = static_cast<double>(c.micro_batch_size() * c.seq_length);
  const double rate = k.prof.matmul_forward_layer > 0
                          ? c.model->flops_per_token(c.seq_length).block * tokens / k.prof.matmul_forward_layer
                          : 0;
  if (rate > 0) k.optimizer += 2.0 * st.muon.steps * std::max(w.cost / st.N, w.largest_cost) / rate;
  if (st.N == 1) return;
  // SimulatedNetwork prices an all-to-all by its input, (n - 1) / n of which leaves the rank.
  const LinkModel world_link = st.N > st.per_node ? st.o.network.inter : st.o.network.intra;
  const auto exchange = [&](double elements) {
    return SimulatedNetwork::seconds(CommOp::kAllToAll, static_cast<int64_t>(elements / (st.N - 1) * 4.0), st.N,
                                     world_link);
  };
  row.optimizer_comm_s = exchange(w.gathered) + exchange(w.given);
}

// Tensor parallelism. Activations a rank keeps: the head's logits split; of a block, the
// inputs of the norms (without sequence parallel) and of the column-parallel products
// (gathered whole) on every rank, the rest split (shares from the shapes). Its compute: the
// matrix products divide by the degree; of the rest (norms, residual adds, elementwise), the
// work on whole activations stays whole on every rank, in the activations' shares
// (BENCHMARKS.md, "The planner after tensor parallel's compute share", has what dividing
// everything predicted). Its exchanges per block and micro-batch are the tp layer's own
// count (tp::block_traffic, from what the family says it sums: ModelArgs::tp_summed_params);
// the embedding and head take a block's.
void tensor_parallel_cost(const Setting& st, Costing& k) {
  const TrainConfig& c = k.c;
  const int t = k.lay.t;
  if (t == 1) return;
  k.whole = (c.sequence_parallel ? 2.0 : 4.0) * k.dim / c.model->activations_per_token(c.seq_length).block;
  const double alone = k.prof.forward_layer / (k.prof.contended ? st.oversubscribed : 1.0);
  const double mm =
      k.prof.matmul_forward_layer > 0 && alone > 0 ? std::min(1.0, k.prof.matmul_forward_layer / alone) : 1.0;
  k.tp_scale = mm / t + (1.0 - mm) * (k.whole + (1.0 - k.whole) / t);
  const models::ModelArgs::SummedParams summed = c.model->tp_summed_params(c.sequence_parallel);
  tp::BlockShape shape;
  shape.tp = t;
  shape.sequence_parallel = c.sequence_parallel;
  shape.tokens = static_cast<double>(c.micro_batch_size() * c.seq_length);
  shape.row_bytes = k.dim * k.act_elem;
  shape.summed_tensors = summed.tensors;
  shape.summed_elements = static_cast<double>(summed.elements);
  shape.grad_bytes = static_cast<double>(c10::elementSize(mixed_precision(c).reduce_dtype.value_or(c.compute_dtype)));
  const tp::BlockCost x = tp::block_traffic(shape);
  const LinkModel tp_link = k.link_over(st, Group::kTp);
  k.tp_forward = seconds(x.forward, tp_link);
  k.tp_backward = seconds(x.backward, tp_link);
}

// Expert parallelism, per MoE block and micro-batch: the dispatcher's all-to-alls over the
// EP group as the ep layer states them (ep::dispatch_traffic), on the critical path; under
// recompute backward runs forward's again. Routing is taken as balanced, and for the
// de-duplicating dispatcher uniform (ep::expected_copies).
//
// The share of the exchange time that ep::overlap_exposure's replay hides which the
// overlapped dispatcher hid when measured: `ep_bench overlap` under the simulated network
// (BENCHMARKS.md, "The all-to-all overlapped with the experts") hid 0.66 to 1.18 of it, the
// least with 4 chunks (each all-to-all's own cost and the ranks' skew, which the replay
// leaves out). The planner credits the least.
constexpr double kOverlapCredit = 0.65;

// One MoE block's exchange of a micro-batch at c's expert_parallel, as the ep layer counts it.
ep::ExchangeShape exchange_shape(const TrainConfig& c) {
  ep::ExchangeShape shape;
  shape.ep = static_cast<int>(c.expert_parallel);
  shape.experts = c.model->routed_experts();
  shape.tokens = static_cast<double>(c.micro_batch_size() * c.seq_length);
  shape.k = c.model->experts_per_token();
  shape.row_bytes = static_cast<double>(c.model->dim() * c10::elementSize(c.compute_dtype));
  shape.weight_bytes = 4.0;  // the router's fp32 weights
  shape.copies = ep::expected_copies(shape.tokens, shape.experts, shape.ep, shape.k);
  shape.chunks = static_cast<int>(c.moe_overlap_chunks);
  return shape;
}

void expert_parallel_cost(const Setting& st, Costing& k) {
  const TrainConfig& c = k.c;
  if (k.lay.e == 1) return;
  const ep::ExchangeShape shape = exchange_shape(c);
  const ep::ExchangeCost x = ep::dispatch_traffic(c.moe_dispatcher, shape);
  const LinkModel ep_link = k.link_over(st, Group::kEp);
  k.ep_forward = seconds(x.forward, ep_link);
  k.ep_backward = seconds(x.backward, ep_link);
  if (shape.chunks > 1) {
    // Overlapped: the counts' exchange exposed, the rows' and outputs' as replayed against
    // the experts' compute (their share of the block's by FLOPs; ep::overlap_exposure).
    const models::FlopCount flops = c.model->flops_per_token(c.seq_length);
    const double scale = k.tp_scale * k.cp_scale / std::max(flops.block, 1.0);
    ep::OverlapTimes t;
    t.chunks = shape.chunks;
    CollectiveCost chunk = x.forward[1];  // one chunk's all-to-all of rows (or outputs)
    chunk.count = 1;
    t.rows = t.outputs = seconds(std::vector<CollectiveCost>{chunk}, ep_link);
    t.experts_forward = k.prof.forward_layer * flops.routed * scale;
    t.experts_backward = k.prof.backward_layer * flops.routed * scale;
    t.shared_forward = k.prof.forward_layer * flops.shared * scale;
    t.shared_backward = k.prof.backward_layer * flops.shared * scale;
    const ep::Exposure e = ep::overlap_exposure(t);
    // Credited at the share of the replay's hidden time that the overlap hid when measured
    // (kOverlapCredit), not all of it.
    const double plain = t.chunks * (t.rows + t.outputs);
    k.ep_forward = seconds(std::vector<CollectiveCost>{x.forward[0]}, ep_link) + plain -
                   kOverlapCredit * (plain - e.forward);
    k.ep_backward = plain - kOverlapCredit * (plain - e.backward);
  }
  // Recomputation exchanges again, but under light, whose blocks keep what the exchange
  // delivered (light_kept_exchange_bytes, counted with the activations) unless it is
  // overlapped.
  if (c.recompute != Recompute::kNone && !(c.recompute == Recompute::kLight && shape.chunks == 1)) {
    k.ep_backward += k.ep_forward;
  }
}

// Context parallelism: each rank computes 1/cp of every block's work (head-tail balances
// attention's) and keeps 1/cp of its activations (attention is the same tiled kernel with
// or without CP: its tiles' workspace is counted with the head's, in layout_cost). Its
// exchanges, per block and micro-batch, are the cp
// layer's own count (cp::attention_traffic): the ring's overlap the block's compute (what
// exceeds it is exposed), the others' are all exposed; under recompute backward runs
// forward's again.
void context_parallel_cost(const Setting& st, Costing& k) {
  const TrainConfig& c = k.c;
  const int cpd = k.lay.cpd;
  k.cp_scale = 1.0 / cpd;
  if (cpd == 1) return;
  const bool recomputed = c.recompute != Recompute::kNone;
  const LinkModel cp_link = k.link_over(st, Group::kCp);
  cp::AttentionShape shape;
  shape.cp = cpd;
  shape.tokens = static_cast<double>(c.micro_batch_size() * (c.seq_length / cpd));
  shape.kv_width = st.widths.kv;
  shape.q_out_width = st.widths.q_out;
  shape.elem_bytes = k.act_elem;
  shape.grad_bytes = 4.0;  // float32 accumulation
  const cp::AttentionCost x = cp::attention_traffic(c.context_parallel_method, shape);
  k.cp_forward = seconds(x.forward, cp_link);
  k.cp_backward = seconds(x.backward, cp_link);
  if (c.context_parallel_method == cp::Method::kRing) {
    const double fwd_block = k.prof.forward_layer * k.tp_scale * k.cp_scale;
    const double bwd_block = k.prof.backward_layer * k.tp_scale * k.cp_scale;
    k.cp_exposed_forward = std::max(0.0, k.cp_forward - fwd_block);
    k.cp_exposed_backward = std::max(0.0, k.cp_backward - bwd_block);
  } else {
    k.cp_exposed_forward = k.cp_forward, k.cp_exposed_backward = k.cp_backward;
  }
  if (recomputed) {  // the forward's exchanges again in backward
    k.cp_backward += k.cp_forward;
    k.cp_exposed_backward += k.cp_exposed_forward;
  }
}

// Without a pipeline: the micro-batches one after the other, each backward freeing what its
// forward kept; tensor parallel's transfers for the blocks and the embedding and head (one
// more of each direction), all exposed like the experts'.
void single_stage_cost(Costing& k, PlanRow& row) {
  const ComputeProfile& prof = k.prof;
  const double m = static_cast<double>(k.m);
  const int64_t L = k.L;
  const double fb = prof.forward_first + prof.backward_first +
                    static_cast<double>(L - 1) * (prof.forward_layer + prof.backward_layer);
  row.compute_s = m * fb * k.tp_scale * k.cp_scale + k.optimizer;
  row.activations = k.act_head + static_cast<double>(L) * k.act_layer;
  row.tp_comm_s = m * (k.tp_forward + k.tp_backward) * static_cast<double>(L + 1);
  row.ep_comm_s = m * (k.ep_forward + k.ep_backward) * static_cast<double>(k.moe_blocks(models::PipelineSlice{}));
  row.cp_comm_s = static_cast<double>(k.m * L) * (k.cp_forward + k.cp_backward);
  row.exposed_s += static_cast<double>(k.m * L) * (k.cp_exposed_forward + k.cp_exposed_backward);
  row.compute_s *= k.slower;
  row.exposed_s += row.tp_comm_s + row.ep_comm_s;
}

// A pipeline's stages: per stage its compute (its blocks, and on the last stage the
// embedding, head and loss: the first block's extra) and the exchanges beside it (tensor
// parallel's of its blocks, the experts' and the ring's exposed ones).
struct StageCosts {
  std::vector<double> f, b, tpf, tpb, epf, epb, cpf, cpb;
};

StageCosts stage_costs(Costing& k, const std::vector<models::PipelineSlice>& slices, const pp::Schedule& sched) {
  const int S = static_cast<int>(slices.size());
  const int64_t L = k.L;
  StageCosts sc;
  for (auto* v : {&sc.f, &sc.b, &sc.tpf, &sc.tpb, &sc.epf, &sc.epb, &sc.cpf, &sc.cpb}) v->resize(static_cast<size_t>(S));
  std::vector<int64_t> layers_of_rank(static_cast<size_t>(k.lay.p), 0), moe_of_rank(static_cast<size_t>(k.lay.p), 0);
  for (int j = 0; j < S; ++j) {
    const auto& sl = slices[static_cast<size_t>(j)];
    const int64_t n = (sl.end_layer < 0 ? L : sl.end_layer) - sl.first_layer;
    layers_of_rank[static_cast<size_t>(sched.rank_of(j))] += n;
    const double extra = j == S - 1 ? 1 : 0;
    const auto K = static_cast<size_t>(j);
    const ComputeProfile& prof = k.prof;
    sc.f[K] = (static_cast<double>(n) * prof.forward_layer + extra * (prof.forward_first - prof.forward_layer)) *
              k.tp_scale * k.cp_scale;
    sc.b[K] = (static_cast<double>(n) * prof.backward_layer + extra * (prof.backward_first - prof.backward_layer)) *
              k.tp_scale * k.cp_scale;
    sc.tpf[K] = k.tp_forward * static_cast<double>(n + extra);
    sc.tpb[K] = k.tp_backward * static_cast<double>(n + extra);
    sc.cpf[K] = k.cp_exposed_forward * static_cast<double>(n);
    sc.cpb[K] = k.cp_exposed_backward * static_cast<double>(n);
    const int64_t moe = k.moe_blocks(sl);
    moe_of_rank[static_cast<size_t>(sched.rank_of(j))] += moe;
    sc.epf[K] = k.ep_forward * static_cast<double>(moe);
    sc.epb[K] = k.ep_backward * static_cast<double>(moe);
  }
  k.rank_layers = *std::max_element(layers_of_rank.begin(), layers_of_rank.end());
  k.rank_moe = *std::max_element(moe_of_rank.begin(), moe_of_rank.end());
  return sc;
}

// With a pipeline: its schedule replayed by pp::simulate with the stage costs, alone and with
// the exchanges (what they add is exposed). Each stage's output (and its gradient back)
// crosses to the next stage's rank: the first hop, stage 0's rank to stage 1's. On
// oversubscribed cores a rank waiting in the bubble leaves its core to the others: the step
// is the schedule's with a core each, or the node's work over its cores, whichever is
// longer. Activations per rank: its largest stage's times the micro-batches it holds at once.
void pipelined_cost(const Setting& st, Costing& k, PlanRow& row) {
  const TrainConfig& c = k.c;
  const int p = k.lay.p, v = static_cast<int>(c.pipeline_parallel_interleave_num), S = p * v;
  const int64_t L = k.L;
  const auto slices = models::split_layers(L, S, c.pipeline_stage_layers);
  const pp::Schedule sched = pipeline_schedule(c);
  const StageCosts sc = stage_costs(k, slices, sched);
  std::vector<int> first_hop = k.dims.ranks(Group::kPp, 0);
  first_hop.resize(std::min<size_t>(first_hop.size(), 2));
  const double hop = SimulatedNetwork::seconds(CommOp::kSend, static_cast<int64_t>(k.act_bytes), 2, st.link_of(first_hop));
  const double free = k.slower / st.oversubscribed;  // scales the profile to a core each
  auto makespan = [&](bool with_comm) {
    pp::Costs all;
    for (size_t j = 0; j < sc.f.size(); ++j) {
      const double extra_f = with_comm ? sc.tpf[j] + hop : 0, extra_b = with_comm ? sc.tpb[j] + hop : 0;
      // The experts' all-to-alls belong to the input's gradient (the weights' own
      // gradients need none).
      const double ep_f = with_comm ? sc.epf[j] + sc.cpf[j] : 0, ep_b = with_comm ? sc.epb[j] + sc.cpb[j] : 0;
      pp::Costs one;
      one.forward = sc.f[j] * free + extra_f + ep_f;
      one.backward = sc.b[j] * free + extra_b + ep_b;
      one.backward_input = sc.b[j] * free / 2 + extra_b + ep_b;
      one.backward_weight = sc.b[j] * free / 2;
      all.per_stage.push_back(one);
    }
    return pp::simulate(sched, all);
  };
  const pp::SimResult alone = makespan(false);
  const pp::SimResult with_comm = makespan(true);
  double bubble = 0, busy = 0;
  for (double b : alone.bubble) bubble += b / static_cast<double>(alone.bubble.size());
  for (double b : alone.busy) busy += b / static_cast<double>(alone.busy.size());
  row.bubble = bubble;
  row.compute_s = std::max(alone.makespan, busy * st.oversubscribed) + k.optimizer * k.slower;
  std::vector<double> stage_act(static_cast<size_t>(p), 0.0);
  for (int j = 0; j < S; ++j) {
    const auto& sl = slices[static_cast<size_t>(j)];
    const int64_t n = (sl.end_layer < 0 ? L : sl.end_layer) - sl.first_layer;
    const double extra = j == S - 1 ? 1 : 0;
    double& a = stage_act[static_cast<size_t>(sched.rank_of(j))];
    a = std::max(a, static_cast<double>(n) * k.act_layer + extra * k.act_head);
  }
  for (int q = 0; q < p; ++q) {
    row.activations = std::max(row.activations, stage_act[static_cast<size_t>(q)] *
                                                    static_cast<double>(alone.peak_in_flight[static_cast<size_t>(q)]));
  }
  const double m = static_cast<double>(k.m);
  row.tp_comm_s = (k.tp_forward + k.tp_backward) * m * static_cast<double>(k.rank_layers + 1);
  row.pp_comm_s = 2.0 * hop * m;
  row.ep_comm_s = (k.ep_forward + k.ep_backward) * m * static_cast<double>(k.rank_moe);
  row.cp_comm_s = (k.cp_forward + k.cp_backward) * m * static_cast<double>(k.rank_layers);
  row.exposed_s += with_comm.makespan - alone.makespan;
}

// One kind of fully_shard unit: `n` groups of `params` in all over `shards` ranks; the time
// of one group's gather, reduce-scatter and all-reduce across replicas, and of all (fsdp's
// own count: once per micro-batch, or once a step where a pipeline keeps its stages'
// parameters). Before each reduction, the flags of which parameters got a gradient (a few
// bytes, latency alone) over the same group.
struct Units {
  double gather = 0, reduce = 0, across = 0, all = 0;
};

Units fsdp_units(const Costing& k, const GroupDtypes& mp, const LinkModel& replicate_link, double params, int64_t n,
                 int shards, const LinkModel& link) {
  Units u;
  if (n <= 0 || shards <= 1) return u;
  const int r = k.lay.r;
  // A pipeline's stages, and the model under optim (ZeRO-1), are gathered and reduced once a
  // step.
  const bool once = k.lay.p > 1 || k.c.data_parallel_shard_strategy == ShardStrategy::kOptim;
  const bool reshard = k.c.data_parallel_shard_strategy == ShardStrategy::kOptimGradsParams && !once;
  const int64_t rounds = once ? 1 : k.m;
  const double ops = static_cast<double>(n);
  u.gather =
      comm(CommOp::kAllGather, params * static_cast<double>(c10::elementSize(mp.all_gather)), shards, link, ops) / ops;
  const double reduce_bytes = params * static_cast<double>(c10::elementSize(mp.reduce));
  u.reduce = comm(CommOp::kReduceScatter, reduce_bytes, shards, link, ops) / ops;
  u.across = comm(CommOp::kAllReduce, reduce_bytes / shards, r, replicate_link, ops) / ops;
  const double shard_flags = SimulatedNetwork::seconds(CommOp::kAllReduce, 64, shards, link);
  const double replicate_flags = SimulatedNetwork::seconds(CommOp::kAllReduce, 64, r, replicate_link);
  const CollectiveCounts counts = estimate_collectives(n, rounds, reshard, r);
  u.all = static_cast<double>(counts.all_gathers) * u.gather +
          static_cast<double>(counts.reduce_scatters) * (u.reduce + shard_flags) +
          static_cast<double>(counts.all_reduces) * (u.across + replicate_flags);
  return u;
}

// fully_shard's collectives, one per group: every block and the root over dp_shard x cp,
// and with expert parallelism each MoE's experts over the expert_shard ranks holding them.
// Overlapped, one group's collectives stay exposed (the first gather, the last reduction),
// and whatever exceeds the compute. Without shards, HSDP's replicas all-reduce the
// gradients (fp32), exposed.
void fully_shard_cost(const Setting& st, const Costing& k, PlanRow& row) {
  const Layout& y = k.lay;
  const LinkModel replicate_link = y.r > 1 ? k.link_over(st, Group::kDpReplicate) : st.o.network.intra;
  const double rank_params = static_cast<double>(row.memory.rank_params);
  if (y.s * y.cpd > 1) {
    const auto mp = resolve_dtypes(mixed_precision(k.c), k.c.params_dtype);
    const double rank_experts = static_cast<double>(row.memory.expert_params);
    const Units dense = fsdp_units(k, mp, replicate_link, rank_params - rank_experts, k.rank_layers + 1, y.s * y.cpd,
                                   k.link_over(st, Group::kShard));
    const Units expert = y.e > 1 ? fsdp_units(k, mp, replicate_link, rank_experts, k.rank_moe, y.s * y.cpd / y.e,
                                              k.link_over(st, Group::kExpertShard))
                                 : Units{};
    row.fsdp_comm_s = dense.all + expert.all;
    const double one = dense.gather + dense.reduce + dense.across + expert.gather + expert.reduce + expert.across;
    row.exposed_s += st.overlap ? one + std::max(0.0, row.fsdp_comm_s - row.compute_s) : row.fsdp_comm_s;
  } else if (y.r > 1) {
    row.fsdp_comm_s = comm(CommOp::kAllReduce, rank_params * 4.0, y.r, replicate_link, 1) *
                      (y.p == 1 ? static_cast<double>(k.m) : 1.0);
    row.exposed_s += row.fsdp_comm_s;
  }
}

// An admitted layout's step: compute, each layer's exchanges, what of them is exposed, and
// whether its state and activations fit.
void cost_layout(const Setting& st, const Layout& lay, PlanRow& row) {
  const TrainConfig& c = row.config;
  Costing k(c, lay);
  k.m = c.micro_batch_num;
  k.L = c.model->layers();
  // Timed with the node's other ranks running beside (sharing caches and memory bandwidth,
  // and the cores when they outnumber them), when ranks share this node.
  k.prof = st.compute(c.micro_batch_size(), st.threads, st.o.device ? 1 : st.per_node);
  k.slower = k.prof.contended ? 1.0 : st.oversubscribed;
  row.compute_source = k.prof.source;
  optimizer_cost(st, k, row);
  k.act_elem = static_cast<double>(c10::elementSize(c.compute_dtype));
  k.dim = static_cast<double>(c.model->dim());
  k.act_bytes = static_cast<double>(c.micro_batch_size() * c.seq_length) * k.dim * k.act_elem;
  tensor_parallel_cost(st, k);
  expert_parallel_cost(st, k);
  context_parallel_cost(st, k);
  const int t = lay.t, cpd = lay.cpd;
  k.act_layer = k.prof.activations_layer * (k.whole + (1.0 - k.whole) / t) * k.cp_scale;
  // What light recompute keeps of the MoE blocks' exchanges, spread over the layers as the
  // profile's per-layer figure is.
  k.act_layer += light_kept_exchange_bytes(c) * static_cast<double>(k.moe_blocks(models::PipelineSlice{})) /
                 static_cast<double>(k.L);
  // The head's share divides by tp and cp, but for attention's tiles while a block
  // computes (float32, per sequence: the family's attention_workspace, in the profile's
  // head once): their size does not shrink with the rank's tokens, only their heads with
  // tensor parallelism (and with cp under Ulysses, which splits heads).
  const double workspace = static_cast<double>(c.micro_batch_size()) *
                           c.model->activations_per_token(c.seq_length).attention_workspace * 4.0;
  const int head_split = c.context_parallel_method == cp::Method::kUlysses ? cpd : 1;
  k.act_head = std::max(0.0, k.prof.activations_first - k.prof.activations_layer) / t / cpd +
               workspace / t * (1.0 / head_split - 1.0 / cpd);
  k.rank_layers = k.L;
  k.rank_moe = k.moe_blocks(models::PipelineSlice{});
  if (lay.p == 1) {
    single_stage_cost(k, row);
  } else {
    pipelined_cost(st, k, row);
  }
  fully_shard_cost(st, k, row);
  row.exposed_s += row.optimizer_comm_s;
  // The gradient norm, the loss and the step time: three small all-reduces over the world.
  row.exposed_s += 3 * SimulatedNetwork::seconds(CommOp::kAllReduce, 16, st.N,
                                                 st.N > st.per_node ? st.o.network.inter : st.o.network.intra);
  row.step_s = row.compute_s + row.exposed_s;
  const double state = static_cast<double>(row.memory.estimate.total());
  if (st.memory > 0 && state + row.activations > static_cast<double>(st.memory)) {
    row.feasible = false;
    row.reason = "needs " + format_bytes(static_cast<int64_t>(std::min(state + row.activations, 9e18))) +
                 " per rank (" + format_bytes(static_cast<int64_t>(state)) + " state, " +
                 format_bytes(static_cast<int64_t>(std::min(row.activations, 9e18))) + " activations); " +
                 format_bytes(st.memory) + " available";
  }
}

}  // namespace

double light_kept_exchange_bytes(const TrainConfig& c) {
  if (c.expert_parallel <= 1 || c.recompute != Recompute::kLight) return 0;
  return ep::light_kept_bytes(c.moe_dispatcher, exchange_shape(c)) / static_cast<double>(c.context_parallel);
}

std::vector<PlanRow> plan_layouts(const TrainConfig& base, const PlanOptions& o, const ComputeModel& compute) {
  const Setting st = make_setting(base, o, compute);
  std::vector<PlanRow> rows;
  for (const Layout& lay : enumerate_layouts(st)) {
    PlanRow row;
    if (admit(st, lay, row)) cost_layout(st, lay, row);
    rows.push_back(std::move(row));
  }
  std::stable_sort(rows.begin(), rows.end(), [](const PlanRow& a, const PlanRow& b) {
    if (a.feasible != b.feasible) return a.feasible;
    return a.feasible && a.step_s < b.step_s;
  });
  return rows;
}

}  // namespace hp::train
