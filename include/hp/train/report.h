// What hp-train shows and writes: progress lines, the JSON-lines metrics file and the
// loss-curve SVG. Pure formatting; the figures come reduced over ranks (StepStats).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "hp/train/trainer.h"

namespace hp::train {

std::string format_bytes(int64_t bytes);     // "12.3 MiB"
std::string format_duration(double seconds);  // "1:05", "1:02:03"
std::string format_rate(double per_second);   // "12.3k"

// "step  12/50 | loss 3.2145 | lr 2.10e-03 | grad norm 0.873 | 12.3k tok/s | peak 45.2 MiB
//  | ETA 0:32", plus " | experts max/mean 1.42" (the most imbalanced MoE block) for a model
// with routed experts and " | ref diff 1.2e-05" when `ref_loss` is given (not NaN).
// " | valid 3.0123" follows when `valid_loss` (the last validation loss) is not NaN.
std::string progress_line(const StepStats& s, int64_t total_steps, double eta_s, double ref_loss,
                          double valid_loss);

// "validation after step 10/50 | loss 3.1234 | ppl 22.80 | 4.1k tokens in 0:01", plus
// " | ref diff 1.2e-05" when `ref_loss` is given (not NaN).
std::string eval_line(const EvalStats& e, int64_t total_steps, double ref_loss);

// --verify: each step's loss against the single-process reference's.
struct LossComparison {
  double worst_abs = 0, worst_rel = 0;
  int64_t worst_step = 0;
  bool any = false;
  // Records step `step`'s `loss` against `ref` (NaN: no reference, ignored). A NaN
  // difference stays the worst.
  void add(int64_t step, double loss, double ref);
  // "verify: largest |loss - single-process loss| over N steps: ... at step K (relative ...)"
  std::string line(int64_t steps) const { return line(steps, "loss", "steps"); }
  // The same of another figure: "verify: largest |validation loss - single-process
  // validation loss| over 3 evaluations: ..."
  std::string line(int64_t count, const std::string& what, const std::string& unit) const;
};

// "done: 6 steps in 0:03 | loss 5.5588 -> 5.1116 | 19.3k tok/s | peak 20.1 MiB per rank |
// optimizer step 4.2% of the rest | sent 1.3 MiB/step (optimizer 0 B)": the optimizer's time
// against the rest of the steps' (forward, backward, gradient norm), and the bytes the most
// sending rank sent per step, in all and in the optimizer's step.
std::string summary_line(const TrainSummary& s);
// After a resume whose optimizer state changed kind for some parameters ("" otherwise):
// "optimizer: adamw in the checkpoint, muon in this config: 28 parameters (786432 elements)
// start a fresh optimizer state (theirs was the other optimizer's); 12 keep their state".
std::string resume_optimizer_line(const ResumeReport& r, const TrainConfig& c);

// One JSON object per line: every step's figures (with "expert_load": [{"layer",
// "tokens_max", "tokens_mean"}, ...] for a model with routed experts), each validation's
// (an "eval" object, after its step's line), then a summary object.
// metrics.jsonl, written as `path`.partial and flushed at every step (so a crash leaves
// the steps so far there), then renamed to `path` by finish(): a reader never sees a
// half-written file under the final name. Every write is checked; a failure (a full disk)
// raises hp::Error naming the file and the OS error.
class MetricsLog {
 public:
  // A new log (raises naming the path). With `keep_through` >= 0, a run resumed after that
  // many steps: the earlier run's lines of steps 1..keep_through and its validation, resume
  // and stop records of those steps are carried over, from `path`.partial where a run was
  // cut off, else from `path`; later steps (which this run trains again), summaries and a
  // torn last line are dropped. The earlier file is replaced only once the
  // kept lines are safely in the new one.
  explicit MetricsLog(const std::string& path, int64_t keep_through = -1);
  // The training and validation losses carried over, by step (empty for a new log).
  const std::vector<std::pair<int64_t, double>>& kept_losses() const { return kept_loss_; }
  const std::vector<std::pair<int64_t, double>>& kept_evals() const { return kept_eval_; }
  // The last step the earlier log recorded (0: none): with keep_through, the steps lost
  // are last_step_seen() - keep_through.
  int64_t last_step_seen() const { return last_seen_; }
  // {"resume":{"step","from","steps_lost","cause","ranks"}}: a run resumed after `step` steps
  // on `ranks` ranks from the checkpoint `from`; `cause` says why (a restart's exit status, or
  // "--resume"). ended_before_training (adds "ended_before_training": true, no "ranks"): a
  // relaunch that ended before it could write its own record, recorded by the next one.
  void resumed(int64_t step, const std::string& from, int64_t steps_lost, const std::string& cause, int ranks,
               bool ended_before_training = false);
  // The causes of the resume records carried over.
  const std::vector<std::string>& kept_resume_causes() const { return kept_resume_causes_; }
  // {"stop":{"step","signal","rank","saved"}}: a run stopped after `step` by `signal`,
  // received first by `rank`; `saved` the checkpoint written ("" for none).
  void stopped(int64_t step, const std::string& signal, int rank, const std::string& saved);
  void step(const StepStats& s, double ref_loss);
  // {"eval":{"step","loss","perplexity","tokens","seconds"[,"reference_loss"]}}
  void eval(const EvalStats& e, double ref_loss);
  void summary(const std::vector<std::pair<std::string, double>>& fields);
  void finish();  // closes and renames to the final name

 private:
  void check(const char* what);
  std::ofstream f_;
  std::string path_, partial_;
  std::vector<std::pair<int64_t, double>> kept_loss_, kept_eval_;
  std::vector<std::string> kept_resume_causes_;
  int64_t last_seen_ = 0;
};

// What the loss curve draws, by step.
struct LossCurve {
  std::vector<double> loss;  // training loss of steps first_step + 1, first_step + 2, ...
  int64_t first_step = 0;
  std::vector<double> reference;                        // of steps 1, 2, ... (--verify); may be empty
  std::vector<std::pair<int64_t, double>> validation;   // (step, validation loss); may be empty
};
// Loss against step: the training loss, the single-process reference dashed, the validation
// loss as marked points joined by a line. Written to `path`.partial, checked, then renamed
// to `path`; raises naming the file and the OS error.
void write_loss_svg(const std::string& path, const LossCurve& curve, const std::string& title);

}  // namespace hp::train
