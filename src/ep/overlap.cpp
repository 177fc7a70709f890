// The overlapped exchange (InFlight): the rows of a dispatch and the experts' outputs move
// in chunks of local experts, each chunk's all-to-all issued on the communicator's thread
// while the caller computes, and waited for only where its data is read.
//
// Four autograd nodes carry it, so that the backward overlaps too:
//   LaunchRows (sent -> every chunk's received buffer): issues the chunks' row all-to-alls;
//     backward: waits for the rows' gradients the Arrive nodes issued, and puts them back
//     in the sent order.
//   Arrive g (received buffer -> chunk g's rows, expert-major): waits for chunk g;
//     backward: issues chunk g's rows' gradient back, without waiting.
//   SendBack g (chunk g's outputs -> their buffer at the tokens' ranks): issues them;
//     backward: waits for chunk g's output gradient (issued by Gather's backward).
//   Gather (every chunk's returned buffer -> the outputs in the sent order): waits for them;
//     backward: issues every chunk's output gradient at once, the last chunk first (the
//     one whose experts' backward runs first).
// Arrive's and Gather's backward issue the exchange that belongs to the next node's
// backward (LaunchRows', SendBack's) early; that node waits for it and reads its result,
// not the local gradient autograd hands it. The rows' gradients are issued in a fixed order,
// the last chunk first, whatever order autograd runs the Arrive nodes in, so every rank of
// the group issues the same collectives in the same order.
#include "overlap.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <numeric>
#include <string>
#include <utility>

#include "hp/core/error.h"
#include "hp/core/turns.h"
#include "hp/core/trace.h"

namespace hp::ep {

struct ExchangeChunks {
  CommPtr group;  // null: one rank, a copy
  int count = 1;
  int64_t rows = 0, dim = 0;                       // the rows sent
  std::vector<int64_t> first;                      // count + 1 bounds, in local experts
  std::vector<std::vector<int64_t>> send, recv;    // per chunk: rows to / from each rank
  std::vector<std::vector<int64_t>> counts;        // per chunk: rows per local expert
  std::vector<at::Tensor> send_index;              // per chunk: its rows among the sent ones
  at::Tensor send_all;                             // the chunks' send_index in turn
  std::vector<at::Tensor> to_expert_major, to_rank_major;  // per chunk: received order <-> expert-major
  std::vector<Work> rows_sent, outputs_sent;       // forward's all-to-alls
  std::vector<Work> output_grads_sent, row_grads_sent;  // backward's
  std::vector<at::Tensor> output_grads, row_grads;      // backward's receive buffers
  std::vector<at::Tensor> row_grads_pending;            // Arrive's, not yet issued
  int next_row_grads = -1;  // the chunk whose rows' gradient is issued next (descending)
};

namespace {

struct ChunksCapsule : torch::CustomClassHolder {
  explicit ChunksCapsule(std::shared_ptr<ExchangeChunks> c) : chunks(std::move(c)) {}
  std::shared_ptr<ExchangeChunks> chunks;
};

c10::IValue capsule(std::shared_ptr<ExchangeChunks> c) {
  return c10::IValue::make_capsule(c10::make_intrusive<ChunksCapsule>(std::move(c)));
}

ExchangeChunks& chunks_of(torch::autograd::AutogradContext* ctx) {
  return *static_cast<ChunksCapsule*>(ctx->saved_data["chunks"].toCapsule().get())->chunks;
}

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// `out` gets send[r] rows of `in` from each rank r... as the communicator's all_to_all.
Work issue(const ExchangeChunks& c, const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& send,
           const std::vector<int64_t>& recv) {
  if (!c.group) {
    out.copy_(in);
    return Work();
  }
  AllToAllOptions o;
  o.input_split_sizes = send;
  o.output_split_sizes = recv;
  return c.group->all_to_all(out, in, o);
}

// Waits, as a span "ep wait <what> <chunk>" in the trace (the time the exchange was exposed).
// Inside a pipeline's paired forward and backward (hp/pp/pipeline.h) the other one computes
// first: every rank hands the turn over at every such wait, whether its chunk has arrived
// or not, so the ranks issue their exchanges in the same order.
void wait_traced(const Work& w, const char* what, int g) {
  hp::yield_turn();
  if (!trace::enabled()) return w.wait();
  trace::Span span(std::string("ep wait ") + what + " " + std::to_string(g), "ep");
  w.wait();
}

at::Tensor rows_buffer(int64_t rows, const ExchangeChunks& c, const at::Tensor& like) {
  return at::empty({rows, c.dim}, like.options());
}

struct LaunchRows : torch::autograd::Function<LaunchRows> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& sent,
                                                const std::shared_ptr<ExchangeChunks>& chunks) {
    ctx->saved_data["chunks"] = capsule(chunks);
    ExchangeChunks& c = *chunks;
    const at::Tensor in = sent.contiguous();
    torch::autograd::variable_list out;
    for (int g = 0; g < c.count; ++g) {
      out.push_back(rows_buffer(sum(c.recv[g]), c, in));
      c.rows_sent[g] = issue(c, out.back(), in.index_select(0, c.send_index[g]), c.send[g], c.recv[g]);
    }
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    ExchangeChunks& c = chunks_of(ctx);
    HP_CHECK(c.next_row_grads < 0, "ep: the rows' gradient of overlap chunk ", c.next_row_grads,
             " was never sent back (its experts' backward did not run)");
    std::vector<at::Tensor> parts;
    for (int g = 0; g < c.count; ++g) {
      wait_traced(c.row_grads_sent[g], "row gradients", g);
      parts.push_back(std::move(c.row_grads[g]));
    }
    at::Tensor grad = rows_buffer(c.rows, c, parts[0]).index_copy_(0, c.send_all, at::cat(parts));
    return {grad, at::Tensor()};
  }
};

struct Arrive : torch::autograd::Function<Arrive> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& received,
                            const std::shared_ptr<ExchangeChunks>& chunks, int64_t g) {
    ctx->saved_data["chunks"] = capsule(chunks);
    ctx->saved_data["g"] = g;
    ExchangeChunks& c = *chunks;
    wait_traced(c.rows_sent[g], "rows", static_cast<int>(g));
    return received.index_select(0, c.to_expert_major[g]);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    ExchangeChunks& c = chunks_of(ctx);
    const int g = static_cast<int>(ctx->saved_data["g"].toInt());
    // The gradient of what arrived (received order); its exchange back is LaunchRows's
    // backward's, issued here so that it overlaps the next chunk's experts.
    const at::Tensor received_grad = grads[0].index_select(0, c.to_rank_major[g]);
    c.row_grads_pending[g] = received_grad;
    c.row_grads[g] = rows_buffer(sum(c.send[g]), c, grads[0]);
    while (c.next_row_grads >= 0 && c.row_grads_pending[c.next_row_grads].defined()) {
      const int h = c.next_row_grads--;
      c.row_grads_sent[h] = issue(c, c.row_grads[h], c.row_grads_pending[h], c.recv[h], c.send[h]);
      c.row_grads_pending[h] = at::Tensor();
    }
    return {received_grad, at::Tensor(), at::Tensor()};
  }
};

struct SendBack : torch::autograd::Function<SendBack> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            const std::shared_ptr<ExchangeChunks>& chunks, int64_t g) {
    ctx->saved_data["chunks"] = capsule(chunks);
    ctx->saved_data["g"] = g;
    ExchangeChunks& c = *chunks;
    at::Tensor out = rows_buffer(sum(c.send[g]), c, y);
    c.outputs_sent[g] = issue(c, out, y.index_select(0, c.to_rank_major[g]), c.recv[g], c.send[g]);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    ExchangeChunks& c = chunks_of(ctx);
    const int g = static_cast<int>(ctx->saved_data["g"].toInt());
    wait_traced(c.output_grads_sent[g], "output gradients", g);
    at::Tensor grad = c.output_grads[g].index_select(0, c.to_expert_major[g]);
    c.output_grads[g] = at::Tensor();
    return {grad, at::Tensor(), at::Tensor()};
  }
};

struct Gather : torch::autograd::Function<Gather> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList back,
                            const std::shared_ptr<ExchangeChunks>& chunks) {
    ctx->saved_data["chunks"] = capsule(chunks);
    ExchangeChunks& c = *chunks;
    for (int g = 0; g < c.count; ++g) wait_traced(c.outputs_sent[g], "outputs", g);
    return rows_buffer(c.rows, c, back[0]).index_copy_(0, c.send_all, at::cat(back));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    ExchangeChunks& c = chunks_of(ctx);
    const at::Tensor grad = grads[0].contiguous();
    // A fresh backward pass (a second one after retain_graph too) starts the rows' gradients
    // from the last chunk.
    c.next_row_grads = c.count - 1;
    c.row_grads_pending.assign(c.count, at::Tensor());
    // Each chunk's share of the gradient is what this node returns for it; its exchange to
    // the experts' ranks is SendBack's backward's, issued here for every chunk at once.
    torch::autograd::variable_list out(c.count + 1);
    for (int g = c.count - 1; g >= 0; --g) {
      out[g] = grad.index_select(0, c.send_index[g]);
      c.output_grads[g] = rows_buffer(sum(c.recv[g]), c, grad);
      c.output_grads_sent[g] = issue(c, c.output_grads[g], out[g], c.send[g], c.recv[g]);
    }
    return out;
  }
};

std::vector<int64_t> host_longs(const at::Tensor& t) {
  const at::Tensor h = t.to(c10::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel());
}

}  // namespace

InFlight launch_chunks(const at::Tensor& sent, const CommPtr& group, const at::Tensor& send_counts,
                       const at::Tensor& recv_counts, int64_t local_experts, int chunks) {
  const int64_t L = local_experts;
  HP_CHECK(chunks >= 1 && chunks <= L, "ep: ", chunks, " overlap chunks for ", L,
           " local experts (a chunk is a whole number of experts: 1 to ", L, ")");
  HP_CHECK(sent.dim() == 2, "ep: the rows sent must be [rows, dim], got shape ", sent.sizes());
  const int n = group ? group->size() : 1;
  const std::vector<int64_t> sc = host_longs(send_counts), rc = host_longs(recv_counts);
  HP_CHECK(static_cast<int64_t>(sc.size()) == n * L && static_cast<int64_t>(rc.size()) == n * L, "ep: ", sc.size(),
           " and ", rc.size(), " counts for ", n, " ranks of ", L, " local experts");
  auto c = std::make_shared<ExchangeChunks>();
  c->group = group;
  c->count = chunks;
  c->rows = sent.size(0);
  c->dim = sent.size(1);
  for (int g = 0; g <= chunks; ++g) c->first.push_back(g * L / chunks);
  std::vector<int64_t> start(sc.size(), 0);  // where each (rank, expert) block of the sent rows begins
  for (size_t i = 1; i < sc.size(); ++i) start[i] = start[i - 1] + sc[i - 1];
  const at::TensorOptions longs = at::TensorOptions(at::kLong);
  for (int g = 0; g < chunks; ++g) {
    const int64_t lo = c->first[g], hi = c->first[g + 1];
    std::vector<int64_t> send(n, 0), recv(n, 0), counts(hi - lo, 0), index, received;
    for (int r = 0; r < n; ++r) {
      for (int64_t i = lo; i < hi; ++i) {
        send[r] += sc[r * L + i];
        recv[r] += rc[r * L + i];
        counts[i - lo] += rc[r * L + i];
        received.push_back(rc[r * L + i]);
      }
      for (int64_t j = 0; j < send[r]; ++j) index.push_back(start[r * L + lo] + j);
    }
    c->send.push_back(send);
    c->recv.push_back(recv);
    c->counts.push_back(counts);
    c->send_index.push_back(at::tensor(index, longs).to(sent.device()));
    const at::Tensor em = expert_major_order(at::tensor(received, longs), hi - lo);
    c->to_expert_major.push_back(em.to(sent.device()));
    c->to_rank_major.push_back(inverse_permutation(em).to(sent.device()));
  }
  c->send_all = at::cat(c->send_index);
  c->rows_sent.resize(chunks);
  c->outputs_sent.resize(chunks);
  c->output_grads_sent.resize(chunks);
  c->row_grads_sent.resize(chunks);
  c->output_grads.resize(chunks);
  c->row_grads.resize(chunks);
  c->row_grads_pending.resize(chunks);
  return InFlight(std::move(c), sent);
}

InFlight::InFlight(std::shared_ptr<ExchangeChunks> chunks, at::Tensor sent) : chunks_(std::move(chunks)) {
  arrived_ = LaunchRows::apply(sent, chunks_);
  back_.resize(chunks_->count);
}

int InFlight::chunks() const { return chunks_ ? chunks_->count : 0; }

int64_t InFlight::chunk_first(int g) const {
  HP_CHECK(chunks_ && g >= 0 && g <= chunks_->count, "ep: chunk ", g, " of ", chunks(), " overlap chunks");
  return chunks_->first[g];
}

const std::vector<int64_t>& InFlight::counts(int g) const {
  HP_CHECK(chunks_ && g >= 0 && g < chunks_->count, "ep: chunk ", g, " of ", chunks(), " overlap chunks");
  return chunks_->counts[g];
}

at::Tensor InFlight::rows(int g) {
  HP_CHECK(chunks_ && g == next_rows_ && g < chunks_->count, "ep: the rows of overlap chunk ", g,
           " taken out of order (next: ", next_rows_, " of ", chunks(), ")");
  HP_CHECK(next_back_ == g, "ep: the rows of overlap chunk ", g, " taken before chunk ", next_back_,
           "'s outputs were sent back");
  ++next_rows_;
  at::Tensor rows = Arrive::apply(arrived_[g], chunks_, static_cast<int64_t>(g));
  arrived_[g] = at::Tensor();
  return rows;
}

void InFlight::send_back(int g, const at::Tensor& y) {
  HP_CHECK(chunks_ && g == next_back_ && g < next_rows_, "ep: outputs of overlap chunk ", g,
           " sent back out of order (next: ", next_back_, ", rows taken of ", next_rows_, ")");
  const int64_t rows = sum(chunks_->counts[g]);
  HP_CHECK(y.dim() == 2 && y.size(0) == rows && y.size(1) == chunks_->dim, "ep: the outputs of overlap chunk ", g,
           " must be [", rows, ", ", chunks_->dim, "] (one row per row received), got shape ", y.sizes());
  back_[g] = SendBack::apply(y, chunks_, static_cast<int64_t>(g));
  ++next_back_;
}

at::Tensor InFlight::returned() {
  HP_CHECK(chunks_ && next_back_ == chunks_->count, "ep: the outputs returned before every overlap chunk's were sent back (",
           next_back_, " of ", chunks(), ")");
  at::Tensor out = Gather::apply(at::TensorList(back_), chunks_);
  back_.clear();
  return out;
}

}  // namespace hp::ep
