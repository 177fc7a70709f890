// fp8_import_bench: reading DeepSeek-V3's published FP8 format (hp/ckpt/float8.h) against
// reading the same weights stored in bf16, in one run.
//
//   build/fp8_import_bench [EXPERTS] [DIR]
//
// A folder of one DeepSeek-V3 MoE block at the published sizes (hidden 7168; MLA: q_a
// 1536 x 7168, q_b 24576 x 1536, kv_a 576 x 7168, kv_b 32768 x 512, o 7168 x 16384; each
// expert's gate and up 2048 x 7168 and down 7168 x 2048), EXPERTS routed experts (default 32)
// and the shared one, written twice: as F8_E4M3 with an fp32 scale per 128 x 128 block, and
// the same values dequantized in bf16. Each is read into bf16 parameters by
// hp::ckpt::load_consolidated
//   whole      every tensor whole (one rank, or a consolidated export's reader);
//   rank 0/8   rank 0's rows of each tensor under fully_shard over 8 ranks (dim 0 split;
//              what each rank of an 8-rank import reads);
// each the median of 3 (after one read that warms the page cache: the reading is compared,
// not the disk), with the bytes this process read (/proc/self/io rchar) and the peak of the
// tensors it held while reading, the parameters included (hp::memory's counting allocator).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "hp/ckpt/consolidated.h"
#include "hp/ckpt/float8.h"
#include "hp/ckpt/safetensors.h"
#include "hp/core/files.h"
#include "hp/core/memory.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A field of /proc/self/io (bytes).
int64_t proc_field(const char* file, const std::string& key) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  }
  return -1;
}

struct Shape {
  std::string name;
  int64_t rows, cols;
};

std::vector<Shape> block_shapes(int experts) {
  const std::string a = "model.layers.3.self_attn.", m = "model.layers.3.mlp.";
  std::vector<Shape> s = {{a + "q_a_proj.weight", 1536, 7168},  {a + "q_b_proj.weight", 24576, 1536},
                          {a + "kv_a_proj_with_mqa.weight", 576, 7168}, {a + "kv_b_proj.weight", 32768, 512},
                          {a + "o_proj.weight", 7168, 16384}};
  for (int e = -1; e < experts; ++e) {
    const std::string p = e < 0 ? m + "shared_experts." : m + "experts." + std::to_string(e) + ".";
    s.push_back({p + "gate_proj.weight", 2048, 7168});
    s.push_back({p + "up_proj.weight", 2048, 7168});
    s.push_back({p + "down_proj.weight", 7168, 2048});
  }
  return s;
}

// Both folders, a tensor at a time (each file one expert's or the attention's tensors).
void write_folders(const std::vector<Shape>& shapes, const std::string& fp8, const std::string& bf16) {
  for (const std::string& d : {fp8, bf16}) {
    std::string e = hp::files::remove_tree(d);
    if (e.empty()) e = hp::files::create_folders(d);
    if (!e.empty()) throw std::runtime_error(e);
  }
  std::ofstream(fp8 + "/config.json") << R"({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})";
  std::ofstream(bf16 + "/config.json") << "{}";
  std::string map8, map16;
  at::manual_seed(1);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const at::Tensor w = at::randn({s.rows, s.cols}) * 0.02;
    auto [codes, scales] = hp::ckpt::quantize_e4m3fn_blocks(w);
    const std::string file = "part-" + std::to_string(i) + ".safetensors";
    hp::ckpt::write_file(fp8 + "/" + file, {{s.name, codes}, {hp::ckpt::float8_scale_name(s.name), scales}}, {},
                         *hp::ckpt::local_storage(), {s.name});
    const at::Tensor deq = hp::ckpt::dequantize_e4m3fn_blocks(codes, scales, 0, 0);
    hp::ckpt::write_file(bf16 + "/" + file, {{s.name, deq.to(at::kBFloat16)}});
    map8 += std::string(map8.empty() ? "" : ",") + "\"" + s.name + "\":\"" + file + "\",\"" +
            hp::ckpt::float8_scale_name(s.name) + "\":\"" + file + "\"";
    map16 += std::string(map16.empty() ? "" : ",") + "\"" + s.name + "\":\"" + file + "\"";
  }
  std::ofstream(fp8 + "/model.safetensors.index.json") << "{\"weight_map\":{" << map8 << "}}";
  std::ofstream(bf16 + "/model.safetensors.index.json") << "{\"weight_map\":{" << map16 << "}}";
}

struct Reading {
  double seconds = 0;
  int64_t bytes = 0, peak = 0;
};

// Reads every tensor's box (rows [0, rows / ranks) of each; ranks 1: whole) into bf16.
Reading read(const std::vector<Shape>& shapes, const std::string& dir, int ranks) {
  std::vector<double> t;
  Reading r;
  for (int k = 0; k < 4; ++k) {
    std::vector<hp::ckpt::Item> items;
    for (const Shape& s : shapes) {
      hp::ShardSpec spec = hp::make_shard_spec({s.rows, s.cols}, {{{"dp_shard", ranks, 0}}, {}});
      items.push_back({s.name, at::empty(spec.lengths, at::kBFloat16), spec});
    }
    hp::memory::reset_peak();
    const int64_t read0 = proc_field("/proc/self/io", "rchar");
    const double t0 = now_s();
    hp::ckpt::load_consolidated(items, dir);
    if (k > 0) t.push_back(now_s() - t0);  // the first warms the page cache
    r.bytes = proc_field("/proc/self/io", "rchar") - read0;
    r.peak = hp::memory::peak_bytes();
  }
  r.seconds = hp::bench::median(t);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  hp::memory::install_counting_allocator();
  const int experts = argc > 1 ? std::atoi(argv[1]) : 32;
  const std::string dir = argc > 2 ? argv[2] : "/tmp/hp_fp8_import_bench";
  const auto shapes = block_shapes(experts);
  int64_t params = 0;
  for (const Shape& s : shapes) params += s.rows * s.cols;
  std::printf("fp8_import_bench: one DeepSeek-V3 MoE block, %d routed experts and the shared one: %zu tensors, "
              "%.2f G parameters (FP8 folder %.2f GB, bf16 folder %.2f GB)\n",
              experts, shapes.size(), params / 1e9, params / 1e9, 2 * params / 1e9);
  const double t0 = now_s();
  write_folders(shapes, dir + "/fp8", dir + "/bf16");
  std::printf("written in %.1f s\n", now_s() - t0);
  std::printf("%-10s %-6s %10s %12s %14s %12s\n", "read", "folder", "seconds", "GB read", "G params/s",
              "peak GB");
  for (int ranks : {1, 8}) {
    const Reading f = read(shapes, dir + "/fp8", ranks), b = read(shapes, dir + "/bf16", ranks);
    const double p = static_cast<double>(params) / ranks;  // parameters read
    const char* what = ranks == 1 ? "whole" : "rank 0/8";
    std::printf("%-10s %-6s %10.3f %12.3f %14.2f %12.3f\n", what, "fp8", f.seconds, f.bytes / 1e9, p / f.seconds / 1e9,
                f.peak / 1e9);
    std::printf("%-10s %-6s %10.3f %12.3f %14.2f %12.3f\n", what, "bf16", b.seconds, b.bytes / 1e9, p / b.seconds / 1e9,
                b.peak / 1e9);
    std::printf("%-10s fp8 / bf16: %.2fx the time, %.2fx the bytes read\n", what, f.seconds / b.seconds,
                static_cast<double>(f.bytes) / static_cast<double>(b.bytes));
  }
  hp::files::remove_tree(dir);
  return 0;
}
