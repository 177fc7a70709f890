// Private to hp::optim's Muon: the plan distribute() makes (which rank computes which matrix,
// and the boxes that travel to it and back), shared by the plan (muon_plan.cpp) and the step
// (muon.cpp).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hp/optim/muon.h"

namespace hp::optim {

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

namespace detail {

// The Muon options of the group holding `p`, or nullptr.
const MuonOptions* muon_group_of(const std::vector<torch::optim::OptimizerParamGroup>& groups, const at::Tensor& p);

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

}  // namespace detail

}  // namespace hp::optim
