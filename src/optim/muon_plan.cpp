// Muon's plan over ranks: which rank computes each matrix and which boxes of it travel there
// and back, agreed by every rank from their pieces (hp/optim/muon.h, Muon::distribute).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "hp/comm/agree.h"
#include "hp/core/error.h"
#include "hp/core/hash.h"
#include "muon_plan.h"

namespace hp::optim {

namespace detail {

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

}  // namespace detail

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


// This rank's pieces as every rank receives them: their count, the iteration's dtype (-1
// without pieces), the scheme, then per piece its name, its matrix's shape, its box and its
// options' fingerprint. Raises naming the piece for one that cannot be stepped.
std::vector<int64_t> encode_pieces(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                   const std::vector<MatrixPiece>& pieces, MuonScheme scheme) {
  std::vector<int64_t> mine;
  std::set<std::string> names;
  mine.push_back(static_cast<int64_t>(pieces.size()));
  mine.push_back(-1);  // the iteration's dtype (of every piece's group), -1 without pieces
  mine.push_back(static_cast<int64_t>(scheme));
  std::set<const c10::TensorImpl*> seen;
  for (const MatrixPiece& piece : pieces) {
    const MuonOptions* o = detail::muon_group_of(groups, piece.param);
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
  return mine;
}

// Every rank's encoding, padded to the longest: [world * longest] on the host.
at::Tensor gather_encodings(const CommPtr& comm, const std::vector<int64_t>& mine, int64_t* longest) {
  const c10::Device dev = control_device(comm);
  const int world = comm->size();
  at::Tensor size = at::full({1}, static_cast<int64_t>(mine.size()), at::TensorOptions(at::kLong).device(dev));
  at::Tensor sizes = at::empty({world}, size.options());
  comm->all_gather(sizes, size).wait();
  *longest = sizes.cpu().max().item<int64_t>();
  at::Tensor padded = at::zeros({*longest}, at::kLong);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<int64_t>());
  at::Tensor all = at::empty({world * *longest}, size.options());
  comm->all_gather(all, padded.to(dev)).wait();
  return all.cpu().contiguous();
}

// Decodes every rank's pieces: per matrix, its shape and holders; the holders' options
// compared, the iteration's dtype set on `plan`.
std::map<std::string, Muon::Plan::Matrix> decode_pieces(const int64_t* data, int64_t longest, MuonScheme scheme,
                                                        Muon::Plan& plan) {
  const int world = plan.comm->size();
  std::map<std::string, Muon::Plan::Matrix> by_name;
  std::map<std::string, std::pair<int64_t, int>> options_of;
  for (int r = 0; r < world; ++r) {
    const int64_t* d = data + r * longest;
    int64_t at_ = 0;
    const int64_t n = d[at_++];
    const int64_t dtype = d[at_++];
    HP_CHECK(d[at_++] == static_cast<int64_t>(scheme), "Muon::distribute: the ranks give different schemes (rank ", r,
             " another than rank ", plan.comm->rank(), ")");
    if (dtype >= 0) {
      HP_CHECK(plan.dtype < 0 || plan.dtype == dtype, "Muon::distribute: the ranks' Muon groups iterate in different ",
               "dtypes (rank ", r, ": ", static_cast<at::ScalarType>(dtype), ")");
      plan.dtype = dtype;
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
      Muon::Plan::Matrix& m = by_name[name];
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
  return by_name;
}

// The distinct boxes of each matrix must tile it: inside it, not overlapping, covering it.
void check_tiling(const std::map<std::string, Muon::Plan::Matrix>& by_name) {
  for (const auto& [name, m] : by_name) {
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
}

// Who computes each matrix: its owner (balanced by cost over its holders, the costliest
// matrices placed first), or every holder.
void assign_computers(Muon::Plan& plan) {
  std::vector<double> load(static_cast<size_t>(plan.comm->size()), 0.0);
  std::vector<size_t> order(plan.matrices.size());
  for (size_t j = 0; j < order.size(); ++j) {
    Muon::Plan::Matrix& m = plan.matrices[j];
    m.cost = newton_schulz_cost(m.rows, m.cols);  // per iteration step: the same schedule for all
    order[j] = j;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return plan.matrices[a].cost > plan.matrices[b].cost; });
  for (size_t j : order) {
    Muon::Plan::Matrix& m = plan.matrices[j];
    if (m.holders.empty()) continue;
    if (plan.scheme == MuonScheme::kGatherEverywhere) {
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
}

// The transfers, in one order every rank derives alike: matrices by name, their distinct
// boxes in order, the computers by rank. A computer holding a box needs no copy of it;
// otherwise one of the box's holders sends it: of its replicas (HSDP), the one that has
// sent the fewest elements so far (ties: the lowest rank), so replicas share the sending.
// Under the owner scheme each holder's box of the result comes back from the owner.
void plan_transfers(Muon::Plan& plan) {
  std::vector<int64_t> sent(static_cast<size_t>(plan.comm->size()), 0);
  for (size_t j = 0; j < plan.matrices.size(); ++j) {
    const Muon::Plan::Matrix& m = plan.matrices[j];
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
        plan.gather.push_back({j, box, src, c});
      }
    }
    if (plan.scheme == MuonScheme::kOwner) {
      for (const auto& h : m.holders) {
        if (h.first == m.computers.front()) continue;
        sent[static_cast<size_t>(m.computers.front())] += h.second.numel();
        plan.give.push_back({j, h.second, m.computers.front(), h.first});
      }
    }
  }
}

}  // namespace

void Muon::distribute(CommPtr comm, const std::vector<MatrixPiece>& pieces, MuonScheme scheme) {
  HP_CHECK(comm != nullptr, "Muon::distribute: no communicator");
  auto plan = std::make_unique<Plan>();
  plan->comm = comm;
  plan->scheme = scheme;
  // This rank's pieces, checked here; a failure on one rank raises on all before any exchange.
  std::string error;
  std::vector<int64_t> mine;
  try {
    mine = encode_pieces(param_groups_, pieces, scheme);
  } catch (const std::exception& e) {
    error = e.what();
  }
  raise_if_any_failed(comm, error, "Muon::distribute");
  int64_t longest = 0;
  const at::Tensor all = gather_encodings(comm, mine, &longest);
  std::map<std::string, Plan::Matrix> by_name = decode_pieces(all.data_ptr<int64_t>(), longest, scheme, *plan);
  check_tiling(by_name);
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
  assign_computers(*plan);
  plan_transfers(*plan);
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

double newton_schulz_cost(int64_t rows, int64_t cols) {
  const double s = static_cast<double>(std::min(rows, cols)), l = static_cast<double>(std::max(rows, cols));
  return s * s * (2 * l + s);
}

MuonWorkload muon_workload(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t shards, int64_t replicas) {
  HP_CHECK(shards >= 1 && replicas >= 1, "muon_workload: shards=", shards, " and replicas=", replicas,
           " must be positive");
  MuonWorkload w;
  const double h = static_cast<double>(shards), r = static_cast<double>(replicas);
  for (const auto& [rows, cols] : shapes) {
    const double cost = newton_schulz_cost(rows, cols), e = static_cast<double>(rows * cols);
    ++w.matrices;
    w.cost += cost;
    w.largest_cost = std::max(w.largest_cost, cost);
    w.elements += e;
    // The owner holds one box: the other shards - 1 come to it (one replica each), and its
    // result's boxes go back to the shards x replicas - 1 other holders.
    w.gathered += e / h * (h - 1);
    w.given += e / h * (h * r - 1);
  }
  return w;
}

}  // namespace hp::optim
