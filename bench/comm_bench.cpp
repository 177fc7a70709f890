// comm_bench: bus bandwidth of hp::Communicator against the same raw MPI calls.
//
// For each op (all_gather, reduce_scatter, all_reduce, all_to_all), dtype (fp32, bf16;
// all_to_all fp32 only) and size, the
// hp op and the raw MPI call run interleaved in rounds, so both see the same machine
// state. Times are the slowest rank's, the median over rounds. Bandwidths follow the
// nccl-tests formulas: algbw = bytes / time; busbw = algbw * 2(n-1)/n for all_reduce and
// * (n-1)/n for all_gather and reduce_scatter, where bytes is the full buffer (all_gather
// output, reduce_scatter input, all_reduce buffer). Raw MPI has no bf16 type: bf16 rows
// compare with the fp32 raw call moving the same number of bytes.
//
// all_to_all runs with uneven splits (as expert parallelism's token exchange does): rank r
// sends u x (1 + (r + 2q) % 3) elements to rank q, u = bytes / (8 n) fp32 elements, against
// MPI_Alltoallv on the same counts; bytes is rank 0's send buffer, busbw bytes / time x
// (n-1)/n.
//
// Then ping_pong (fp32): rank 0 sends to rank 1 and waits for it to send the same bytes
// back, against MPI_Send / MPI_Recv; the time is one round trip (the latency a pipeline's
// receive waits), busbw the bytes both ways over it.
//
//   mpirun -np 2 build/comm_bench [--min 4096] [--max 67108864] [--rounds 5] [--op NAME]
//                                 [--json out.json]
#include <ATen/ATen.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "hp/runtime.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Seconds per call of fn (k calls), slowest rank.
double time_calls(const std::function<void()>& fn, int k) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = now_s();
  for (int i = 0; i < k; ++i) fn();
  double t = (now_s() - t0) / k;
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

// Seconds per call of hp_fn and of raw_fn: warmed up, batched so that one measurement
// takes about 30 ms, timed in `rounds` interleaved rounds; the medians.
std::pair<double, double> time_interleaved(const std::function<void()>& hp_fn, const std::function<void()>& raw_fn,
                                           int rounds) {
  hp_fn();
  raw_fn();
  double est = std::max(time_calls(hp_fn, 1), time_calls(raw_fn, 1));
  int k = static_cast<int>(std::clamp(0.03 / std::max(est, 1e-7), 1.0, 500.0));
  MPI_Bcast(&k, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<double> th, tr;
  for (int round = 0; round < rounds; ++round) {
    th.push_back(time_calls(hp_fn, k));
    tr.push_back(time_calls(raw_fn, k));
  }
  return {hp::bench::median(th), hp::bench::median(tr)};
}

struct Row {
  std::string op, dtype;
  int64_t bytes;
  double hp_s, raw_s, hp_busbw, raw_busbw;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t min_bytes = 4096, max_bytes = 64 << 20;
  int rounds = 5;
  std::string json, only;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "comm_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--min") min_bytes = std::stoll(next());
    else if (a == "--max") max_bytes = std::stoll(next());
    else if (a == "--rounds") rounds = std::stoi(next());
    else if (a == "--json") json = next();
    else if (a == "--op") only = next();
    else {
      std::fprintf(stderr, "comm_bench: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  hp::CommPtr world = hp::init();
  const int n = world->size(), r = world->rank();
  if (world->backend() != "mpi") {
    std::fprintf(stderr, "comm_bench: run under mpirun (backend is %s)\n", world->backend().c_str());
    return 2;
  }
  std::vector<Row> rows;
  if (r == 0) {
    std::printf("comm_bench: %d ranks, %d rounds, median of the slowest rank's time\n", n, rounds);
    std::printf("%-15s %-5s %10s %11s %11s %11s %11s %8s\n", "op", "dtype", "bytes", "hp_us",
                "raw_us", "hp_busbw", "raw_busbw", "hp/raw");
  }
  for (const char* op : {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}) {
    if (!only.empty() && only != op) continue;
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      if (std::string(op) == "all_to_all" && dt != at::kFloat) continue;  // raw MPI has no bf16
      for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
        const int64_t es = c10::elementSize(dt);
        const int64_t numel = std::max<int64_t>(n, bytes / es / n * n);
        const int64_t real_bytes = numel * es;
        const int64_t fnumel = real_bytes / 4;  // raw fp32 call of the same bytes
        std::string opname = op;
        at::Tensor big = at::randn({numel}).to(dt);
        at::Tensor small = at::empty({numel / n}, dt);
        at::Tensor fbig = at::randn({fnumel});
        at::Tensor fsmall = at::randn({fnumel / n});  // touched, like the hp buffers
        std::function<void()> hp_fn, raw_fn;
        double factor;
        // all_to_all's uneven splits (elements to / from each rank) and MPI's displacements.
        hp::AllToAllOptions split;
        std::vector<int> send_counts(n), recv_counts(n), send_displs(n), recv_displs(n);
        int64_t sent = 0, received = 0;
        if (opname == "all_to_all") {
          const int64_t u = std::max<int64_t>(1, bytes / 8 / n);
          for (int q = 0; q < n; ++q) {
            split.input_split_sizes.push_back(u * (1 + (r + 2 * q) % 3));
            split.output_split_sizes.push_back(u * (1 + (q + 2 * r) % 3));
            send_displs[q] = static_cast<int>(sent);
            recv_displs[q] = static_cast<int>(received);
            send_counts[q] = static_cast<int>(split.input_split_sizes.back());
            recv_counts[q] = static_cast<int>(split.output_split_sizes.back());
            sent += split.input_split_sizes.back();
            received += split.output_split_sizes.back();
          }
        }
        at::Tensor a2a_in = at::randn({sent}), a2a_out = at::empty({received});
        at::Tensor raw_in = at::randn({sent}), raw_out = at::empty({received});
        int64_t row_bytes = real_bytes;
        if (opname == "all_to_all") {
          factor = double(n - 1) / n;
          // Rank 0's send buffer (the same on every rank: the table's size).
          int64_t rank0 = 0;
          for (int q = 0; q < n; ++q) rank0 += std::max<int64_t>(1, bytes / 8 / n) * (1 + (2 * q) % 3);
          row_bytes = rank0 * 4;
          hp_fn = [&] { world->all_to_all(a2a_out, a2a_in, split).wait(); };
          raw_fn = [&] {
            MPI_Alltoallv(raw_in.data_ptr(), send_counts.data(), send_displs.data(), MPI_FLOAT, raw_out.data_ptr(),
                          recv_counts.data(), recv_displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
          };
        } else if (opname == "all_gather") {
          factor = double(n - 1) / n;
          small.copy_(big.narrow(0, 0, numel / n));
          hp_fn = [&] { world->all_gather(big, small).wait(); };
          raw_fn = [&] {
            MPI_Allgather(fsmall.data_ptr(), fnumel / n, MPI_FLOAT, fbig.data_ptr(), fnumel / n,
                          MPI_FLOAT, MPI_COMM_WORLD);
          };
        } else if (opname == "reduce_scatter") {
          factor = double(n - 1) / n;
          hp_fn = [&] { world->reduce_scatter(small, big).wait(); };
          raw_fn = [&] {
            MPI_Reduce_scatter_block(fbig.data_ptr(), fsmall.data_ptr(), fnumel / n, MPI_FLOAT,
                                     MPI_SUM, MPI_COMM_WORLD);
          };
        } else {
          factor = 2.0 * (n - 1) / n;
          // Sum of n ranks' values stays finite: the input is not reset between calls.
          big.zero_();
          fbig.zero_();
          hp_fn = [&] { world->all_reduce(big).wait(); };
          raw_fn = [&] {
            MPI_Allreduce(MPI_IN_PLACE, fbig.data_ptr(), fnumel, MPI_FLOAT, MPI_SUM,
                          MPI_COMM_WORLD);
          };
        }
        auto [hp_s, raw_s] = time_interleaved(hp_fn, raw_fn, rounds);
        Row row{opname, dt == at::kFloat ? "fp32" : "bf16", row_bytes, hp_s, raw_s, 0, 0};
        row.hp_busbw = row_bytes / row.hp_s * factor / 1e9;
        row.raw_busbw = row_bytes / row.raw_s * factor / 1e9;
        if (r == 0) {
          std::printf("%-15s %-5s %10lld %11.1f %11.1f %9.2f GB/s %7.2f GB/s %7.2fx\n", op,
                      row.dtype.c_str(), static_cast<long long>(row_bytes), row.hp_s * 1e6,
                      row.raw_s * 1e6, row.hp_busbw, row.raw_busbw, row.raw_s / row.hp_s);
          std::fflush(stdout);
        }
        rows.push_back(row);
      }
    }
  }
  // Round trips between ranks 0 and 1 (the others wait at the timing's barriers).
  for (int64_t bytes = min_bytes; bytes <= max_bytes && n >= 2 && (only.empty() || only == "ping_pong"); bytes *= 4) {
    const int64_t numel = std::max<int64_t>(1, bytes / 4), real_bytes = numel * 4;
    at::Tensor x = at::randn({numel});
    std::function<void()> hp_fn = [&] {
      if (r == 0) {
        world->send(x, 1).wait();
        world->recv(x, 1).wait();
      } else if (r == 1) {
        world->recv(x, 0).wait();
        world->send(x, 0).wait();
      }
    };
    std::function<void()> raw_fn = [&] {
      const int c = static_cast<int>(numel);
      if (r == 0) {
        MPI_Send(x.data_ptr(), c, MPI_FLOAT, 1, 7, MPI_COMM_WORLD);
        MPI_Recv(x.data_ptr(), c, MPI_FLOAT, 1, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (r == 1) {
        MPI_Recv(x.data_ptr(), c, MPI_FLOAT, 0, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(x.data_ptr(), c, MPI_FLOAT, 0, 7, MPI_COMM_WORLD);
      }
    };
    auto [hp_s, raw_s] = time_interleaved(hp_fn, raw_fn, rounds);
    Row row{"ping_pong", "fp32", real_bytes, hp_s, raw_s, 0, 0};
    row.hp_busbw = 2.0 * real_bytes / row.hp_s / 1e9;
    row.raw_busbw = 2.0 * real_bytes / row.raw_s / 1e9;
    if (r == 0) {
      std::printf("%-15s %-5s %10lld %11.1f %11.1f %9.2f GB/s %7.2f GB/s %7.2fx\n", "ping_pong", "fp32",
                  static_cast<long long>(real_bytes), row.hp_s * 1e6, row.raw_s * 1e6, row.hp_busbw, row.raw_busbw,
                  row.raw_s / row.hp_s);
      std::fflush(stdout);
    }
    rows.push_back(row);
  }
  if (r == 0) {
    // reduce_scatter against hp's own all_gather at the same size and dtype
    std::printf("\nreduce_scatter busbw / all_gather busbw (hp, same size and dtype):\n");
    for (const Row& rs : rows) {
      if (rs.op != "reduce_scatter") continue;
      for (const Row& ag : rows) {
        if (ag.op == "all_gather" && ag.dtype == rs.dtype && ag.bytes == rs.bytes) {
          std::printf("  %-5s %10lld  %.2fx\n", rs.dtype.c_str(), static_cast<long long>(rs.bytes),
                      rs.hp_busbw / ag.hp_busbw);
        }
      }
    }
  }
  if (r == 0 && !json.empty()) {
    std::ofstream f(json);
    f << "{\"ranks\":" << n << ",\"rows\":[\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& w = rows[i];
      f << "{\"op\":\"" << w.op << "\",\"dtype\":\"" << w.dtype << "\",\"bytes\":" << w.bytes
        << ",\"hp_us\":" << w.hp_s * 1e6 << ",\"raw_us\":" << w.raw_s * 1e6
        << ",\"hp_busbw_gbps\":" << w.hp_busbw << ",\"raw_busbw_gbps\":" << w.raw_busbw
        << ",\"hp_over_raw\":" << w.raw_s / w.hp_s << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    f << "]}\n";
  }
  hp::finalize();
  return 0;
}
