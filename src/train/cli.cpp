#include "hp/train/cli.h"

#include <torch/cuda.h>

#include <cctype>
#include <map>
#include <sstream>

#include "hp/comm/simulated_network.h"
#include "hp/config.h"
#include "hp/core/env.h"
#include "hp/core/error.h"
#include "hp/train/config.h"

namespace hp::train {

const char* const kUsage =
    "usage: hp-train --config FILE [--set key=value]... [--verify] [--strict]\n"
    "                [--resume [DIR] | --auto-resume | --overwrite] [--elastic]\n"
    "       hp-train --config FILE [--set key=value]... --estimate [--world N]\n"
    "       hp-train --config FILE [--set key=value]... --plan --world N [--ranks-per-node K]\n"
    "                [--link SPEC] [--device-tflops X] [--memory-per-rank N] [--json]\n"
    "       hp-train --export-hf CKPT_DIR OUT_DIR [--dtype fp32|bf16|fp16|fp8] [--max-shard-size N] [--without-mtp]\n"
    "       hp-train --upgrade-checkpoint CKPT_DIR\n"
    "       hp-train --list-keys\n"
    "  --config FILE    YAML config (configs/*.yaml)\n"
    "  --set key=value  override a config key (dotted for sections: model.dim=128)\n"
    "  --verify         also train in one process on the global batch and compare losses\n"
    "  --strict         a collapsed model (gradient norm 0 at the loss of uniform guessing,\n"
    "                   ln vocab) stops the run as a divergence, not with a warning\n"
    "  --resume [DIR]   continue from a checkpoint: DIR, or the newest under save_dir\n"
    "  --auto-resume    continue from save_dir's newest checkpoint when there is one, else\n"
    "                   start (what scripts/launch.sh passes when it relaunches a run)\n"
    "  --resume-changes KEYS\n"
    "                   settings (comma-separated keys) a resume may change that change the\n"
    "                   run's course: lr, train_steps, seed, ... (without it such a change is\n"
    "                   refused; a change of layout, intervals or folders is always allowed)\n"
    "  --elastic        with --resume or --auto-resume, a checkpoint written on another number\n"
    "                   of ranks resumes on this one: its tensor and pipeline degrees, the\n"
    "                   global batch and the micro-batch size kept, the rest of the layout\n"
    "                   the planner's fastest (--link, --ranks-per-node, --device-tflops and\n"
    "                   --memory-per-rank as for --plan); what scripts/launch.sh --min-ranks\n"
    "                   passes\n"
    "  --overwrite      start over where save_dir holds an earlier run's checkpoints,\n"
    "                   deleting them (without it, or --resume, such a run is refused)\n"
    "  --estimate       print the parameter count and per-rank memory of the config's layout\n"
    "                   and exit, allocating nothing (any size, deepseek_v3 included)\n"
    "  --world N        the number of ranks --estimate and --plan assume (default: this run's)\n"
    "  --plan           every layout of the config over --world ranks (data_parallel x\n"
    "                   data_parallel_shard x tensor_parallel x pipeline_parallel), with its\n"
    "                   memory per rank and predicted step time, fastest first; the compute is\n"
    "                   timed here (or counted in FLOPs at --device-tflops, for one GPU a rank),\n"
    "                   the communication modelled over --link (HP_SIM_NET's syntax, default\n"
    "                   HP_SIM_NET, else this machine's shared memory, measured); --ranks-per-node\n"
    "                   sets the node size; --json prints one JSON object per layout\n"
    "  --export-hf CKPT_DIR OUT_DIR\n"
    "                   write a checkpoint's Llama to the new folder OUT_DIR in Hugging Face's\n"
    "                   layout (config.json, safetensors shards, index); CKPT_DIR may be a\n"
    "                   save_dir (its latest checkpoint is exported). Under mpirun the\n"
    "                   ranks share the files. --dtype: the weights' dtype (default: the\n"
    "                   parameters'; fp8: the projections as float8_e4m3fn with a scale per\n"
    "                   128 x 128 block, as DeepSeek-V3 publishes them, the rest bf16);\n"
    "                   --max-shard-size: bytes per file (5GB; K/M/GB suffixes);\n"
    "                   --without-mtp: DeepSeek-V3's multi-token prediction module left out\n"
    "  --upgrade-checkpoint CKPT_DIR\n"
    "                   rewrite a format-1 checkpoint (written before checksums, loaded\n"
    "                   unchecked) as format 2: its data files checksummed as they are now\n"
    "  --list-keys      print every config key with its default\n"
    "Run under mpirun for several ranks; see docs/train.md.\n";

// "5GB", "500MB", "100K", "12345": decimal units, as Hugging Face writes them.
namespace {

int64_t parse_bytes(const std::string& v, const char* flag) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = v.substr(used);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::map<std::string, double> scale = {{"", 1}, {"B", 1}, {"K", 1e3}, {"KB", 1e3}, {"M", 1e6},
                                               {"MB", 1e6}, {"G", 1e9}, {"GB", 1e9}};
  auto it = scale.find(unit);
  HP_CHECK(used > 0 && it != scale.end() && x * it->second >= 1 && x * it->second < 9e18,
           "hp-train: ", flag, " ", v, ": expected a positive size in bytes (e.g. 5GB, 500MB, 1048576)");
  return static_cast<int64_t>(x * it->second);
}

// --world N, --ranks-per-node K: a whole number above 0.
int positive_ranks(const std::string& flag, const std::string& v) {
  size_t used = 0;
  int n = 0;
  try {
    n = std::stoi(v, &used);
  } catch (const std::exception&) {
    n = 0;
  }
  HP_CHECK(used == v.size() && n > 0, "hp-train: ", flag, " ", v, ": expected a positive number of ranks");
  return n;
}

}  // namespace

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto value = [&]() -> std::string {
      HP_CHECK(i + 1 < argc, "hp-train: ", s, " needs a value\n", kUsage);
      return argv[++i];
    };
    if (s == "--config") {
      a.config = value();
    } else if (s.rfind("--config=", 0) == 0) {
      a.config = s.substr(9);
    } else if (s == "--set") {
      a.overrides.push_back(value());
    } else if (s.rfind("--set=", 0) == 0) {
      a.overrides.push_back(s.substr(6));
    } else if (s == "--verify") {
      a.verify = true;
    } else if (s == "--strict") {
      a.strict = true;
    } else if (s == "--resume") {
      a.resume = true;
      if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) a.resume_dir = argv[++i];
    } else if (s.rfind("--resume=", 0) == 0) {
      a.resume = true;
      a.resume_dir = s.substr(9);
    } else if (s == "--auto-resume") {
      a.auto_resume = true;
    } else if (s == "--elastic") {
      a.elastic = true;
    } else if (s == "--resume-changes") {
      std::stringstream list(value());
      for (std::string k; std::getline(list, k, ',');) {
        HP_CHECK(!k.empty(), "hp-train: --resume-changes: an empty key in the list (keys separated by commas)");
        a.resume_changes.push_back(k);
      }
      HP_CHECK(!a.resume_changes.empty(), "hp-train: --resume-changes needs keys (e.g. lr,train_steps)");
    } else if (s == "--overwrite") {
      a.overwrite = true;
    } else if (s == "--estimate") {
      a.estimate = true;
    } else if (s == "--world") {
      a.world = positive_ranks(s, value());
    } else if (s == "--plan") {
      a.plan = true;
    } else if (s == "--json") {
      a.plan_json = true;
    } else if (s == "--ranks-per-node") {
      a.ranks_per_node = positive_ranks(s, value());
    } else if (s == "--link") {
      a.link = value();
      hp::SimulatedNetwork::parse(a.link);  // names a bad spec
    } else if (s == "--device-tflops") {
      std::string v = value();
      size_t used = 0;
      try {
        a.device_tflops = std::stod(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      // From a GFLOP/s to an EFLOP/s: outside it the figure is a typo (a unit slip), and the
      // plan would print step times of hundreds of digits.
      HP_CHECK(used == v.size() && a.device_tflops >= 1e-3 && a.device_tflops <= 1e6, "hp-train: --device-tflops ", v,
               ": expected the TFLOP/s of one device, a number in [0.001, 1000000]");
    } else if (s == "--memory-per-rank") {
      a.memory_per_rank = parse_bytes(value(), "--memory-per-rank");
    } else if (s == "--export-hf") {
      a.export_ckpt = value();
      a.export_out = value();
    } else if (s == "--upgrade-checkpoint") {
      a.upgrade_ckpt = value();
    } else if (s == "--dtype") {
      const std::string d = value();
      static const std::vector<std::pair<const char*, at::ScalarType>> kDtypes = {
          {"fp32", at::kFloat}, {"bf16", at::kBFloat16}, {"fp16", at::kHalf}};
      for (const auto& [name, t] : kDtypes) {
        if (d == name) a.export_dtype = t;
      }
      if (d == "fp8") {  // the projections in FP8 with block scales, the rest bf16
        a.export_dtype = at::kBFloat16;
        a.export_float8 = true;
      }
      HP_CHECK(a.export_dtype.has_value(), "hp-train: --dtype ", d, ": expected fp32, bf16, fp16 or fp8");
    } else if (s == "--without-mtp") {
      a.export_without_mtp = true;
    } else if (s == "--max-shard-size") {
      a.max_shard_bytes = parse_bytes(value(), "--max-shard-size");
    } else if (s == "--list-keys") {
      a.list_keys = true;
    } else if (s == "--help" || s == "-h") {
      a.help = true;
    } else {
      throw hp::Error("hp-train: unknown argument '" + s + "'\n" + kUsage);
    }
  }
  const bool exporting = !a.export_ckpt.empty();
  HP_CHECK(a.upgrade_ckpt.empty() || (a.config.empty() && a.overrides.empty() && !exporting && !a.resume &&
                                      !a.auto_resume && !a.overwrite && !a.verify && !a.estimate && !a.plan),
           "hp-train: --upgrade-checkpoint DIR only rewrites that checkpoint's metadata: nothing else with it");
  HP_CHECK(exporting || (!a.export_dtype && a.max_shard_bytes == 0 && !a.export_without_mtp),
           "hp-train: --dtype, --max-shard-size and --without-mtp only go with --export-hf");
  HP_CHECK(!exporting || (a.config.empty() && a.overrides.empty() && !a.verify && !a.resume && !a.estimate),
           "hp-train: --export-hf takes the model from the checkpoint: no --config, --set, --verify, --resume or "
           "--estimate with it");
  if (!a.help && !a.list_keys && !exporting && a.upgrade_ckpt.empty()) {
    HP_CHECK(!a.config.empty(), "hp-train: --config is required\n", kUsage);
  }
  HP_CHECK(a.world == 0 || a.estimate || a.plan, "hp-train: --world only goes with --estimate or --plan");
  HP_CHECK(a.plan || !a.plan_json, "hp-train: --json only goes with --plan");
  HP_CHECK(a.plan || a.elastic || (a.ranks_per_node == 0 && a.link.empty() && a.device_tflops == 0 && a.memory_per_rank == 0),
           "hp-train: --ranks-per-node, --link, --device-tflops and --memory-per-rank only go with --plan or --elastic");
  HP_CHECK(!a.elastic || a.resume || a.auto_resume, "hp-train: --elastic goes with --resume or --auto-resume (it "
           "lays out a resumed run on the ranks it has)");
  HP_CHECK(a.device_tflops == 0 || a.memory_per_rank > 0, "hp-train: --device-tflops plans for devices, whose memory "
           "this machine cannot tell: give --memory-per-rank too (a device's memory, e.g. 80GB)");
  HP_CHECK(!(a.plan && (a.estimate || a.verify || a.resume || exporting)),
           "hp-train: --plan only predicts: no --estimate, --verify, --resume or --export-hf with it");
  HP_CHECK(!(a.verify && a.estimate), "hp-train: --verify trains, --estimate only sizes: use one of them");
  HP_CHECK(!(a.resume && a.estimate), "hp-train: --resume trains, --estimate only sizes: use one of them");
  HP_CHECK(!(a.overwrite && (a.resume || a.auto_resume)), "hp-train: --resume continues the earlier run, --overwrite "
           "deletes it: use one of them");
  HP_CHECK(!(a.auto_resume && a.resume), "hp-train: --auto-resume is --resume where there is a checkpoint: use one "
           "of them");
  HP_CHECK(a.resume_changes.empty() || a.resume || a.auto_resume,
           "hp-train: --resume-changes goes with --resume or --auto-resume (it names what a resume may change)");
  HP_CHECK(!a.auto_resume || (!a.estimate && !a.plan && !exporting), "hp-train: --auto-resume goes with a training "
           "run only (not --estimate, --plan or --export-hf)");
  HP_CHECK(!a.overwrite || (!a.estimate && !a.plan && !exporting), "hp-train: --overwrite goes with a training run "
           "only (not --estimate, --plan or --export-hf)");
  return a;
}

std::vector<std::pair<std::string, std::string>> command_line_settings(const Args& a) {
  auto yes = [](bool b) { return std::string(b ? "yes" : "no"); };
  return {{"--verify", yes(a.verify)},
          {"--strict", yes(a.strict)},
          {"--resume", yes(a.resume) + (a.resume_dir.empty() ? "" : " " + a.resume_dir)},
          {"--overwrite", yes(a.overwrite)},
          {"--auto-resume", yes(a.auto_resume)},
          {"--elastic", yes(a.elastic)},
          {"--resume-changes", [&] {
             std::string all;
             for (const auto& k : a.resume_changes) all += (all.empty() ? "" : ",") + k;
             return all;
           }()},
          {"--estimate", yes(a.estimate)},
          {"--world", std::to_string(a.world)},
          {"--plan", yes(a.plan) + (a.plan_json ? " --json" : "")},
          {"--ranks-per-node", std::to_string(a.ranks_per_node)},
          {"--link", a.link},
          {"--device-tflops", std::to_string(a.device_tflops)},
          {"--memory-per-rank", std::to_string(a.memory_per_rank)},
          {"--export-hf", a.export_ckpt + " " + a.export_out},
          {"--upgrade-checkpoint", a.upgrade_ckpt},
          {"--dtype", std::string(a.export_dtype ? c10::toString(*a.export_dtype) : "") + (a.export_float8 ? " fp8" : "")},
          {"--max-shard-size", std::to_string(a.max_shard_bytes)},
          {"--without-mtp", yes(a.export_without_mtp)}};
}

InitOptions init_options(const Args& a) {
  InitOptions o;
  const bool trains = !a.config.empty() && !a.estimate && !a.plan && a.export_ckpt.empty();
  if (!trains) return o;
  try {
    if (env::get_string("HP_BACKEND") != "auto") return o;  // the user's choice (a bad one: hp::init names it)
    // Without NCCL in the build, or without a GPU, the default stays, and the run names
    // device=cuda as what cannot be had (training_device), on every rank alike.
    if (HP_HAVE_NCCL && torch::cuda::device_count() > 0 && load_config(a.config, a.overrides).device == Device::kCuda) {
      o.backend = "nccl";
    }
  } catch (const std::exception&) {
    // Read again, and reported, once the world is up.
  }
  return o;
}

}  // namespace hp::train
