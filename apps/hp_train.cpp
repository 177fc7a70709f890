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
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "hp/ckpt/checkpoint.h"
#include "hp/comm/agree.h"
#include "hp/core/env.h"
#include "hp/runtime.h"
#include "hp/train/checkpoint_manager.h"
#include "hp/train/cli.h"
#include "hp/train/config.h"
#include "hp/train/plan.h"
#include "hp/train/preemption.h"
#include "hp/train/report.h"
#include "hp/train/run.h"
#include "hp/train/trainer.h"

namespace {

using hp::train::Args;
using hp::train::kUsage;
using hp::train::parse_args;

// `line` on stderr in one write: the lines of ranks failing together do not interleave
// (std::cerr is unbuffered: each << is a write of its own).
void say_error(const std::string& line) {
  const std::string text = line + "\n";
  std::cerr.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::cerr.flush();
}

// True on every rank when `ok` is true on every rank. Otherwise the lowest failing rank
// prints its message, and all return false together (no rank is left waiting).
bool all_ok(const hp::CommPtr& world, bool ok, const std::string& message) {
  const int bad = hp::first_failed_rank(world, ok);
  if (bad < 0) return true;
  if (bad == world->rank()) {
    say_error(std::string("hp-train: error") + (world->size() > 1 ? " (rank " + std::to_string(bad) + ")" : "") + ": " +
              message);
  }
  return false;
}

// Runs `step` on every rank: true on every rank when it raised on none. Otherwise the
// lowest failing rank prints its message (after `prefix`), and all return false together.
template <class Step>
bool agreed(const hp::CommPtr& world, Step&& step, const std::string& prefix = "") {
  std::string error;
  try {
    step();
  } catch (const std::exception& e) {
    error = prefix + e.what();
  }
  return all_ok(world, error.empty(), error);
}

// --plan: rank 0 predicts (the others wait, without spinning), every rank returns its status.
int plan(const Args& args, const hp::CommPtr& world) {
  std::string error;
  if (world->rank() == 0) {
    try {
      std::cout << hp::train::plan_output(args, world->size()) << std::flush;
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
  const bool ok = agreed(world, [&] {
    hp::ckpt::ExportOptions o;
    if (args.max_shard_bytes > 0) o.max_shard_bytes = args.max_shard_bytes;
    if (args.export_dtype) o.dtype = *args.export_dtype;
    o.float8 = args.export_float8;
    // A checkpoint, or a save_dir whose 'latest' names one.
    std::string from = args.export_ckpt;
    if (std::filesystem::exists(from + "/latest")) from = hp::train::CheckpointManager::resolve(from);
    hp::train::export_hf(from, args.export_out, world, o, args.export_without_mtp);
  }, "--export-hf: ");
  if (!ok) return 1;
  if (world->rank() == 0) std::cout << "hp-train: wrote " << args.export_out << " (a Hugging Face model folder)" << std::endl;
  return 0;
}

// A training run (or --estimate): the parts are the library's (hp/train/run.h); here the
// ranks agree after each, and rank 0 prints.
int run(const Args& args, const hp::CommPtr& world) {
  using namespace hp::train;
  const bool lead = world->rank() == 0;
  auto say = [lead](const std::string& s) {
    if (lead) std::cout << s << std::endl;
  };
  // --elastic: rank 0 lays the resumed run out on the ranks there are (its planner times the
  // model, which no two ranks would time alike), the others take its choice as --set items.
  Args laid = args;
  if (args.elastic) {
    std::string error, chosen;
    if (lead) {
      try {
        ElasticChoice e = elastic_layout(args, world->size());
        for (const auto& line : e.lines) say(line);
        for (const auto& o : e.overrides) chosen += o + "\n";
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    world->barrier({std::chrono::hours(24)}).wait();  // the planner may take a while
    // Refused (no layout keeps the run's degrees on these ranks): not relaunched as is.
    if (!all_ok(world, error.empty(), error)) return kConfigExit;
    chosen = hp::broadcast_text(world, chosen, 0);
    for (size_t at = 0, end; (end = chosen.find('\n', at)) != std::string::npos; at = end + 1) {
      const std::string item = chosen.substr(at, end - at), key = item.substr(0, item.find('=') + 1);
      // In place of the command's --set of the same key (the layout it gave for more ranks).
      auto& o = laid.overrides;
      o.erase(std::remove_if(o.begin(), o.end(), [&key](const std::string& x) { return x.rfind(key, 0) == 0; }), o.end());
      o.push_back(item);
    }
  }
  RunInputs in;  // every check before training starts
  // A config, data or folder refused: the same command cannot succeed (not relaunched).
  if (!agreed(world, [&] { in = prepare_run(laid, world->size(), world->rank()); })) return kConfigExit;
  const TrainConfig& c = in.config;
  if (args.estimate) {
    say(describe(c));
    say(describe_estimate(c, in.memory));
    return 0;
  }
  if (!agreed(world, [&] { in.folders = claim_folders(args, c, world->rank()); })) return kFailedExit;
  const std::string mismatch =
      settings_mismatch(world, resolved_settings(c), "configs", "every rank must run the same config and --set values");
  if (!all_ok(world, mismatch.empty(), mismatch)) return kConfigExit;
  const char* omp = std::getenv("OMP_WAIT_POLICY");
  // Ranks per node as the launcher placed them (MPI's shared-memory split): the node boundary
  // the communicator's timeouts and the inter-node link are reckoned by.
  say("hp-train: " + args.config + " on " + std::to_string(world->size()) + " rank(s), " +
      std::to_string(hp::local_world_size()) + " per node, backend " + world->backend() +
      ", " + std::to_string(at::get_num_threads()) + " compute thread(s) per rank (OMP_WAIT_POLICY=" +
      (omp ? omp : "") + ")");
  say(describe(c));
  if (c.optimizer != OptimizerKind::kAdamW) say(describe_optimizer(c));
  say("memory estimate per rank (without activations): " + format_bytes(in.memory.estimate.total()));
  for (const auto& note : in.folders->notes()) say(note);
  // --overwrite, now that every rank's checks passed.
  if (!agreed(world, [&] { say(in.folders->replace_earlier()); })) return 1;

  // --verify: the single-process reference first, so each progress line can show its
  // difference. The other ranks wait in a barrier that sleeps.
  ReferenceLosses ref;
  if (args.verify) {
    std::string error;
    if (lead) {
      std::cout << "verify: training the single-process reference on the global batch (" << c.train_steps
                << " steps)..." << std::flush;
      try {
        ref = train_reference(c, in.data, in.valid);
      } catch (const std::exception& e) {
        error = std::string("--verify: the single-process reference: ") + e.what();
      }
      std::cout << (error.empty() ? " done in " + format_duration(ref.seconds) : std::string(" failed")) << std::endl;
    }
    // No timeout worth the name: the reference may take as long as the run itself.
    world->barrier({std::chrono::hours(24 * 365)}).wait();
    if (!all_ok(world, error.empty(), error)) return 1;
  }

  Trainer trainer(c, world, in.data, in.valid);
  say("data: " + trainer.describe_data());
  // --auto-resume: where save_dir has a checkpoint (a relaunch after a failure), else from
  // the start (a failure before the first save, or the first launch).
  const bool resuming = args.resume || (args.auto_resume && std::filesystem::exists(c.save_dir + "/latest"));
  Resumed from;
  if (resuming) {
    // The checkpoint's settings first: a change of the run's course not asked for is the
    // command's error (not relaunched), before any state is loaded.
    std::vector<std::string> changes;
    if (!agreed(world, [&] { changes = check_resume_settings(c, args.resume_dir, args.resume_changes); },
                args.resume ? "--resume: " : "--auto-resume: ")) {
      return kConfigExit;
    }
    for (const auto& line : changes) say(line);
    if (!agreed(world, [&] { from = resume(trainer, c, args.resume_dir); },
                args.resume ? "--resume: " : "--auto-resume: ")) {
      return 1;
    }
    say("resumed from " + from.dir + " after step " + std::to_string(trainer.steps_done()));
    if (const std::string line = resume_optimizer_line(from.report, c); !line.empty()) say(line);
    if (trainer.steps_done() == c.train_steps) {
      RunReport earlier(c, world->size(), lead, nullptr, say);
      if (!agreed(world, [&] { earlier.finish_earlier(); })) return 1;
      say("nothing to train: the checkpoint is at train_steps=" + std::to_string(c.train_steps) +
          "; no checkpoint was changed");
      return 0;
    }
  }
  // The metrics, once it is known that this run trains.
  RunReport report(c, world->size(), lead, args.verify ? &ref : nullptr, say);
  report.set_strict(args.strict);
  const std::string cause = hp::env::get_string("HP_RESTART_CAUSE");
  if (!agreed(world, [&] {
        report.open_metrics(resuming ? trainer.steps_done() : -1, from.dir,
                            !cause.empty() ? cause : args.resume ? "--resume" : "--auto-resume",
                            launcher_restart_causes());
      })) {
    return 1;
  }
  CheckpointManager checkpoints(CheckpointManager::options_of(c), world);
  TrainCallbacks cb = report.callbacks(trainer.steps_done());
  // SIGTERM / SIGUSR1 from here on: stop after the step in flight, save, exit 75.
  PreemptionSignals signals;
  cb.stop_requested = [] { return PreemptionSignals::received(); };
  TrainSummary sum;
  try {
    sum = trainer.train(&checkpoints, cb);
  } catch (const TrainingDiverged& e) {  // every rank raises it alike: report once, exit cleanly
    if (lead) std::cerr << "hp-train: error: " << e.what() << std::endl;
    return kDivergedExit;  // the checkpoint would diverge again: not relaunched
  }
  return report.ended(sum, trainer.steps_done());
}

// --upgrade-checkpoint: rank 0 rewrites the metadata (the others wait); printed once.
int upgrade_checkpoint(const Args& args, const hp::CommPtr& world) {
  std::string done, error;
  if (world->rank() == 0) {
    try {
      done = hp::ckpt::upgrade(hp::train::CheckpointManager::resolve(args.upgrade_ckpt));
    } catch (const std::exception& e) {
      error = std::string("--upgrade-checkpoint: ") + e.what();
    }
  }
  if (!all_ok(world, error.empty(), error)) return hp::train::kFailedExit;
  if (world->rank() == 0) std::cout << "hp-train: " << done << std::endl;
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
    return hp::train::kUsageExit;
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
    } else if (!args.upgrade_ckpt.empty()) {
      rc = upgrade_checkpoint(args, world);
    } else {
      rc = args.plan ? plan(args, world) : run(args, world);
    }
    hp::finalize();  // writes HP_TRACE's file: a failure there is this run's error
    return rc;
  } catch (const std::exception& e) {
    // A failure after the agreed checks may leave other ranks inside a collective: exit at
    // once (mpirun then stops them) rather than finalize and wait. Under scripts/launch.sh the
    // failure is also left as a marker: where mpirun cannot stop the others (a partition),
    // the launcher ends the job.
    say_error("hp-train: error (rank " + std::to_string(world->rank()) + "): " + e.what());
    hp::train::leave_failure_marker(world->rank(), e.what());
    std::fflush(nullptr);
    std::_Exit(1);
  }
}
