// hp-train --plan: every layout of a config over a world of N ranks, with its per-rank
// memory and a predicted step time, ranked.
//
// A layout is data_parallel x data_parallel_shard x context_parallel x tensor_parallel x
// pipeline_parallel = N (context_parallel for a family with attention widths) with, for a
// model with routed experts, an expert_parallel dividing data_parallel_shard x
// context_parallel and the experts (tensor_parallel 1) (the config's other settings kept). Each is validated as a run would be (the reason shown
// when it is not), sized with estimate_rank_memory(), and timed by a model:
//
//   compute   each rank's forward and backward of its micro-batches, from a ComputeProfile
//             (measured on this machine at the rank's thread count, as many copies at once
//             as ranks share a node, so that their shared caches, memory bandwidth and, when
//             they outnumber the cores, time slices are in it; or counted in FLOPs at a given
//             throughput, times the oversubscription), divided by
//             tensor_parallel; a pipeline's step is its schedule replayed by
//             hp::pp::simulate with the stage costs (with oversubscribed cores, at least the
//             node's work over its cores); plus the optimizer over the rank's shard.
//   comm      the collectives of each layout through the link model of hp/comm/simulated_
//             network.h (alpha + bus factor x bytes / bandwidth, intra- or inter-node by the
//             group's span on the mesh (pp, dp_replicate, dp_shard, tp)): fully_shard's
//             all-gathers (twice per micro-batch when it reshards after forward) and
//             reduce-scatters (once per step under a pipeline), HSDP's all-reduce over
//             replicas, tensor parallelism's 4 per block and direction (all-gather and
//             reduce-scatter with sequence parallel, all-reduce without), the pipeline's
//             activation transfers; expert parallelism's all-to-alls per MoE block (the
//             dispatcher's, forward and backward, again under recompute) over the EP group,
//             and the experts' fully_shard collectives over dp_shard / ep; context
//             parallelism's per block (ring: cp-1 K/V blocks forward, 2cp-1 backward,
//             overlapping the block's compute; all-gather: a gather forward, a gather
//             and a reduce-scatter backward; Ulysses: 4 all-to-alls each way), its
//             compute 1/cp of the block's, fully_shard over dp_shard x cp.
//   optimizer AdamW per parameter of the rank's shard (the profile's); with optimizer: muon,
//             the Newton-Schulz iterations of a rank's share of the matrices (the world's
//             total over its ranks, at least the largest matrix) at the profile's matmul
//             rate, and the owner scheme's two all-to-alls of a rank's pieces (fp32) over
//             the world, exposed.
//   exposed   tensor, pipeline and expert transfers always; fully_shard's all of it without
//             overlap, else one block's gather and reduce-scatter plus what exceeds compute.
//             Overlap follows HP_FSDP_OVERLAP=auto: on with a GPU (a given device), or when
//             every rank has a core to spare for its communication thread.
//
// Memory: the sharded state (estimate_rank_memory; a pipeline's stages counted whole, as it
// keeps them gathered through the step) plus the activations a rank holds at
// its peak: one micro-batch's (the profile's, divided by tensor_parallel, and by
// context_parallel less attention's probabilities, which the block-wise attention of
// context parallelism does not keep) without a
// pipeline; with one, its stages' times the most micro-batches the schedule keeps in
// flight on a rank (hp::pp::simulate).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hp/comm/simulated_network.h"
#include "hp/fsdp/memory_estimate.h"
#include "hp/train/config.h"

namespace hp::train {

// Per-rank memory of the (validated) config's layout, without activations: what --estimate
// prints. `stage_counts`: with pipeline_parallel > 1, the parameters of each stage.
struct RankMemory {
  MemoryEstimate estimate;
  std::vector<int64_t> stage_counts;
  int64_t rank_params = 0;   // parameters a rank holds before fully_shard
  // Of them, its routed experts (with expert_parallel > 1; 0 otherwise), sharded over the
  // dp_shard / expert_parallel ranks holding the same experts, the rest over dp_shard.
  int64_t expert_params = 0;
  double construction = 0;   // bytes while building the model: its shards + one fp32 parameter
};
RankMemory estimate_rank_memory(const TrainConfig& c);
// hp-train --estimate's report of `rm` (lines: parameters, per tensor-parallel rank, per
// pipeline stage, per rank without activations, while building the model).
std::string describe_estimate(const TrainConfig& c, const RankMemory& rm);
// Under recompute light with expert_parallel > 1: the bytes a rank keeps per MoE block and
// micro-batch of what the experts' exchange delivered (ep::light_kept_bytes at this config's
// shape, the rank's 1/context_parallel of the tokens); 0 otherwise. --estimate prints it and
// --plan adds it to the activations.
double light_kept_exchange_bytes(const TrainConfig& c);
// Raises naming the sizes when this node's available memory cannot hold local_ranks ranks
// of `rm` (each building the model, then training); does nothing where the available memory
// is unknown.
void check_fits_node(const TrainConfig& c, const RankMemory& rm, int local_ranks);

// Seconds of one micro-batch of `samples` sequences on one rank of one process (whole
// model, no parallelism), as t(L) = first + (L - 1) x layer: `first` holds the embedding,
// the head, the loss and the first block.
struct ComputeProfile {
  double forward_first = 0, forward_layer = 0;
  double backward_first = 0, backward_layer = 0;
  double optimizer_per_param = 0;  // AdamW, gradient norm and clipping, per parameter
  // Of forward_layer, the block's matrix products alone (its FLOPs at this process's
  // measured matmul rate, uncontended): what tensor parallelism divides by its degree.
  // 0: unknown, the whole block is taken to divide.
  double matmul_forward_layer = 0;
  bool contended = false;          // timed with the node's ranks sharing its cores
  // Bytes a micro-batch's forward holds for its backward, at its peak (logits and loss
  // included), in the same t(L) form: measured with the counting allocator when timed,
  // else counted from the shapes (each block's saved activations, the head's logits).
  double activations_first = 0, activations_layer = 0;
  std::string source;              // how it was obtained, for the report
};
// (micro-batch samples, compute threads, copies) -> profile; copies: the ranks that share
// the node (timed running at once).
using ComputeModel = std::function<ComputeProfile(int64_t samples, int threads, int copies)>;

// Times the config's model in this process (1 layer and the whole depth, or as many as fit,
// at least 2; compute dtype; recompute counted), in `copies` threads at once, memoized;
// falls back to counting FLOPs at the measured
// fp32 matmul throughput of the model's shapes when two layers would not fit in
// `budget_bytes`. `device_tflops` > 0: FLOPs at that throughput (x 0.5, the utilization
// assumed for a device not measured), no measurement.
ComputeModel measured_compute(const TrainConfig& c, double device_tflops = 0, int64_t budget_bytes = int64_t{1} << 30);

// The link between ranks of this machine (shared memory): 20 us per op, and half this
// process's single-thread copy bandwidth (the bytes are copied in and out), measured now.
SimulatedNetwork measured_local_link();

struct PlanOptions {
  int world = 1;
  SimulatedNetwork network;   // the links (ranks_per_node 0: every rank on one node)
  int cores_per_node = 0;     // compute threads a node offers (0: this machine's usable cores)
  int threads_per_rank = 0;   // 0: cores / ranks on a node, at least 1 (as hp::init picks)
  bool device = false;        // ranks drive a GPU each (NCCL): overlap is on, no oversubscription
  int64_t memory_per_rank = 0;  // bytes; 0: this machine's available memory / ranks on a node (required with device)
  // Held fixed (a relaunch onto another world, elastic_layout): only layouts with this
  // tensor_parallel and pipeline_parallel (0: any), and with micro_batch_samples > 0 each
  // layout's micro_batch_num set so that a micro-batch holds that many samples per
  // data-parallel rank (the global batch kept; a layout it does not divide is listed, not
  // feasible).
  int64_t tensor_parallel = 0, pipeline_parallel = 0;
  int64_t micro_batch_samples = 0;
};

struct PlanRow {
  TrainConfig config;  // validated, with the layout set
  bool feasible = false;
  std::string reason;  // why not (or the memory headroom)
  RankMemory memory;
  double activations = 0;  // bytes per rank at the peak (see above)
  int threads = 1;  // compute threads per rank (0: a device per rank)
  bool overlap = false;
  double compute_s = 0, fsdp_comm_s = 0, tp_comm_s = 0, pp_comm_s = 0, ep_comm_s = 0, cp_comm_s = 0, exposed_s = 0,
         bubble = 0;
  double optimizer_comm_s = 0;  // Muon's owner scheme (its two all-to-alls), in exposed_s
  double step_s = 0;
  std::string compute_source;  // ComputeProfile::source
  // "dp_replicate=1 dp_shard=2 tp=1 pp=1", with " cp=K" after dp_shard under context
  // parallelism and " ep=E" for a model with routed experts.
  std::string layout() const;
};

// Every layout of `base` over o.world ranks: the feasible ones fastest first, then the others.
std::vector<PlanRow> plan_layouts(const TrainConfig& base, const PlanOptions& o, const ComputeModel& compute);

// The table hp-train --plan prints, and the same as JSON lines (one object per row).
std::string format_plan(const std::vector<PlanRow>& rows);
std::string plan_json(const std::vector<PlanRow>& rows);

}  // namespace hp::train
