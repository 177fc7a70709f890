// A training run as hp-train makes one, in parts a program calls in order (apps/hp_train.cpp
// is their one caller; docs/train.md says what each prints and writes):
//
//   RunInputs in = prepare_run(args, world_size, rank);      // config, data, folders: checked
//   ReferenceLosses ref = train_reference(in.config, ...);   // --verify, on one rank
//   Trainer trainer(in.config, world, in.data, in.valid);
//   Resumed from = resume(trainer, in.config, dir);          // --resume / --auto-resume
//   RunReport report(in.config, world->size(), lead, &ref, say);
//   report.open_metrics(...);  trainer.train(&checkpoints, report.callbacks(...));
//   report.finished(summary)   or report.stopped(summary, step)
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
// --estimate, the device, the fit on this node, the training and validation data (their
// files checked) and the run's folders (made, probed and locked; an earlier run's
// checkpoints refused unless --resume, --auto-resume or --overwrite).
struct RunInputs {
  TrainConfig config;
  RankMemory memory;
  std::shared_ptr<const TokenDataset> data, valid;  // null under --estimate; valid: eval_interval > 0
  std::unique_ptr<RunFolders> folders;              // null under --estimate
};
RunInputs prepare_run(const Args& args, int world_size, int rank);

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

class RunReport {
 public:
  RunReport(const TrainConfig& c, int world_size, bool lead, const ReferenceLosses* reference,
            std::function<void(const std::string&)> say);
  // Opens metrics.jsonl (lead rank, output_dir set; a previous run's loss.svg removed). A
  // run resumed after `resumed_step` steps (-1: a new run) keeps the earlier run's lines up
  // to there and records the resume from `from` with its `cause`, saying how many steps the
  // earlier run had done past the checkpoint (trained again). Raises naming the file.
  void open_metrics(int64_t resumed_step, const std::string& from, const std::string& cause);
  // on_step, on_eval and on_save for Trainer::train, whose first step follows `first_step`.
  TrainCallbacks callbacks(int64_t first_step);
  // A run stopped by a signal after `step`: the line saying so, and the metrics' stop record
  // (left under its temporary name: the run is not finished).
  void stopped(const TrainSummary& s, int64_t step);
  // A finished run: the summary line, --verify's comparisons, and the metrics' summary and
  // the loss curve written (with the earlier run's steps, where a resumed run kept them).
  void finished(const TrainSummary& s);

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
};

}  // namespace hp::train
