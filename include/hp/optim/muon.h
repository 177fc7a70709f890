// Muon: momentum orthogonalized by a Newton–Schulz iteration, for the hidden weight
// matrices, beside AdamW for everything else, in one optimizer object.
//
// Per matrix W of A x B (rows x columns, as a Linear's weight [out, in]) with gradient g:
//   momentum   M <- mu M + g;  the direction D = g + mu M (Nesterov) or M;
//   orthogonalize  O = NS(D): transposed so that rows <= columns, X = D / (|D|_F + eps),
//              then for each step's (a, b, c): X <- a X + (b X X^T + c (X X^T)^2) X,
//              in `ns_dtype` (bf16 by default);
//   update     W <- W (1 - lr wd) - lr s(A, B) O.
// Weight decay uses the unscaled lr; s(A, B) is the update scale (below).
//
// NS maps each singular value sigma of D / |D|_F through the same odd polynomial per step
// and keeps the singular vectors: O = U p(Sigma) V^T. A coefficient schedule is chosen
// for the band it leaves the singular values in (NsSchedule).
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hp/comm/communicator.h"
#include "hp/optim/muon_kinds.h"
#include "hp/mesh/shard_spec.h"

namespace hp::optim {

// One Newton–Schulz step's polynomial: x -> a x + b x^3 + c x^5 on the singular values.
struct NsStep {
  double a, b, c;
};

// The schedule's steps; `steps` 0 takes its own count. kQuintic takes any count >= 1; the
// others only their own (5, 10): another raises naming both.
std::vector<NsStep> ns_steps(NsSchedule schedule, int64_t steps = 0);

// NS of each matrix in the last two dims of `d` (leading dims are a batch), computed in
// `dtype` and returned in it.
at::Tensor newton_schulz(const at::Tensor& d, const std::vector<NsStep>& steps, at::ScalarType dtype,
                         double eps = 1e-7);

// The update scale s(A, B) of an A x B matrix (MuonScale in hp/optim/muon_kinds.h).
double muon_scale(MuonScale scale, int64_t rows, int64_t cols, double rms_target = 0.2);

struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 2e-2);  // NOLINT(google-explicit-constructor): as libtorch's options
  TORCH_ARG(double, lr) = 2e-2;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(std::vector<NsStep>, ns) = ns_steps(NsSchedule::kQuintic);
  TORCH_ARG(at::ScalarType, ns_dtype) = at::kBFloat16;
  TORCH_ARG(MuonScale, scale) = MuonScale::kRms;
  TORCH_ARG(double, rms_target) = 0.2;
  TORCH_ARG(double, eps) = 1e-7;

  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct MuonParamState : public torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, momentum_buffer);
};

// Which optimizer each parameter goes to, by name: the first rule that matches decides.
// 1. a name matching `to_adamw` -> AdamW; 2. matching `to_muon` -> Muon (a matrix only);
// 3. otherwise a 2-D parameter -> Muon, anything else (norm scales, biases, vectors,
// scalars) -> AdamW. Patterns match whole names; `*` matches any run of characters. The
// model supplies its embeddings and output head as `to_adamw` (they are 2-D, but each row
// or column is a token's, not a direction of a linear map).
struct MuonRouting {
  std::vector<std::string> to_adamw;
  std::vector<std::string> to_muon;
};
// True for each parameter routed to Muon. Raises naming the parameter and its shape for a
// `to_muon` match that is not 2-D (not supported yet).
std::vector<bool> route_to_muon(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                const MuonRouting& routing);
// `*` wildcards, whole-name match.
bool matches_pattern(const std::string& name, const std::string& pattern);

// A Muon parameter that is one rank's piece of a larger matrix (a shard of fully_shard, of
// tensor parallelism, or both): the matrix's name, the same on every rank holding a piece
// of it, and the box (ShardSpec: the 2-D global shape, this rank's offsets and lengths;
// the piece's shape is the lengths). Ranks may hold the same box (data-parallel replicas).
struct MatrixPiece {
  at::Tensor param;
  std::string name;
  ShardSpec box;
};


// What the plan of a distributed Muon comes to on this rank: for --estimate and the tests.
struct MuonPlanStats {
  int64_t matrices = 0;        // distinct matrices in the job
  int64_t owned = 0;           // those this rank orthogonalizes
  double owned_cost = 0;       // their cost per iteration step: s^2 x (2 l + s) multiply-adds
  int64_t send_elements = 0;   // elements this rank sends per step (both all-to-alls)
  int64_t recv_elements = 0;   // ... and receives
};

// What the owner scheme comes to per step, summed over the job, for matrices of `shapes`
// (rows, cols) each split in `shards` equal pieces, each piece held by `replicas` ranks
// (fully_shard's and tensor parallelism's pieces; HSDP's replicas): a pure count beside the
// plan, which the planner prices (hp-train --plan) and muon_dist_test checks against the
// sum of every rank's plan_stats().
struct MuonWorkload {
  int64_t matrices = 0;
  double cost = 0;          // s^2 x (2 l + s) multiply-adds per iteration step, all matrices
  double largest_cost = 0;  // ... of the costliest one
  double elements = 0;      // rows x cols, all matrices
  double gathered = 0;      // elements sent to the owners (one piece of each other box)
  double given = 0;         // ... and of the results back (to every other holder)
};
MuonWorkload muon_workload(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t shards, int64_t replicas);
// One matrix's cost per iteration step: s^2 x (2 l + s) multiply-adds, s <= l its sides.
double newton_schulz_cost(int64_t rows, int64_t cols);

// One optimizer for both kinds of group: a group whose options are MuonOptions is stepped by
// Muon (its parameters must be matrices), one with AdamWOptions by AdamW (the same
// arithmetic as ForeachAdamW; amsgrad is not supported yet). Same-shape matrices of a Muon
// group are orthogonalized together as one batch. A parameter without a gradient is skipped.
class Muon : public torch::optim::Optimizer {
 public:
  Muon(std::vector<torch::optim::OptimizerParamGroup> groups, MuonOptions defaults = {});
  torch::Tensor step(LossClosure closure = nullptr) override;
  ~Muon() override;
  // The momentum of a Muon parameter (its state is made, zero, where it has none yet).
  MuonParamState& muon_state(const at::Tensor& p);

  // Makes the Muon parameters in `pieces` pieces of larger matrices, orthogonalized whole
  // by `scheme` over `comm`. Collective over `comm`: every rank calls it, each with its own
  // pieces (none is fine, and so is an empty box), and from then on every rank of `comm`
  // calls step() together. Its one exchange of names and boxes is here; each step then runs
  // one small all-reduce before any parameter moves (errors anywhere; which matrices have
  // gradients: a matrix no holder has one for is skipped, as in one process) and the
  // scheme's all-to-alls, on the communicator's control device. Raises (on every rank) for a
  // piece whose parameter is not in a Muon group or whose shape is not its box's lengths, a
  // parameter or name given twice, ranks giving different schemes or iterating in different
  // dtypes, a matrix whose boxes do not tile it exactly or whose ranks disagree on its
  // shape, or whose holders' groups step it with different options (momentum, nesterov,
  // weight decay, Newton-Schulz steps, update scale, eps; the learning rate is scheduled
  // alike everywhere and not compared). The iteration's dtype is fixed here. Muon
  // parameters not in `pieces` stay whole matrices
  // stepped where they are.
  void distribute(CommPtr comm, const std::vector<MatrixPiece>& pieces, MuonScheme scheme = MuonScheme::kOwner);
  // This rank's part of the plan (zeros before distribute()).
  MuonPlanStats plan_stats() const;

  struct Plan;  // internal

 private:
  std::vector<bool> agree_on_step(const std::string& error);
  void step_distributed(const std::vector<bool>& active);
  std::unique_ptr<Plan> plan_;
};

// Muon over the parameters routed to it, AdamW over the rest, in one object: groups in the
// order [Muon, AdamW with weight decay (other matrices), AdamW without (vectors, scalars)],
// each present only where it has parameters. `muon_count`/`adamw_count` receive the number
// of elements of each, when given.
std::unique_ptr<Muon> make_muon(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                const MuonOptions& muon, const torch::optim::AdamWOptions& adamw,
                                const MuonRouting& routing, int64_t* muon_count = nullptr,
                                int64_t* adamw_count = nullptr);

}  // namespace hp::optim
