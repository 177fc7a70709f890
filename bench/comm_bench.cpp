// comm_bench: bus bandwidth of hp::Communicator against the same raw MPI calls.
//
// For each op (all_gather, reduce_scatter, all_reduce), dtype (fp32, bf16) and size, the
// hp op and the raw MPI call run interleaved in rounds, so both see the same machine
// state. Times are the slowest rank's, the median over rounds. Bandwidths follow the
// nccl-tests formulas: algbw = bytes / time; busbw = algbw * 2(n-1)/n for all_reduce and
// * (n-1)/n for all_gather and reduce_scatter, where bytes is the full buffer (all_gather
// output, reduce_scatter input, all_reduce buffer). Raw MPI has no bf16 type: bf16 rows
// compare with the fp32 raw call moving the same number of bytes.
//
// Then ping_pong (fp32): rank 0 sends to rank 1 and waits for it to send the same bytes
// back, against MPI_Send / MPI_Recv; the time is one round trip (the latency a pipeline's
// receive waits), busbw the bytes both ways over it.
//
//   mpirun -np 2 build/comm_bench [--min 4096] [--max 67108864] [--rounds 5] [--json out.json]
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
  std::string json;
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
  for (const char* op : {"all_gather", "reduce_scatter", "all_reduce"}) {
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
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
        if (opname == "all_gather") {
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
        Row row{opname, dt == at::kFloat ? "fp32" : "bf16", real_bytes, hp_s, raw_s, 0, 0};
        row.hp_busbw = real_bytes / row.hp_s * factor / 1e9;
        row.raw_busbw = real_bytes / row.raw_s * factor / 1e9;
        if (r == 0) {
          std::printf("%-15s %-5s %10lld %11.1f %11.1f %9.2f GB/s %7.2f GB/s %7.2fx\n", op,
                      row.dtype.c_str(), static_cast<long long>(real_bytes), row.hp_s * 1e6,
                      row.raw_s * 1e6, row.hp_busbw, row.raw_busbw, row.raw_s / row.hp_s);
          std::fflush(stdout);
        }
        rows.push_back(row);
      }
    }
  }
  // Round trips between ranks 0 and 1 (the others wait at the timing's barriers).
  for (int64_t bytes = min_bytes; bytes <= max_bytes && n >= 2; bytes *= 4) {
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
