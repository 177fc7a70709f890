// A training run as hp-train makes one, in parts a program calls in order (apps/hp_train.cpp
// is their one caller; docs/train.md says what each prints and writes):
//
//   RunInputs in = prepare_run(args, world_size, rank);      // config and data: checked
//   in.folders = claim_folders(args, in.config, rank);        // made, probed and locked
//   ReferenceLosses ref = train_reference(in.config, ...);   // --verify, on one rank
//   Trainer trainer(in.config, world, in.data, in.valid);
//   Resumed from = resume(trainer, in.config, dir);          // --resume / --auto-resume
//   RunReport report(in.config, world->size(), lead, &ref, say);
//   report.open_metrics(...);  trainer.train(&checkpoints, report.callbacks(...));
//   return report.ended(summary, trainer.steps_done());     // finished, or stopped (75)
//
// Each raises hp::Error naming what is wrong; the program makes every rank agree on the
// outcome (comm/agree.h) before going on, so no rank is left waiting.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hp/train/cli.h"
#include "hp/train/config.h"
#include "hp/train/data.h"
#include "hp/train/plan.h"
#include "hp/train/report.h"
#include "hp/train/run_folders.h"
#include "hp/train/trainer.h"

namespace hp::train {

// What a run needs before anything trains, every check made: the config (loaded, --set
// applied, validated for `world_size` ranks), this rank's memory estimate and, unless
// --estimate, the device, the fit on this node and the training and validation data (their
// files checked). A failure here is the command's: running it again cannot succeed
// (hp-train exits kConfigExit).
struct RunInputs {
  TrainConfig config;
  RankMemory memory;
  std::shared_ptr<const TokenDataset> data, valid;  // null under --estimate; valid: eval_interval > 0
  std::unique_ptr<RunFolders> folders;              // claim_folders' (null under --estimate)
};
RunInputs prepare_run(const Args& args, int world_size, int rank);
// The run's folders, made, probed and locked (an earlier run's checkpoints refused unless
// --resume, --auto-resume or --overwrite). Apart from prepare_run: a folder still locked by
// a job that is ending is a failure a later launch gets past.
std::unique_ptr<RunFolders> claim_folders(const Args& args, const TrainConfig& c, int rank);

// --verify: the same config trained in this process on the global batch (all of this
// machine's cores), step by step.
struct ReferenceLosses {
  std::vector<double> loss;           // of steps 1, 2, ..., train_steps
  std::map<int64_t, double> valid;    // validation loss by the step it followed
  double seconds = 0;                 // its steps' and evaluations' time
  // NaN where there is none (no reference, or no evaluation after that step).
  double at(int64_t step) const;
  double valid_at(int64_t step) const;
};
ReferenceLosses train_reference(const TrainConfig& c, std::shared_ptr<const TokenDataset> data,
                                std::shared_ptr<const TokenDataset> valid);

// The checkpoint a resumed run continues from: `dir` (--resume DIR), or save_dir's latest
// when `dir` is empty; loaded into `trainer`. Raises when there is none, or when it is past
// train_steps.
// The settings of the checkpoint a resume continues from (`dir`, as resume() resolves it)
// against this run's `c`: every change listed, one line each, as the lines to print.
// Changes of layout, timing, reporting and folders (ResumeRule::kFree) pass; changes of the
// run's course (kTrajectory: seed, batch, data, schedule, optimizer, ...) pass only when
// `allowed` names their key (--resume-changes), else raise listing each with the way on; a
// setting the checkpoint did not record (one written before settings were) is taken as
// given, and said. The model's shape is Trainer::load's to refuse.
std::vector<std::string> check_resume_settings(const TrainConfig& c, const std::string& dir,
                                               const std::vector<std::string>& allowed);

struct Resumed {
  std::string dir;      // the checkpoint's own folder, resolved
  ResumeReport report;  // what changed kind in the optimizer's state
};
Resumed resume(Trainer& trainer, const TrainConfig& c, const std::string& dir);

// What a run shows and writes while it trains and after: the progress and validation lines
// (through `say`, on the lead rank), metrics.jsonl and loss.svg under output_dir (the lead
// rank, where output_dir is set), and --verify's comparison with `reference` (null: none).
// --plan: the layouts of args.config over args.world ranks (else `world_size`), ranked by
// predicted step time (plan_layouts) on the links of --link (else HP_SIM_NET, else this
// machine's measured shared memory), as the table with its heading, or --json's JSON.
std::string plan_output(const Args& args, int world_size);

// --elastic (scripts/launch.sh --min-ranks: a job relaunched on the ranks it can have): the
// layout a run resumed on `world_size` ranks takes when the checkpoint it continues from
// (args' --resume DIR, or save_dir's latest) was written by a run of another size. The
// checkpoint's tensor_parallel and pipeline_parallel are kept, and so are the global batch
// and the samples of a micro-batch per data-parallel rank (fewer ranks: more micro-batches);
// among the layouts of `world_size` ranks that keep them, the planner's fastest feasible
// one (plan_layouts, on the links and devices args' --link, --ranks-per-node,
// --device-tflops and --memory-per-rank describe, as --plan). Of the same size: the config's
// own layout where it fits, else the checkpoint's. Without a checkpoint: the config's.
// Raises naming the reasons when no layout keeps them (a data-parallel degree that does not
// divide the global batch in such micro-batches; the stages not fitting in memory).
struct ElasticChoice {
  std::vector<std::string> overrides;  // "key=value" as --set takes them (empty: the config as given)
  std::vector<std::string> lines;      // what it chose and why
};
ElasticChoice elastic_layout(const Args& args, int world_size);

class RunReport {
 public:
  RunReport(const TrainConfig& c, int world_size, bool lead, const ReferenceLosses* reference,
            std::function<void(const std::string&)> say);
  // A collapsed model (collapsed()): with `strict`, on_step raises TrainingDiverged (every
  // rank alike: the figures are agreed); without, the lead rank warns once.
  void set_strict(bool strict) { strict_ = strict; }
  // Opens metrics.jsonl (lead rank, output_dir set; a previous run's loss.svg removed). A
  // run resumed after `resumed_step` steps (-1: a new run) keeps the earlier run's lines up
  // to there and records the resume from `from` with its `cause`, saying how many steps the
  // earlier run had done past the checkpoint (trained again). Raises naming the file.
  // `earlier_causes`: the launcher's earlier relaunches this one follows (HP_RESTART_CAUSES):
  // each that left no resume record (it ended before training) gets one, marked so, before
  // this run's own, so that the records count every relaunch.
  void open_metrics(int64_t resumed_step, const std::string& from, const std::string& cause,
                    const std::vector<std::string>& earlier_causes = {});
  // on_step, on_eval and on_save for Trainer::train, whose first step follows `first_step`.
  TrainCallbacks callbacks(int64_t first_step);
  // A run stopped by a signal after `step`: the line saying so, and the metrics' stop record
  // (left under its temporary name: the run is not finished).
  void stopped(const TrainSummary& s, int64_t step);
  // A finished run: the summary line, --verify's comparisons, and the metrics' summary and
  // the loss curve written (with the earlier run's steps, where a resumed run kept them).
  void finished(const TrainSummary& s);
  // The end of Trainer::train after `steps_done` steps, and the exit status: stopped by a
  // signal before train_steps, stopped() and kPreemptedExit; otherwise finished() and 0 (a
  // stop signal in the last step stops nothing: the run is complete, and is reported so).
  int ended(const TrainSummary& s, int64_t steps_done);
  // A run resumed at train_steps (nothing to train) whose earlier run ended before its report
  // did (stopped in its last step by an older version, or killed while writing it): its
  // metrics.jsonl, summary and loss.svg written from the lines it left. Returns whether there
  // was one to finish.
  bool finish_earlier();

 private:
  const TrainConfig& c_;
  const int world_size_;
  const bool lead_;
  const ReferenceLosses* reference_;
  std::function<void(const std::string&)> say_;
  std::unique_ptr<MetricsLog> metrics_;
  LossComparison verify_, verify_valid_;
  double total_s_ = 0;
  double last_valid_;
  std::vector<std::pair<int64_t, double>> valid_curve_;
  bool strict_ = false, warned_collapse_ = false;
};

// The causes of scripts/launch.sh's relaunches so far, this one last (HP_RESTART_CAUSES; empty
// outside the launcher): open_metrics' earlier_causes.
std::vector<std::string> launcher_restart_causes();
// Under scripts/launch.sh (HP_FAILURE_MARKERS set): leaves `rank`'s failure, `error`, as a
// marker the launcher watches for, so that it can end a job whose mpirun cannot (a partition
// between nodes). Called by a rank on its way out after an error; nothing otherwise.
void leave_failure_marker(int rank, const std::string& error);

// Whether a step's figures say the model has collapsed: a gradient norm of exactly 0 (no
// weight can change again) at the loss of predicting every token alike, ln(vocab) (within
// 1e-3 of it, relative). What lr 1e3 without clipping leads to, silently, with a finite loss.
bool collapsed(const StepStats& st, int64_t vocab);

}  // namespace hp::train
