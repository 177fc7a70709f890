// hp-train: trains a reference model (DeepSeek-V3-style or Llama-style) under fully_shard.
//
//   mpirun -np 4 hp-train --config configs/deepseek_tiny.yaml [--set key=value]... [--verify]
//   hp-train --config configs/deepseek_tiny.yaml        (one process, no mpirun)
//   hp-train --list-keys
//
// Rank 0 prints one progress line per step (figures reduced over all ranks) and a
// summary; metrics go to <output_dir>/metrics.jsonl and the loss curve to
// <output_dir>/loss.svg. --verify first trains the same config in one process on the
// global batch (rank 0; the other ranks wait without spinning) and shows each step's
// loss difference against it. See docs/train.md.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cctype>
#include <cstdio>
#include <sstream>
#include <map>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <thread>

#include "hp/ckpt/checkpoint.h"
#include "hp/comm/agree.h"
#include "hp/core/env.h"
#include "hp/core/files.h"
#include "hp/core/error.h"
#include "hp/core/memory.h"
#include "hp/fsdp/memory_estimate.h"
#include "hp/runtime.h"
#include "hp/train/checkpoint_manager.h"
#include "hp/train/config.h"
#include "hp/train/plan.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"

namespace {

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  bool verify = false, list_keys = false, help = false, estimate = false;
  bool resume = false;
  std::string resume_dir;  // empty: save_dir's latest
  int world = 0;  // --world: the rank count --estimate and --plan assume (0 = this run's)
  // --plan [--ranks-per-node K] [--link SPEC] [--device-tflops X] [--memory-per-rank N] [--json]
  bool plan = false, plan_json = false;
  int ranks_per_node = 0;
  std::string link;
  double device_tflops = 0;
  int64_t memory_per_rank = 0;
  // --export-hf CKPT OUT [--dtype D] [--max-shard-size N]
  std::string export_ckpt, export_out;
  c10::optional<at::ScalarType> export_dtype;  // --dtype; unset: the parameters'
  int64_t max_shard_bytes = 0;  // 0: the default
};

const char* kUsage =
    "usage: hp-train --config FILE [--set key=value]... [--verify] [--resume [DIR]]\n"
    "       hp-train --config FILE [--set key=value]... --estimate [--world N]\n"
    "       hp-train --config FILE [--set key=value]... --plan --world N [--ranks-per-node K]\n"
    "                [--link SPEC] [--device-tflops X] [--memory-per-rank N] [--json]\n"
    "       hp-train --export-hf CKPT_DIR OUT_DIR [--dtype fp32|bf16|fp16] [--max-shard-size N]\n"
    "       hp-train --list-keys\n"
    "  --config FILE    YAML config (configs/*.yaml)\n"
    "  --set key=value  override a config key (dotted for sections: model.dim=128)\n"
    "  --verify         also train in one process on the global batch and compare losses\n"
    "  --resume [DIR]   continue from a checkpoint: DIR, or the newest under save_dir\n"
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
    "                   parameters'); --max-shard-size: bytes per file (5GB; K/M/GB suffixes)\n"
    "  --list-keys      print every config key with its default\n"
    "Run under mpirun for several ranks; see docs/train.md.\n";

// "5GB", "500MB", "100K", "12345": decimal units, as Hugging Face writes them.
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
    } else if (s == "--resume") {
      a.resume = true;
      if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) a.resume_dir = argv[++i];
    } else if (s.rfind("--resume=", 0) == 0) {
      a.resume = true;
      a.resume_dir = s.substr(9);
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
      HP_CHECK(used == v.size() && a.device_tflops > 0 && std::isfinite(a.device_tflops), "hp-train: --device-tflops ",
               v, ": expected a positive number (TFLOP/s of one device)");
    } else if (s == "--memory-per-rank") {
      a.memory_per_rank = parse_bytes(value(), "--memory-per-rank");
    } else if (s == "--export-hf") {
      a.export_ckpt = value();
      a.export_out = value();
    } else if (s == "--dtype") {
      const std::string d = value();
      static const std::vector<std::pair<const char*, at::ScalarType>> kDtypes = {
          {"fp32", at::kFloat}, {"bf16", at::kBFloat16}, {"fp16", at::kHalf}};
      for (const auto& [name, t] : kDtypes) {
        if (d == name) a.export_dtype = t;
      }
      HP_CHECK(a.export_dtype.has_value(), "hp-train: --dtype ", d, ": expected fp32, bf16 or fp16");
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
  HP_CHECK(exporting || (!a.export_dtype && a.max_shard_bytes == 0),
           "hp-train: --dtype and --max-shard-size only go with --export-hf");
  HP_CHECK(!exporting || (a.config.empty() && a.overrides.empty() && !a.verify && !a.resume && !a.estimate),
           "hp-train: --export-hf takes the model from the checkpoint: no --config, --set, --verify, --resume or "
           "--estimate with it");
  if (!a.help && !a.list_keys && !exporting) HP_CHECK(!a.config.empty(), "hp-train: --config is required\n", kUsage);
  HP_CHECK(a.world == 0 || a.estimate || a.plan, "hp-train: --world only goes with --estimate or --plan");
  HP_CHECK(a.plan || (!a.plan_json && a.ranks_per_node == 0 && a.link.empty() && a.device_tflops == 0 &&
                      a.memory_per_rank == 0),
           "hp-train: --json, --ranks-per-node, --link, --device-tflops and --memory-per-rank only go with --plan");
  HP_CHECK(!(a.plan && (a.estimate || a.verify || a.resume || exporting)),
           "hp-train: --plan only predicts: no --estimate, --verify, --resume or --export-hf with it");
  HP_CHECK(!(a.verify && a.estimate), "hp-train: --verify trains, --estimate only sizes: use one of them");
  HP_CHECK(!(a.resume && a.estimate), "hp-train: --resume trains, --estimate only sizes: use one of them");
  return a;
}

// True on every rank when `ok` is true on every rank. Otherwise the lowest failing rank
// prints its message, and all return false together (no rank is left waiting).
bool all_ok(const hp::CommPtr& world, bool ok, const std::string& message) {
  const int bad = hp::first_failed_rank(world, ok);
  if (bad < 0) return true;
  if (bad == world->rank()) {
    std::cerr << "hp-train: error" << (world->size() > 1 ? " (rank " + std::to_string(bad) + ")" : "") << ": "
              << message << std::endl;
  }
  return false;
}

// --plan: rank 0 predicts (the others wait, without spinning), every rank returns its status.
int plan(const Args& args, const hp::CommPtr& world) {
  using namespace hp::train;
  std::string error;
  if (world->rank() == 0) {
    try {
      const TrainConfig c = load_config(args.config, args.overrides);
      PlanOptions o;
      o.world = args.world > 0 ? args.world : world->size();
      const std::string spec = args.link.empty() ? hp::env::get_string("HP_SIM_NET") : args.link;
      o.network = spec.empty() ? measured_local_link() : hp::SimulatedNetwork::parse(spec);
      if (args.ranks_per_node > 0) o.network.ranks_per_node = args.ranks_per_node;
      o.device = args.device_tflops > 0;
      o.memory_per_rank = args.memory_per_rank;
      const auto rows = plan_layouts(c, o, measured_compute(c, args.device_tflops));
      if (args.plan_json) {
        std::cout << plan_json(rows) << std::flush;
      } else {
        std::cout << "plan: " << args.config << " over " << o.world << " rank(s)"
                  << (o.network.ranks_per_node > 0 ? ", " + std::to_string(o.network.ranks_per_node) + " per node"
                                                   : std::string(", one node"))
                  << "; links: " << (spec.empty() ? "this machine's shared memory (measured), " : "")
                  << o.network.to_string() << "\n";
        std::cout << format_plan(rows) << std::flush;
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  world->barrier({std::chrono::hours(24)}).wait();
  return all_ok(world, error.empty(), error) ? 0 : 1;
}

int run(const Args& args, const hp::CommPtr& world) {
  using namespace hp::train;
  const int rank = world->rank();
  const bool lead = rank == 0;
  auto say = [&](const std::string& s) {
    if (lead) std::cout << s << std::endl;
  };

  // Every check before training starts; all ranks agree on the outcome.
  TrainConfig c;
  hp::MemoryEstimate est;
  std::vector<int64_t> stage_counts;  // pipeline_parallel > 1: parameters per stage
  double construction = 0;  // bytes while building the model
  std::shared_ptr<const TokenDataset> data;
  std::unique_ptr<MetricsLog> metrics;
  std::string error;
  try {
    c = load_config(args.config, args.overrides);
    c.validate(args.world > 0 ? args.world : world->size());
    const RankMemory rm = estimate_rank_memory(c);
    est = rm.estimate;
    stage_counts = rm.stage_counts;
    construction = rm.construction;
    if (!args.estimate) {
      // Each rank builds the model without storage and materializes its shards one
      // parameter at a time: the sharded state plus one fp32 parameter, then training's.
      const double need = std::max(construction, static_cast<double>(est.total()));
      const double avail = static_cast<double>(hp::memory::available_bytes());
      const int ranks = hp::local_world_size();
      HP_CHECK(avail == 0 || need * ranks < avail, "the model (", c.model->num_params(), " parameters) needs about ",
               format_bytes(static_cast<int64_t>(std::min(need, 9e18))), " per rank (", format_bytes(est.total()),
               " sharded, without activations), but this node has ", format_bytes(static_cast<int64_t>(avail)),
               " available for ", ranks, " rank(s); see hp-train --estimate");
      data = make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);  // checks the file
      if (lead && !c.output_dir.empty()) {
        std::filesystem::create_directories(c.output_dir);
        // A previous run's curve must not sit beside this run's metrics.
        std::filesystem::remove(c.output_dir + "/loss.svg");
        metrics = std::make_unique<MetricsLog>(c.output_dir + "/metrics.jsonl");
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!all_ok(world, error.empty(), error)) return 1;
  if (!args.estimate) {
    const std::string mismatch = settings_mismatch(world, resolved_settings(c));
    if (!all_ok(world, mismatch.empty(), mismatch)) return 1;
  }

  if (args.estimate) {
    say(describe(c));
    char line[256];
    std::snprintf(line, sizeof line, "parameters: %lld (%.3g B); largest block %lld",
                  static_cast<long long>(c.model->num_params()), c.model->num_params() / 1e9,
                  static_cast<long long>(c.model->largest_block_params()));
    say(line);
    if (c.tensor_parallel > 1) {
      std::snprintf(line, sizeof line,
                    "per tensor-parallel rank, before fully_shard: %lld parameters, largest block %lld (%s whole)",
                    static_cast<long long>(c.model->params_per_tp_rank(c.tensor_parallel)),
                    static_cast<long long>(c.model->largest_block_params_per_tp_rank(c.tensor_parallel)),
                    c.model->whole_under_tp().c_str());
      say(line);
    }
    if (!stage_counts.empty()) {
      std::string st = "pipeline: " + std::to_string(stage_counts.size()) + " stages, parameters per stage (before tensor parallelism):";
      for (int64_t n : stage_counts) st += " " + std::to_string(n);
      say(st + (c.pipeline_schedule == PipelineScheduleKind::kZBV ? "; rank r holds stages r and " + std::to_string(stage_counts.size() - 1) + " - r"
                                             : "; a rank holds stages r, r + " + std::to_string(c.pipeline_parallel) + ", ..."));
    }
    say("per rank, without activations: sharded params " + format_bytes(est.sharded_params) + ", grads " +
        format_bytes(est.sharded_grads) + ", optimizer " + format_bytes(est.optimizer_state) + ", fp32 masters " +
        format_bytes(est.fp32_masters) + ", backward peak " + format_bytes(est.backward_peak_extra) +
        (est.post_forward_shares ? ", kept from forward to backward " + format_bytes(est.post_forward_shares) : "") +
        "; total " + format_bytes(est.total()));
    say("per rank while building the model: its shards plus one parameter in fp32 (the largest, " +
        std::to_string(c.model->largest_param()) + " elements): " +
        format_bytes(static_cast<int64_t>(std::min(construction, 9e18))));
    say("activations: hp-train --plan measures them (and predicts the step time) for every layout");
    return 0;
  }

  say("hp-train: " + args.config + " on " + std::to_string(world->size()) + " rank(s), backend " + world->backend() +
      ", " + std::to_string(at::get_num_threads()) + " compute thread(s) per rank (OMP_WAIT_POLICY=" +
      (std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "") + ")");
  say(describe(c));
  say("memory estimate per rank (without activations): " + format_bytes(est.total()));

  // --verify: the single-process reference first, so each progress line can show its
  // difference. The other ranks wait in a barrier that sleeps.
  std::vector<double> ref_loss;
  if (args.verify) {
    double secs = 0;
    error.clear();
    if (lead) {
      const int threads = at::get_num_threads();
      hp::set_compute_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
      std::cout << "verify: training the single-process reference on the global batch ("
                << c.train_steps << " steps)..." << std::flush;
      try {
        ReferenceTrainer ref(c, data);
        for (int64_t s = 0; s < c.train_steps; ++s) {
          StepStats st = ref.step();
          ref_loss.push_back(st.loss);
          secs += st.step_time_s;
        }
      } catch (const std::exception& e) {
        error = std::string("--verify: the single-process reference: ") + e.what();
      }
      hp::set_compute_threads(threads);
      std::cout << " done in " << format_duration(secs) << std::endl;
    }
    // No timeout worth the name: the reference may take as long as the run itself.
    world->barrier({std::chrono::hours(24 * 365)}).wait();
    if (!all_ok(world, error.empty(), error)) return 1;
  }

  Trainer trainer(c, world, data);
  say("data: " + trainer.describe_data());
  if (args.resume) {
    error.clear();
    std::string dir = args.resume_dir;
    try {
      dir = CheckpointManager::resolve(dir.empty() ? c.save_dir : dir);
      trainer.load(dir);
      HP_CHECK(trainer.steps_done() <= c.train_steps, "resume from ", dir, ": it is at step ", trainer.steps_done(),
               ", past train_steps=", c.train_steps);
    } catch (const std::exception& e) {
      error = "--resume: " + std::string(e.what());
    }
    if (!all_ok(world, error.empty(), error)) return 1;
    say("resumed from " + dir + " after step " + std::to_string(trainer.steps_done()));
    if (trainer.steps_done() == c.train_steps) {
      say("nothing to train: the checkpoint is at train_steps=" + std::to_string(c.train_steps));
      return 0;
    }
  }

  CheckpointManager checkpoints(CheckpointManager::options_of(c), world);
  double worst_diff = 0, worst_rel = 0, total_s = 0;
  int64_t worst_step = 0;
  const int64_t first_step = trainer.steps_done();
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& st) {
    total_s += st.step_time_s;
    const double ref = args.verify && lead ? ref_loss[static_cast<size_t>(st.step - 1)]
                                           : std::numeric_limits<double>::quiet_NaN();
    if (!std::isnan(ref)) {
      const double d = std::fabs(st.loss - ref);
      if (st.step == first_step + 1 || std::isnan(d) || (!std::isnan(worst_diff) && d > worst_diff)) {
        worst_diff = d, worst_step = st.step, worst_rel = d / std::fabs(ref);
      }
    }
    if (metrics) metrics->step(st, ref);
    if (lead && (st.step % c.log_interval == 0 || st.step == 1 || st.step == c.train_steps)) {
      const double eta = total_s / static_cast<double>(st.step - first_step) * static_cast<double>(c.train_steps - st.step);
      std::cout << progress_line(st, c.train_steps, eta, ref) << std::endl;
    }
  };
  cb.on_save = [&](const std::string& dir, bool background) {
    say(background ? "saving " + dir + " in the background" : "saved " + dir);
  };
  TrainSummary sum;
  try {
    sum = trainer.train(&checkpoints, cb);
  } catch (const TrainingDiverged& e) {  // every rank raises it alike: report once, exit cleanly
    if (lead) std::cerr << "hp-train: error: " << e.what() << std::endl;
    return 1;
  }

  char line[512];
  std::snprintf(line, sizeof line, "done: %lld steps in %s | loss %.4f -> %.4f | %s tok/s | peak %s per rank",
                static_cast<long long>(sum.steps), format_duration(sum.seconds).c_str(), sum.losses.front(),
                sum.losses.back(), format_rate(sum.tokens_per_s).c_str(), format_bytes(sum.peak_bytes).c_str());
  say(line);
  if (args.verify) {
    std::snprintf(line, sizeof line,
                  "verify: largest |loss - single-process loss| over %lld steps: %.2e at step %lld (relative %.2e)",
                  static_cast<long long>(c.train_steps), worst_diff, static_cast<long long>(worst_step), worst_rel);
    say(line);
  }
  if (metrics) {
    std::vector<std::pair<std::string, double>> fields = {
        {"steps", static_cast<double>(c.train_steps)}, {"seconds", sum.seconds},
        {"first_loss", sum.losses.front()},            {"final_loss", sum.losses.back()},
        {"tokens_per_s", sum.tokens_per_s},            {"peak_bytes", static_cast<double>(sum.peak_bytes)},
        {"ranks", static_cast<double>(world->size())}};
    if (args.verify) {
      fields.push_back({"verify_max_abs_diff", worst_diff});
      fields.push_back({"verify_max_rel_diff", worst_rel});
    }
    metrics->summary(fields);
    metrics->finish();
    write_loss_svg(c.output_dir + "/loss.svg", sum.losses, ref_loss,
                   c.model.family().name() + " " + c.model.preset() + ", " + std::to_string(world->size()) + " rank(s)");
    say("wrote " + c.output_dir + "/metrics.jsonl and " + c.output_dir + "/loss.svg");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  hp::prefer_passive_openmp(argv);
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  }
  if (args.help) {
    std::cout << kUsage;
    return 0;
  }
  if (args.list_keys) {
    for (const auto& k : hp::train::config_keys()) {
      std::printf("%-36s %-36s default %-14s %s\n", k.key.c_str(), k.type.c_str(), k.default_value.c_str(),
                  k.help.c_str());
    }
    return 0;
  }
  hp::CommPtr world;
  try {
    world = hp::init();  // bad HP_* knobs, an unwritable HP_TRACE, a wrong backend: named here
  } catch (const std::exception& e) {
    std::cerr << "hp-train: error: " << e.what() << std::endl;
    std::fflush(nullptr);
    std::_Exit(1);  // other ranks may be inside MPI's start-up: do not wait for them
  }
  try {
    if (!args.export_ckpt.empty()) {
      hp::ckpt::ExportOptions o;
      if (args.max_shard_bytes > 0) o.max_shard_bytes = args.max_shard_bytes;
      if (args.export_dtype) o.dtype = *args.export_dtype;
      // A checkpoint, or a save_dir whose 'latest' names one.
      std::string from = args.export_ckpt;
      if (std::filesystem::exists(from + "/latest")) from = hp::train::CheckpointManager::resolve(from);
      hp::train::export_hf(from, args.export_out, world, o);
      if (world->rank() == 0) std::cout << "hp-train: wrote " << args.export_out << " (Hugging Face Llama)" << std::endl;
      return 0;
    }
    return args.plan ? plan(args, world) : run(args, world);
  } catch (const std::exception& e) {
    // A failure after the agreed checks may leave other ranks inside a collective: exit at
    // once (mpirun then stops them) rather than finalize and wait.
    std::cerr << "hp-train: error (rank " << world->rank() << "): " << e.what() << std::endl;
    std::fflush(nullptr);
    std::_Exit(1);
  }
}
