// ckpt_bench: checkpoint save and load against plain file I/O of the same bytes, in one run.
//
//   mpirun -np N build/ckpt_bench [MB] [DIR]
//
// A state of MB megabytes (default 256) of fp32 tensors, each split on dim 0 over the N
// ranks (as fully_shard's shards are). Each measurement is the median of 3, the slowest rank:
//   save        hp::ckpt::save (data files, read back for the block checksums, fsync, metadata,
//               the commit rename) against each rank writing the same bytes to one file with
//               write() and fsync() — the plain baseline
//   load        hp::ckpt::load into the same layout against each rank reading its file back
//               with read() (both from the page cache: what is compared is the work above
//               the disk)
//   reshard     load into another layout (dim 0 split in reverse rank order, every box
//               read from another rank's file) against load into the same layout
//   async       what the training thread waits for when the save goes to a background thread
//               (the copy of the state) against the synchronous save
#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "hp/ckpt/checkpoint.h"
#include "hp/core/files.h"
#include "hp/runtime.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The slowest rank's time of `fn`, median of 3.
template <typename Fn>
double timed(const hp::CommPtr& w, Fn fn) {
  std::vector<double> t;
  for (int i = 0; i < 3; ++i) {
    w->barrier().wait();
    const double t0 = now_s();
    fn();
    at::Tensor x = at::full({1}, now_s() - t0, at::kDouble);
    w->all_reduce(x, {hp::ReduceOp::MAX}).wait();
    t.push_back(x.item<double>());
  }
  return hp::bench::median(t);
}

void plain_write(const std::string& path, const std::vector<hp::ckpt::Item>& items) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) std::abort();
  for (const auto& it : items) {
    const char* p = static_cast<const char*>(it.local.data_ptr());
    size_t left = it.local.nbytes();
    while (left > 0) {
      ssize_t r = ::write(fd, p, left);
      if (r <= 0) std::abort();
      p += r;
      left -= static_cast<size_t>(r);
    }
  }
  ::fsync(fd);
  ::close(fd);
}

void plain_read(const std::string& path, std::vector<hp::ckpt::Item>& items) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::abort();
  for (auto& it : items) {
    char* p = static_cast<char*>(it.local.data_ptr());
    size_t left = it.local.nbytes();
    while (left > 0) {
      ssize_t r = ::read(fd, p, left);
      if (r <= 0) std::abort();
      p += r;
      left -= static_cast<size_t>(r);
    }
  }
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  hp::init();
  {
    auto w = hp::world();
    const int n = w->size(), r = w->rank();
    const int64_t mb = argc > 1 ? std::atoll(argv[1]) : 256;
    const std::string root = argc > 2 ? argv[2] : "/tmp/hp_ckpt_bench";
    const int64_t rows = 1024, cols = 1024;  // 4 MiB per tensor
    const int64_t tensors = std::max<int64_t>(1, mb / 4);
    // Each rank's rows of every tensor; `reverse`: rank r holds what rank n-1-r holds otherwise.
    auto make = [&](bool reverse, bool fill) {
      std::vector<hp::ckpt::Item> items;
      const int idx = reverse ? n - 1 - r : r;
      for (int64_t t = 0; t < tensors; ++t) {
        hp::ShardSpec s = hp::make_shard_spec({rows, cols}, {{hp::DimSplit{"dp_shard", n, idx}}, {}});
        at::Tensor local = fill ? at::randn(s.lengths, at::detail::createCPUGenerator(t * 131 + idx))
                                : at::empty(s.lengths, at::kFloat);
        items.push_back({"t" + std::to_string(t), local, s});
      }
      return items;
    };
    auto items = make(false, true);
    const std::string dir = root + "/ckpt", plain = root + "/plain_rank" + std::to_string(r);
    if (r == 0) std::filesystem::create_directories(root);
    w->barrier().wait();

    const double save_s = timed(w, [&] { hp::ckpt::save(items, dir, w); });
    const double write_s = timed(w, [&] { plain_write(plain, items); });
    auto into = make(false, false);
    const double load_s = timed(w, [&] { hp::ckpt::load(into, dir); });
    const double read_s = timed(w, [&] { plain_read(plain, into); });
    auto other = make(true, false);
    const double reshard_s = timed(w, [&] { hp::ckpt::load(other, dir); });
    // Async: the training thread copies the state and hands it to a thread with its own
    // communicator; it waits only for the copy.
    auto ckpt_comm = w->split(0, r);
    std::vector<double> waits;
    for (int i = 0; i < 3; ++i) {
      w->barrier().wait();
      const double t0 = now_s();
      std::vector<hp::ckpt::Item> copy = items;
      for (auto& it : copy) it.local = it.local.clone();
      std::thread saver([copy = std::move(copy), &dir, ckpt_comm] { hp::ckpt::save(copy, dir + "_async", ckpt_comm); });
      at::Tensor x = at::full({1}, now_s() - t0, at::kDouble);  // training would go on from here
      saver.join();
      w->all_reduce(x, {hp::ReduceOp::MAX}).wait();
      waits.push_back(x.item<double>());
    }
    const double async_wait_s = hp::bench::median(waits);

    const double total_mb = static_cast<double>(tensors * rows * cols * 4) / 1048576.0;
    if (r == 0) {
      std::printf("ckpt_bench: %d rank(s), %lld tensors, %.0f MiB in all (%.0f MiB per rank), dir %s\n", n,
                  static_cast<long long>(tensors), total_mb, total_mb / n, root.c_str());
      std::printf("| | hp::ckpt | plain I/O | ckpt throughput / plain |\n|---|---:|---:|---:|\n");
      std::printf("| save | %.3f s (%.0f MiB/s) | %.3f s (%.0f MiB/s) | %.2f |\n", save_s, total_mb / save_s, write_s,
                  total_mb / write_s, write_s / save_s);
      std::printf("| load | %.3f s (%.0f MiB/s) | %.3f s (%.0f MiB/s) | %.2f |\n", load_s, total_mb / load_s, read_s,
                  total_mb / read_s, read_s / load_s);
      std::printf("reshard: load into another layout %.3f s vs the same layout %.3f s (%.2fx)\n", reshard_s, load_s,
                  reshard_s / load_s);
      std::printf("async: the training thread waits %.3f s vs %.3f s for a synchronous save (%.1f%%)\n",
                  async_wait_s, save_s, 100.0 * async_wait_s / save_s);
    }
    w->barrier().wait();
    if (r == 0) hp::files::remove_tree(root);
  }
  hp::finalize();
  return 0;
}
