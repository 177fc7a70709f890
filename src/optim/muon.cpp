#include "hp/optim/muon.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include "adamw_step.h"
#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/core/hash.h"
#include "hp/core/pattern.h"
#include "hp/optim/foreach_adamw.h"

namespace hp::optim {

std::vector<NsStep> ns_steps(NsSchedule schedule, int64_t steps) {
  const NsStep quintic{3.4445, -4.7750, 2.0315};
  switch (schedule) {
    case NsSchedule::kQuintic:
      HP_CHECK(steps >= 0, "Newton-Schulz steps=", steps, " is negative");
      return std::vector<NsStep>(static_cast<size_t>(steps == 0 ? 5 : steps), quintic);
    case NsSchedule::kPerStep: {
      HP_CHECK(steps == 0 || steps == 5, "Newton-Schulz steps=", steps,
               ": the per_step schedule has its own 5 steps (0 takes them)");
      return {{4.0848, -6.8946, 2.9270},
              {3.9505, -6.3029, 2.6377},
              {3.7418, -5.5913, 2.3037},
              {2.8769, -3.1427, 1.2046},
              {2.8366, -3.0525, 1.2012}};
    }
    case NsSchedule::kDeepSeekV4: {
      HP_CHECK(steps == 0 || steps == 10, "Newton-Schulz steps=", steps,
               ": the deepseek_v4 schedule has its own 10 steps, 8 + 2 (0 takes them)");
      std::vector<NsStep> out(8, quintic);
      out.insert(out.end(), 2, NsStep{2.0, -1.5, 0.5});
      return out;
    }
  }
  HP_INTERNAL_ASSERT(false, "unknown NsSchedule");
}

at::Tensor newton_schulz(const at::Tensor& d, const std::vector<NsStep>& steps, at::ScalarType dtype, double eps) {
  HP_CHECK(d.dim() >= 2, "newton_schulz: a matrix (or a batch of them) is needed, got shape ", d.sizes());
  at::Tensor x = d.to(dtype);
  const bool tall = x.size(-2) > x.size(-1);
  if (tall) x = x.transpose(-2, -1);
  // The Frobenius norm in at least fp32, whatever dtype the iteration runs in.
  const at::ScalarType norm_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor norm = x.to(norm_dtype).pow(2).sum({-2, -1}, /*keepdim=*/true).sqrt();
  x = (x.to(norm_dtype) / (norm + eps)).to(dtype);
  for (const NsStep& s : steps) {
    const at::Tensor a = at::matmul(x, x.transpose(-2, -1));
    const at::Tensor b = at::matmul(s.b * a + s.c * at::matmul(a, a), x);
    x = s.a * x + b;
  }
  return tall ? x.transpose(-2, -1) : x;
}

double muon_scale(MuonScale scale, int64_t rows, int64_t cols, double rms_target) {
  HP_CHECK(rows > 0 && cols > 0, "muon_scale: a ", rows, " x ", cols, " matrix");
  const double a = static_cast<double>(rows), b = static_cast<double>(cols);
  switch (scale) {
    case MuonScale::kRms:
      return rms_target * std::sqrt(std::max(a, b));
    case MuonScale::kOriginal:
      return std::sqrt(std::max(1.0, a / b));
  }
  HP_INTERNAL_ASSERT(false, "unknown MuonScale");
}

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

bool matches_pattern(const std::string& name, const std::string& pattern) {
  return wildcard_match(pattern, name, /*star_crosses_dot=*/true);
}

std::vector<bool> route_to_muon(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                const MuonRouting& routing) {
  auto any = [](const std::string& name, const std::vector<std::string>& patterns) {
    return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return matches_pattern(name, p); });
  };
  std::vector<bool> out;
  for (const auto& [name, p] : named) {
    if (any(name, routing.to_adamw)) {
      out.push_back(false);
    } else if (any(name, routing.to_muon)) {
      HP_CHECK(p.dim() == 2, "Muon: parameter '", name, "' of shape ", p.sizes(),
               " matches a Muon pattern, but only matrices (2-D) are supported yet");
      out.push_back(true);
    } else {
      out.push_back(p.dim() == 2);
    }
  }
  return out;
}

Muon::Muon(std::vector<torch::optim::OptimizerParamGroup> groups, MuonOptions defaults)
    : torch::optim::Optimizer(std::move(groups), std::make_unique<MuonOptions>(std::move(defaults))) {
  for (const auto& g : param_groups_) {
    if (const auto* m = dynamic_cast<const MuonOptions*>(&g.options())) {
      HP_CHECK(!m->ns().empty(), "Muon: a Muon group with no Newton-Schulz steps");
      HP_CHECK(m->momentum() >= 0 && m->momentum() < 1, "Muon: momentum=", m->momentum(), " is not in [0, 1)");
      HP_CHECK(m->ns_dtype() == at::kBFloat16 || m->ns_dtype() == at::kFloat || m->ns_dtype() == at::kDouble,
               "Muon: ns_dtype=", m->ns_dtype(), " is not supported yet (bfloat16, float32 or float64)");
      for (const auto& p : g.params()) {
        HP_CHECK(p.dim() == 2, "Muon: a parameter of shape ", p.sizes(),
                 " in a Muon group: only matrices (2-D) are supported yet (route it to AdamW)");
      }
    } else if (const auto* a = dynamic_cast<const torch::optim::AdamWOptions*>(&g.options())) {
      HP_CHECK(!a->amsgrad(), "Muon: the AdamW groups' amsgrad is not supported yet");
    } else {
      HP_CHECK(false, "Muon: a parameter group's options are neither MuonOptions nor AdamWOptions");
    }
  }
  // One group per parameter: Muon's and AdamW's states of one tensor would collide.
  std::set<const c10::TensorImpl*> seen;
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) {
      HP_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "Muon: a parameter of shape ", p.sizes(),
               " is in two groups");
    }
  }
}

// A rectangle of a matrix: rows [r0, r0 + rows), columns [c0, c0 + cols).
struct Box {
  int64_t r0 = 0, c0 = 0, rows = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
  bool operator<(const Box& o) const { return std::tie(r0, c0, rows, cols) < std::tie(o.r0, o.c0, o.rows, o.cols); }
  bool operator==(const Box& o) const { return !(*this < o) && !(o < *this); }
  at::Tensor of(const at::Tensor& whole) const { return whole.narrow(0, r0, rows).narrow(1, c0, cols); }
};

struct Muon::Plan {
  CommPtr comm;
  MuonScheme scheme = MuonScheme::kOwner;
  int64_t dtype = -1;  // the iteration's, every rank's (-1: no pieces anywhere)
  struct Matrix {
    std::string name;
    int64_t rows = 0, cols = 0;
    std::vector<std::pair<int, Box>> holders;  // (rank, its non-empty box), by rank
    std::vector<int> computers;                // the ranks that run the iteration on it
    double cost = 0;
  };
  std::vector<Matrix> matrices;  // by name
  // This rank's pieces: matrix index -> (parameter, box).
  std::map<size_t, std::pair<at::Tensor, Box>> mine;
  std::set<const c10::TensorImpl*> distributed;
  // One transfer of a box of a matrix (a direction piece to a computer, or a piece of the
  // result back to a holder), in the order both sides list them.
  struct Transfer {
    size_t matrix;
    Box box;
    int src, dst;
  };
  std::vector<Transfer> gather;  // pieces to the computers
  std::vector<Transfer> give;    // results back (kOwner)
};

Muon::~Muon() = default;

MuonParamState& Muon::muon_state(const at::Tensor& p) {
  const auto key = state_key(state_, p);
  auto it = state_.find(key);
  if (it == state_.end()) {
    auto s = std::make_unique<MuonParamState>();
    s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
    it = state_.emplace(key, std::move(s)).first;
  }
  auto* st = dynamic_cast<MuonParamState*>(it->second.get());
  HP_CHECK(st != nullptr, "Muon::muon_state: the parameter of shape ", p.sizes(), " is stepped by AdamW, not Muon");
  return *st;
}

namespace {

// The Muon options of the group holding `p`, or nullptr.
const MuonOptions* muon_group_of(const std::vector<torch::optim::OptimizerParamGroup>& groups, const at::Tensor& p) {
  for (const auto& g : groups) {
    const auto* o = dynamic_cast<const MuonOptions*>(&g.options());
    if (o == nullptr) continue;
    for (const auto& q : g.params()) {
      if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return o;
    }
  }
  return nullptr;
}

// Momentum, then the direction to orthogonalize (in the iteration's dtype).
at::Tensor direction_of(MuonParamState& s, const at::Tensor& p, const MuonOptions& o) {
  s.step(s.step() + 1);
  at::Tensor& m = s.momentum_buffer();
  m.mul_(o.momentum()).add_(p.grad());
  return (o.nesterov() ? p.grad().add(m, o.momentum()) : m).to(o.ns_dtype());
}

void apply_update(at::Tensor& p, const at::Tensor& orth, const MuonOptions& o, int64_t rows, int64_t cols) {
  if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
  p.add_(orth.to(p.device(), p.scalar_type()), -o.lr() * muon_scale(o.scale(), rows, cols, o.rms_target()));
}

// Runs the iteration on matrices of one shape and options as one batch.
std::vector<at::Tensor> orthogonalize(const std::vector<at::Tensor>& ds, const MuonOptions& o) {
  const at::Tensor orth = newton_schulz(at::stack(ds), o.ns(), o.ns_dtype(), o.eps());
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < orth.size(0); ++i) out.push_back(orth[i]);
  return out;
}

}  // namespace

namespace {

// What a holder's options do to its piece (its momentum, the owner's iteration, its update),
// as one number: the holders of a matrix must agree on it, or the whole matrix would not be
// stepped as one process steps it. The learning rate is left out: schedulers set it per
// step, the same on every rank.
int64_t options_fingerprint(const MuonOptions& o) {
  uint64_t h = kFnvOffset;
  auto bits = [&](double x) {
    uint64_t u = 0;
    std::memcpy(&u, &x, sizeof u);
    h = fnv1a_step(h, u);
  };
  bits(o.momentum());
  h = fnv1a_step(h, o.nesterov() ? 1 : 0);
  bits(o.weight_decay());
  for (const NsStep& s : o.ns()) bits(s.a), bits(s.b), bits(s.c);
  h = fnv1a_step(h, o.ns().size());
  h = fnv1a_step(h, static_cast<uint64_t>(o.scale()));
  bits(o.rms_target());
  bits(o.eps());
  return static_cast<int64_t>(h >> 1);  // non-negative
}

}  // namespace

void Muon::distribute(CommPtr comm, const std::vector<MatrixPiece>& pieces, MuonScheme scheme) {
  HP_CHECK(comm != nullptr, "Muon::distribute: no communicator");
  auto plan = std::make_unique<Plan>();
  plan->comm = comm;
  plan->scheme = scheme;
  // This rank's pieces, checked here; a failure on one rank raises on all before any exchange.
  std::string error;
  std::vector<int64_t> mine;  // the encoding every rank receives
  try {
    std::set<std::string> names;
    mine.push_back(static_cast<int64_t>(pieces.size()));
    mine.push_back(-1);  // the iteration's dtype (of every piece's group), -1 without pieces
    mine.push_back(static_cast<int64_t>(scheme));
    std::set<const c10::TensorImpl*> seen;
    for (const MatrixPiece& piece : pieces) {
      const MuonOptions* o = muon_group_of(param_groups_, piece.param);
      HP_CHECK(o != nullptr, "Muon::distribute: the piece of '", piece.name, "' is not a parameter of a Muon group");
      HP_CHECK(mine[1] < 0 || mine[1] == static_cast<int64_t>(o->ns_dtype()),
               "Muon::distribute: the Muon groups iterate in different dtypes (not supported yet)");
      mine[1] = static_cast<int64_t>(o->ns_dtype());
      HP_CHECK(!piece.name.empty(), "Muon::distribute: a piece without a matrix name");
      HP_CHECK(names.insert(piece.name).second, "Muon::distribute: two pieces of '", piece.name, "' on one rank");
      HP_CHECK(seen.insert(piece.param.unsafeGetTensorImpl()).second, "Muon::distribute: the parameter of '", piece.name,
               "' is given twice");
      const ShardSpec& b = piece.box;
      HP_CHECK(b.global_shape.size() == 2 && b.offsets.size() == 2 && b.lengths.size() == 2,
               "Muon::distribute: '", piece.name, "' is not a matrix (", b.to_string(), ")");
      HP_CHECK(piece.param.sizes().vec() == b.lengths, "Muon::distribute: the piece of '", piece.name, "' has shape ",
               piece.param.sizes(), ", its box ", b.to_string());
      mine.push_back(static_cast<int64_t>(piece.name.size()));
      for (char ch : piece.name) mine.push_back(static_cast<unsigned char>(ch));
      for (int64_t v : {b.global_shape[0], b.global_shape[1], b.offsets[0], b.offsets[1], b.lengths[0], b.lengths[1],
                        options_fingerprint(*o)}) {
        mine.push_back(v);
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  raise_if_any_failed(comm, error, "Muon::distribute");
  // Every rank's encoding: the sizes, then the encodings padded to the largest.
  const c10::Device dev = control_device(comm);
  const int world = comm->size();
  at::Tensor size = at::full({1}, static_cast<int64_t>(mine.size()), at::TensorOptions(at::kLong).device(dev));
  at::Tensor sizes = at::empty({world}, size.options());
  comm->all_gather(sizes, size).wait();
  const at::Tensor sizes_cpu = sizes.cpu();
  const int64_t longest = sizes_cpu.max().item<int64_t>();
  at::Tensor padded = at::zeros({longest}, at::kLong);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<int64_t>());
  at::Tensor all = at::empty({world * longest}, size.options());
  comm->all_gather(all, padded.to(dev)).wait();
  const at::Tensor all_cpu = all.cpu().contiguous();
  const int64_t* data = all_cpu.data_ptr<int64_t>();
  // Decode: per matrix, its shape and holders (and the first holder's options, to compare).
  std::map<std::string, Plan::Matrix> by_name;
  std::map<std::string, std::pair<int64_t, int>> options_of;
  for (int r = 0; r < world; ++r) {
    const int64_t* d = data + r * longest;
    int64_t at_ = 0;
    const int64_t n = d[at_++];
    const int64_t dtype = d[at_++];
    HP_CHECK(d[at_++] == static_cast<int64_t>(scheme), "Muon::distribute: the ranks give different schemes (rank ", r,
             " another than rank ", comm->rank(), ")");
    if (dtype >= 0) {
      HP_CHECK(plan->dtype < 0 || plan->dtype == dtype, "Muon::distribute: the ranks' Muon groups iterate in different ",
               "dtypes (rank ", r, ": ", static_cast<at::ScalarType>(dtype), ")");
      plan->dtype = dtype;
    }
    for (int64_t k = 0; k < n; ++k) {
      std::string name;
      const int64_t len = d[at_++];
      for (int64_t i = 0; i < len; ++i) name.push_back(static_cast<char>(d[at_++]));
      const int64_t rows = d[at_], cols = d[at_ + 1];
      const Box box{d[at_ + 2], d[at_ + 3], d[at_ + 4], d[at_ + 5]};
      const int64_t fingerprint = d[at_ + 6];
      at_ += 7;
      const auto first = options_of.emplace(name, std::make_pair(fingerprint, r)).first->second;
      HP_CHECK(first.first == fingerprint, "Muon::distribute: the holders of '", name, "' step it with different Muon ",
               "options (momentum, nesterov, weight decay, Newton-Schulz steps, update scale or eps): rank ",
               first.second, "'s and rank ", r, "'s");
      Plan::Matrix& m = by_name[name];
      if (m.name.empty()) {
        m.name = name;
        m.rows = rows;
        m.cols = cols;
      }
      HP_CHECK(m.rows == rows && m.cols == cols, "Muon::distribute: the ranks disagree on the shape of '", name,
               "': [", m.rows, ", ", m.cols, "] and [", rows, ", ", cols, "] (rank ", r, ")");
      if (box.numel() > 0) m.holders.emplace_back(r, box);
    }
  }
  // The distinct boxes of each matrix must tile it: inside it, not overlapping, covering it.
  for (auto& [name, m] : by_name) {
    std::set<Box> distinct;
    for (const auto& h : m.holders) distinct.insert(h.second);
    int64_t covered = 0;
    for (const Box& b : distinct) {
      HP_CHECK(b.r0 >= 0 && b.c0 >= 0 && b.r0 + b.rows <= m.rows && b.c0 + b.cols <= m.cols, "Muon::distribute: a box of '",
               name, "' lies outside its [", m.rows, ", ", m.cols, "]");
      for (const Box& o : distinct) {
        if (o == b) continue;
        const bool apart = b.r0 + b.rows <= o.r0 || o.r0 + o.rows <= b.r0 || b.c0 + b.cols <= o.c0 || o.c0 + o.cols <= b.c0;
        HP_CHECK(apart, "Muon::distribute: two different boxes of '", name, "' overlap");
      }
      covered += b.numel();
    }
    HP_CHECK(covered == m.rows * m.cols, "Muon::distribute: the pieces of '", name, "' cover ", covered, " of its ",
             m.rows * m.cols, " elements");
  }
  for (auto& [name, m] : by_name) plan->matrices.push_back(std::move(m));
  std::map<std::string, size_t> index;
  for (size_t j = 0; j < plan->matrices.size(); ++j) index[plan->matrices[j].name] = j;
  for (const MatrixPiece& piece : pieces) {
    // An empty piece (fully_shard's last ranks of a short dim) takes no part in the steps.
    const ShardSpec& b = piece.box;
    const Box box{b.offsets[0], b.offsets[1], b.lengths[0], b.lengths[1]};
    if (box.numel() > 0) plan->mine[index.at(piece.name)] = {piece.param, box};
    plan->distributed.insert(piece.param.unsafeGetTensorImpl());
  }
  // Who computes each matrix: its owner (balanced by cost over its holders, the costliest
  // matrices placed first), or every holder.
  std::vector<double> load(static_cast<size_t>(world), 0.0);
  std::vector<size_t> order(plan->matrices.size());
  for (size_t j = 0; j < order.size(); ++j) {
    Plan::Matrix& m = plan->matrices[j];
    const double sm = static_cast<double>(std::min(m.rows, m.cols)), lg = static_cast<double>(std::max(m.rows, m.cols));
    m.cost = sm * sm * (2 * lg + sm);  // per iteration step: the same schedule for all
    order[j] = j;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return plan->matrices[a].cost > plan->matrices[b].cost; });
  for (size_t j : order) {
    Plan::Matrix& m = plan->matrices[j];
    if (m.holders.empty()) continue;
    if (scheme == MuonScheme::kGatherEverywhere) {
      for (const auto& h : m.holders) m.computers.push_back(h.first);
      continue;
    }
    int best = m.holders.front().first;
    for (const auto& h : m.holders) {
      if (load[static_cast<size_t>(h.first)] < load[static_cast<size_t>(best)]) best = h.first;
    }
    load[static_cast<size_t>(best)] += m.cost;
    m.computers.push_back(best);
  }
  // The transfers, in one order every rank derives alike: matrices by name, their distinct
  // boxes in order, the computers by rank. A computer holding a box needs no copy of it;
  // otherwise one of the box's holders sends it: of its replicas (HSDP), the one that has
  // sent the fewest elements so far (ties: the lowest rank), so replicas share the sending.
  std::vector<int64_t> sent(static_cast<size_t>(world), 0);
  for (size_t j = 0; j < plan->matrices.size(); ++j) {
    const Plan::Matrix& m = plan->matrices[j];
    std::map<Box, std::vector<int>> holders_of;
    for (const auto& h : m.holders) holders_of[h.second].push_back(h.first);
    for (const auto& [box, ranks] : holders_of) {
      for (int c : m.computers) {
        if (std::find(ranks.begin(), ranks.end(), c) != ranks.end()) continue;
        int src = ranks.front();
        for (int r : ranks) {
          if (sent[static_cast<size_t>(r)] < sent[static_cast<size_t>(src)]) src = r;
        }
        sent[static_cast<size_t>(src)] += box.numel();
        plan->gather.push_back({j, box, src, c});
      }
    }
    if (scheme == MuonScheme::kOwner) {
      for (const auto& h : m.holders) {
        if (h.first == m.computers.front()) continue;
        sent[static_cast<size_t>(m.computers.front())] += h.second.numel();
        plan->give.push_back({j, h.second, m.computers.front(), h.first});
      }
    }
  }
  plan_ = std::move(plan);
}

MuonPlanStats Muon::plan_stats() const {
  MuonPlanStats st;
  if (!plan_) return st;
  const int me = plan_->comm->rank();
  st.matrices = static_cast<int64_t>(plan_->matrices.size());
  for (const auto& m : plan_->matrices) {
    if (std::find(m.computers.begin(), m.computers.end(), me) != m.computers.end()) {
      ++st.owned;
      st.owned_cost += m.cost;
    }
  }
  for (const auto* list : {&plan_->gather, &plan_->give}) {
    for (const auto& t : *list) {
      if (t.src == me) st.send_elements += t.box.numel();
      if (t.dst == me) st.recv_elements += t.box.numel();
    }
  }
  return st;
}

namespace {

// One all-to-all of `transfers` (those of this rank: the boxes it sends, cut from
// `send_of(t)`, and those it receives, handed to `recv(t, flat)`), in `dtype` on `dev`.
template <typename SendOf, typename Recv>
void exchange(const CommPtr& comm, const std::vector<Muon::Plan::Transfer>& transfers, const std::vector<bool>& active,
              at::ScalarType dtype, const c10::Device& dev, SendOf send_of, Recv recv) {
  const int world = comm->size(), me = comm->rank();
  std::vector<int64_t> send_sizes(static_cast<size_t>(world), 0), recv_sizes(static_cast<size_t>(world), 0);
  std::vector<std::vector<at::Tensor>> send_parts(static_cast<size_t>(world));
  std::vector<std::vector<const Muon::Plan::Transfer*>> recv_parts(static_cast<size_t>(world));
  for (const auto& t : transfers) {
    if (!active[t.matrix]) continue;
    if (t.src == me) {
      send_parts[static_cast<size_t>(t.dst)].push_back(send_of(t).reshape({-1}));
      send_sizes[static_cast<size_t>(t.dst)] += t.box.numel();
    }
    if (t.dst == me) {
      recv_parts[static_cast<size_t>(t.src)].push_back(&t);
      recv_sizes[static_cast<size_t>(t.src)] += t.box.numel();
    }
  }
  std::vector<at::Tensor> flat;
  for (auto& parts : send_parts) flat.insert(flat.end(), parts.begin(), parts.end());
  const at::TensorOptions opts = at::TensorOptions(dtype).device(dev);
  at::Tensor in = flat.empty() ? at::empty({0}, opts) : at::cat(flat).to(dtype);
  int64_t total = 0;
  for (int64_t n : recv_sizes) total += n;
  at::Tensor out = at::empty({total}, opts);
  comm->all_to_all(out, in, {recv_sizes, send_sizes}).wait();
  int64_t at_ = 0;
  for (const auto& parts : recv_parts) {
    for (const auto* t : parts) {
      recv(*t, out.narrow(0, at_, t->box.numel()).view({t->box.rows, t->box.cols}));
      at_ += t->box.numel();
    }
  }
}

}  // namespace

// Every gradient usable, checked before any parameter moves: an error names the parameter.
static std::string check_gradients(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  try {
    for (const auto& group : groups) {
      const bool muon = dynamic_cast<const MuonOptions*>(&group.options()) != nullptr;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        HP_CHECK(!p.grad().is_sparse(), "Muon: sparse gradients are not supported yet");
        HP_CHECK(p.grad().sizes() == p.sizes(), "Muon: a gradient of shape ", p.grad().sizes(), " for a parameter of shape ",
                 p.sizes());
        HP_CHECK(!muon || p.dim() == 2, "Muon: a parameter of shape ", p.sizes(),
                 " in a Muon group: only matrices (2-D) are supported yet");
      }
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

torch::Tensor Muon::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  const std::string error = check_gradients(param_groups_);
  // Distributed: every rank agrees first (errors anywhere, which matrices have gradients),
  // so that a failure raises on all of them before anything is updated.
  std::vector<bool> active;
  if (plan_) {
    active = agree_on_step(error);
  } else {
    HP_CHECK(error.empty(), error);
  }
  for (auto& group : param_groups_) {
    const auto* o = dynamic_cast<const MuonOptions*>(&group.options());
    if (o == nullptr) {
      detail::foreach_adamw_group(group, state_);
      continue;
    }
    // Whole matrices held here: momentum and direction per parameter, then the directions
    // of one shape orthogonalized as one batch.
    std::map<std::vector<int64_t>, std::vector<std::pair<at::Tensor, at::Tensor>>> by_shape;  // (param, direction)
    for (auto& p : group.params()) {
      if (!p.grad().defined() || (plan_ && plan_->distributed.count(p.unsafeGetTensorImpl()))) continue;
      by_shape[p.sizes().vec()].emplace_back(p, direction_of(muon_state(p), p, *o));
    }
    for (auto& [shape, items] : by_shape) {
      std::vector<at::Tensor> ds;
      for (const auto& it : items) ds.push_back(it.second);
      const std::vector<at::Tensor> orth = orthogonalize(ds, *o);
      for (size_t i = 0; i < items.size(); ++i) apply_update(items[i].first, orth[i], *o, shape[0], shape[1]);
    }
  }
  if (plan_) step_distributed(active);
  return loss;
}

std::vector<bool> Muon::agree_on_step(const std::string& error) {
  Plan& plan = *plan_;
  const CommPtr& comm = plan.comm;
  const size_t n = plan.matrices.size();
  // One all-reduce: per matrix, how many of its holders have a gradient; last, how many
  // ranks failed the local checks.
  at::Tensor counts = at::zeros({static_cast<int64_t>(n) + 1}, at::kLong);
  for (const auto& [j, piece] : plan.mine) counts[static_cast<int64_t>(j)] = piece.first.grad().defined() ? 1 : 0;
  counts[static_cast<int64_t>(n)] = error.empty() ? 0 : 1;
  at::Tensor summed = counts.to(control_device(comm));
  comm->all_reduce(summed).wait();
  const at::Tensor got = summed.cpu();
  HP_CHECK(error.empty(), error);
  HP_CHECK(got[static_cast<int64_t>(n)].item<int64_t>() == 0, "Muon step failed on another rank (its error says why)");
  std::vector<bool> active(n, false);
  for (size_t j = 0; j < n; ++j) {
    const int64_t have = got[static_cast<int64_t>(j)].item<int64_t>();
    const auto holders = static_cast<int64_t>(plan.matrices[j].holders.size());
    HP_CHECK(have == 0 || have == holders, "Muon: '", plan.matrices[j].name, "' has a gradient on ", have, " of the ",
             holders, " ranks holding pieces of it: its pieces must all have one or none");
    active[j] = have > 0;
  }
  return active;
}

void Muon::step_distributed(const std::vector<bool>& active) {
  Plan& plan = *plan_;
  const CommPtr& comm = plan.comm;
  const size_t n = plan.matrices.size();
  // Pieces travel and whole matrices are assembled on the communicator's device (the same
  // rule on every rank, pieces or none), then the results go back to each parameter's.
  const c10::Device dev = control_device(comm);
  // Momentum and direction of this rank's pieces.
  std::map<size_t, at::Tensor> direction;
  std::map<size_t, const MuonOptions*> options;
  for (auto& [j, piece] : plan.mine) {
    if (!active[j]) continue;
    const MuonOptions* o = muon_group_of(param_groups_, piece.first);
    HP_INTERNAL_ASSERT(o != nullptr, "a distributed Muon piece outside the Muon groups");
    // In the dtype fixed at distribute() (the plan's), on the exchange's device.
    direction[j] = direction_of(muon_state(piece.first), piece.first, *o).to(dev, static_cast<at::ScalarType>(plan.dtype));
    options[j] = o;
  }
  if (plan.dtype < 0) return;  // no pieces anywhere
  const at::ScalarType dtype = static_cast<at::ScalarType>(plan.dtype);
  // The pieces to the computers; each computer assembles its matrices.
  const int me = comm->rank();
  std::map<size_t, at::Tensor> whole;
  for (size_t j = 0; j < n; ++j) {
    const auto& cs = plan.matrices[j].computers;
    if (!active[j] || std::find(cs.begin(), cs.end(), me) == cs.end()) continue;
    at::Tensor w = at::empty({plan.matrices[j].rows, plan.matrices[j].cols}, at::TensorOptions(dtype).device(dev));
    plan.mine.at(j).second.of(w).copy_(direction.at(j));
    whole[j] = w;
  }
  // (The transfer lists are the same on every rank: an empty one is skipped by all.)
  if (!plan.gather.empty()) {
    exchange(
        comm, plan.gather, active, dtype, dev, [&](const Plan::Transfer& t) { return direction.at(t.matrix); },
        [&](const Plan::Transfer& t, const at::Tensor& part) { t.box.of(whole.at(t.matrix)).copy_(part); });
  }
  // The iteration, batched by shape and options.
  std::map<std::tuple<int64_t, int64_t, const MuonOptions*>, std::vector<size_t>> batches;
  for (const auto& [j, w] : whole) batches[{w.size(0), w.size(1), options.at(j)}].push_back(j);
  std::map<size_t, at::Tensor> result;
  for (const auto& [key, js] : batches) {
    std::vector<at::Tensor> ds;
    for (size_t j : js) ds.push_back(whole.at(j));
    const std::vector<at::Tensor> orth = orthogonalize(ds, *std::get<2>(key));
    for (size_t i = 0; i < js.size(); ++i) result[js[i]] = orth[i];
  }
  // Each holder's box of the result: its own, or from the owner.
  std::map<size_t, at::Tensor> update;
  for (auto& [j, piece] : plan.mine) {
    if (active[j] && result.count(j)) update[j] = piece.second.of(result.at(j));
  }
  if (!plan.give.empty()) {
    exchange(
        comm, plan.give, active, dtype, dev, [&](const Plan::Transfer& t) { return t.box.of(result.at(t.matrix)); },
        [&](const Plan::Transfer& t, const at::Tensor& part) { update[t.matrix] = part.clone(); });
  }
  for (auto& [j, piece] : plan.mine) {
    if (!active[j]) continue;
    apply_update(piece.first, update.at(j), *options.at(j), plan.matrices[j].rows, plan.matrices[j].cols);
  }
}

std::unique_ptr<Muon> make_muon(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                const MuonOptions& muon, const torch::optim::AdamWOptions& adamw,
                                const MuonRouting& routing, int64_t* muon_count, int64_t* adamw_count) {
  const std::vector<bool> to_muon = route_to_muon(named, routing);
  std::vector<at::Tensor> m, decay, plain;
  int64_t nm = 0, na = 0;
  for (size_t i = 0; i < named.size(); ++i) {
    const at::Tensor& p = named[i].second;
    if (!p.requires_grad()) continue;
    if (to_muon[i]) {
      m.push_back(p);
      nm += p.numel();
    } else {
      (p.dim() >= 2 ? decay : plain).push_back(p);
      na += p.numel();
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!m.empty()) groups.emplace_back(m, std::make_unique<MuonOptions>(muon));
  if (!decay.empty()) groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(adamw));
  if (!plain.empty()) {
    groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(adamw).weight_decay(0.0)));
  }
  if (muon_count) *muon_count = nm;
  if (adamw_count) *adamw_count = na;
  return std::make_unique<Muon>(std::move(groups), muon);
}

}  // namespace hp::optim
