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
#include "hp/train/cli.h"
#include "hp/train/config.h"
#include "hp/train/plan.h"
#include "hp/train/preemption.h"
#include "hp/train/report.h"
#include "hp/train/run_folders.h"
#include "hp/train/trainer.h"

namespace {

using hp::train::Args;
using hp::train::kUsage;
using hp::train::parse_args;

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

// --export-hf: every rank takes part (each writes its share); an error, which every rank
// meets alike, is printed once.
int export_checkpoint(const Args& args, const hp::CommPtr& world) {
  std::string error;
  try {
    hp::ckpt::ExportOptions o;
    if (args.max_shard_bytes > 0) o.max_shard_bytes = args.max_shard_bytes;
    if (args.export_dtype) o.dtype = *args.export_dtype;
    // A checkpoint, or a save_dir whose 'latest' names one.
    std::string from = args.export_ckpt;
    if (std::filesystem::exists(from + "/latest")) from = hp::train::CheckpointManager::resolve(from);
    hp::train::export_hf(from, args.export_out, world, o);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!all_ok(world, error.empty(), "--export-hf: " + error)) return 1;
  if (world->rank() == 0) std::cout << "hp-train: wrote " << args.export_out << " (a Hugging Face model folder)" << std::endl;
  return 0;
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
  RankMemory rm;
  std::shared_ptr<const TokenDataset> data, valid;
  std::unique_ptr<MetricsLog> metrics;
  std::unique_ptr<RunFolders> folders;  // claimed (locked) for the run's life
  std::string error;
  try {
    c = load_config(args.config, args.overrides);
    c.validate(args.world > 0 ? args.world : world->size());
    rm = estimate_rank_memory(c);
    if (!args.estimate) {
      training_device(c.device);  // a device this process cannot use is named before anything starts
      check_fits_node(c, rm, hp::local_world_size());
      data = make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);  // checks the file
      if (c.eval_interval > 0) {
        valid = make_validation_dataset(c);
        validation_batches(c, *valid);  // holds what an evaluation reads
      }
      HP_CHECK(!args.auto_resume || c.save_interval > 0, "--auto-resume: save_interval=0: this run saves no "
               "checkpoint to resume from (set save_interval)");
      // Every folder the run writes, made and probed now, not at the first save; locked
      // against a second run; an earlier run's checkpoints refused unless told otherwise.
      folders = std::make_unique<RunFolders>(c, rank,
                                             args.resume || args.auto_resume ? EarlierRun::kContinue
                                             : args.overwrite ? EarlierRun::kReplace
                                                              : EarlierRun::kRefuse);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!all_ok(world, error.empty(), error)) return 1;
  if (!args.estimate) {
    const std::string mismatch =
        settings_mismatch(world, resolved_settings(c), "configs", "every rank must run the same config and --set values");
    if (!all_ok(world, mismatch.empty(), mismatch)) return 1;
  }

  if (args.estimate) {
    say(describe(c));
    say(describe_estimate(c, rm));
    return 0;
  }

  say("hp-train: " + args.config + " on " + std::to_string(world->size()) + " rank(s), backend " + world->backend() +
      ", " + std::to_string(at::get_num_threads()) + " compute thread(s) per rank (OMP_WAIT_POLICY=" +
      (std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "") + ")");
  say(describe(c));
  if (c.optimizer != OptimizerKind::kAdamW) say(describe_optimizer(c));
  say("memory estimate per rank (without activations): " + format_bytes(rm.estimate.total()));
  for (const auto& note : folders->notes()) say(note);
  error.clear();
  try {
    say(folders->replace_earlier());  // --overwrite, now that every rank's checks passed
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!all_ok(world, error.empty(), error)) return 1;

  // --verify: the single-process reference first, so each progress line can show its
  // difference. The other ranks wait in a barrier that sleeps.
  std::vector<double> ref_loss;
  std::map<int64_t, double> ref_valid;  // per step evaluated
  if (args.verify) {
    double secs = 0;
    error.clear();
    if (lead) {
      const int threads = at::get_num_threads();
      hp::set_compute_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
      std::cout << "verify: training the single-process reference on the global batch ("
                << c.train_steps << " steps)..." << std::flush;
      try {
        ReferenceTrainer ref(c, data, valid);
        for (int64_t s = 0; s < c.train_steps; ++s) {
          StepStats st = ref.step();
          ref_loss.push_back(st.loss);
          secs += st.step_time_s;
          if (eval_due(c, st.step)) {
            const EvalStats ev = ref.evaluate();
            ref_valid[ev.step] = ev.loss;
            secs += ev.seconds;
          }
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

  Trainer trainer(c, world, data, valid);
  say("data: " + trainer.describe_data());
  // --auto-resume: where save_dir has a checkpoint (a relaunch after a failure), else from
  // the start (a failure before the first save, or the first launch).
  const bool resuming = args.resume || (args.auto_resume && std::filesystem::exists(c.save_dir + "/latest"));
  std::string resumed_from;
  ResumeReport report;
  if (resuming) {
    error.clear();
    std::string dir = args.resume_dir;
    try {
      dir = CheckpointManager::resolve(dir.empty() ? c.save_dir : dir);
      resumed_from = dir;
      report = trainer.load(dir);
      HP_CHECK(trainer.steps_done() <= c.train_steps, "resume from ", dir, ": it is at step ", trainer.steps_done(),
               ", past train_steps=", c.train_steps);
    } catch (const std::exception& e) {
      error = (args.resume ? "--resume: " : "--auto-resume: ") + std::string(e.what());
    }
    if (!all_ok(world, error.empty(), error)) return 1;
    say("resumed from " + dir + " after step " + std::to_string(trainer.steps_done()));
    if (const std::string line = resume_optimizer_line(report, c); !line.empty()) say(line);
    if (trainer.steps_done() == c.train_steps) {
      say("nothing to train: the checkpoint is at train_steps=" + std::to_string(c.train_steps) +
          "; no file was changed");
      return 0;
    }
  }
  // The metrics, once it is known that this run trains: a resumed run keeps the earlier
  // run's lines up to its checkpoint.
  error.clear();
  try {
    if (lead && !c.output_dir.empty()) {
      // A previous run's curve must not sit beside this run's metrics.
      std::remove((c.output_dir + "/loss.svg").c_str());
      metrics = std::make_unique<MetricsLog>(c.output_dir + "/metrics.jsonl", resuming ? trainer.steps_done() : -1);
      if (resuming) {
        // What the earlier run had done beyond its checkpoint is trained again: lost.
        const int64_t lost = std::max<int64_t>(0, metrics->last_step_seen() - trainer.steps_done());
        const std::string cause = hp::env::get_string("HP_RESTART_CAUSE");
        metrics->resumed(trainer.steps_done(), resumed_from, lost,
                         !cause.empty() ? cause : args.resume ? "--resume" : "--auto-resume");
        if (lost > 0) {
          say(std::to_string(lost) + " step(s) lost: the earlier run had reached step " +
              std::to_string(metrics->last_step_seen()) + "; they are trained again");
        }
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!all_ok(world, error.empty(), error)) return 1;

  CheckpointManager checkpoints(CheckpointManager::options_of(c), world);
  LossComparison verify, verify_valid;
  double total_s = 0;
  double last_valid = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::pair<int64_t, double>> valid_curve;
  const int64_t first_step = trainer.steps_done();
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& st) {
    total_s += st.step_time_s;
    const double ref = args.verify && lead ? ref_loss[static_cast<size_t>(st.step - 1)]
                                           : std::numeric_limits<double>::quiet_NaN();
    verify.add(st.step, st.loss, ref);
    if (metrics) metrics->step(st, ref);
    if (lead && (st.step % c.log_interval == 0 || st.step == 1 || st.step == c.train_steps)) {
      const double eta = total_s / static_cast<double>(st.step - first_step) * static_cast<double>(c.train_steps - st.step);
      std::cout << progress_line(st, c.train_steps, eta, ref, last_valid) << std::endl;
    }
  };
  cb.on_eval = [&](const EvalStats& ev) {
    auto r = ref_valid.find(ev.step);
    const double ref = lead && r != ref_valid.end() ? r->second : std::numeric_limits<double>::quiet_NaN();
    verify_valid.add(ev.step, ev.loss, ref);
    last_valid = ev.loss;
    valid_curve.emplace_back(ev.step, ev.loss);
    if (metrics) metrics->eval(ev, ref);
    say(eval_line(ev, c.train_steps, ref));
  };
  cb.on_save = [&](const std::string& dir, bool background) {
    say(background ? "saving " + dir + " in the background" : "saved " + dir);
  };
  // SIGTERM / SIGUSR1 from here on: stop after the step in flight, save, exit 75.
  PreemptionSignals signals;
  cb.stop_requested = [] { return PreemptionSignals::received(); };
  TrainSummary sum;
  try {
    sum = trainer.train(&checkpoints, cb);
  } catch (const TrainingDiverged& e) {  // every rank raises it alike: report once, exit cleanly
    if (lead) std::cerr << "hp-train: error: " << e.what() << std::endl;
    return 1;
  }
  if (sum.stopped_by != 0) {
    const int64_t step = trainer.steps_done();
    const std::string signal = signal_name(sum.stopped_by);
    say("stopped by " + signal + " (received first by rank " + std::to_string(sum.stop_rank) + ") after step " +
        std::to_string(step) + ": " +
        (sum.stop_saved.empty() ? std::string("nothing saved (the run saves nowhere: save_interval=0)")
                                : "saved " + sum.stop_saved + "; continue with --resume") +
        "; exit status " + std::to_string(kPreemptedExit));
    // The metrics stay under their temporary name: the run is not finished.
    if (metrics) metrics->stopped(step, signal, sum.stop_rank, sum.stop_saved);
    return kPreemptedExit;
  }

  say(summary_line(sum));
  if (args.verify) say(verify.line(c.train_steps));
  if (args.verify && verify_valid.any) say(verify_valid.line(static_cast<int64_t>(sum.evals.size()), "validation loss", "evaluations"));
  if (metrics) {
    std::vector<std::pair<std::string, double>> fields = {
        {"steps", static_cast<double>(c.train_steps)}, {"seconds", sum.seconds},
        {"first_loss", sum.losses.front()},            {"final_loss", sum.losses.back()},
        {"tokens_per_s", sum.tokens_per_s},            {"peak_bytes", static_cast<double>(sum.peak_bytes)},
        {"ranks", static_cast<double>(world->size())},
        {"optimizer_seconds", sum.optimizer_seconds},
        {"comm_bytes_per_step", static_cast<double>(sum.comm_bytes) / static_cast<double>(std::max<int64_t>(1, sum.steps))},
        {"optimizer_comm_bytes_per_step",
         static_cast<double>(sum.optimizer_comm_bytes) / static_cast<double>(std::max<int64_t>(1, sum.steps))}};
    if (!sum.evals.empty()) fields.push_back({"final_valid_loss", sum.evals.back().loss});
    if (args.verify) {
      fields.push_back({"verify_max_abs_diff", verify.worst_abs});
      fields.push_back({"verify_max_rel_diff", verify.worst_rel});
    }
    if (args.verify && verify_valid.any) fields.push_back({"verify_valid_max_abs_diff", verify_valid.worst_abs});
    metrics->summary(fields);
    metrics->finish();
    LossCurve curve;
    curve.loss = sum.losses;
    curve.first_step = sum.first_step;
    // A resumed run draws the steps before its checkpoint too, where the metrics kept them all.
    const auto& kept = metrics->kept_losses();
    if (!kept.empty() && static_cast<int64_t>(kept.size()) == sum.first_step && kept.front().first == 1 &&
        kept.back().first == sum.first_step) {
      std::vector<double> all;
      for (const auto& [step, loss] : kept) all.push_back(loss);
      all.insert(all.end(), sum.losses.begin(), sum.losses.end());
      curve.loss = all;
      curve.first_step = 0;
    }
    curve.reference = ref_loss;
    curve.validation = metrics->kept_evals();
    curve.validation.insert(curve.validation.end(), valid_curve.begin(), valid_curve.end());
    write_loss_svg(c.output_dir + "/loss.svg", curve,
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
    // Bad HP_* knobs, an unwritable HP_TRACE, a wrong backend: named here. device: cuda
    // picks the nccl backend.
    world = hp::init(hp::train::init_options(args));
  } catch (const std::exception& e) {
    std::cerr << "hp-train: error: " << e.what() << std::endl;
    std::fflush(nullptr);
    std::_Exit(1);  // other ranks may be inside MPI's start-up: do not wait for them
  }
  try {
    // Flags given to some ranks only (--resume, --verify) would send the ranks different
    // ways: compared first, like the config after it.
    const std::string differ =
        hp::train::settings_mismatch(world, hp::train::command_line_settings(args), "command lines",
                                     "every rank must be given the same arguments");
    int rc = 1;  // where the ranks' flags differ
    if (!all_ok(world, differ.empty(), differ)) {
    } else if (!args.export_ckpt.empty()) {
      rc = export_checkpoint(args, world);
    } else {
      rc = args.plan ? plan(args, world) : run(args, world);
    }
    hp::finalize();  // writes HP_TRACE's file: a failure there is this run's error
    return rc;
  } catch (const std::exception& e) {
    // A failure after the agreed checks may leave other ranks inside a collective: exit at
    // once (mpirun then stops them) rather than finalize and wait.
    std::cerr << "hp-train: error (rank " << world->rank() << "): " << e.what() << std::endl;
    std::fflush(nullptr);
    std::_Exit(1);
  }
}
