// The parts of a training run (hp/train/run.h): the checks before it, the single-process
// reference, the resume and what the run reports.
#include "hp/train/run.h"

#include <ATen/Parallel.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

#include "hp/ckpt/checkpoint.h"
#include "hp/core/env.h"
#include "hp/core/error.h"
#include "hp/runtime.h"
#include "hp/train/checkpoint_manager.h"
#include "hp/train/preemption.h"
#include "trainer_impl.h"

namespace hp::train {
namespace {

constexpr double kNone = std::numeric_limits<double>::quiet_NaN();

EarlierRun earlier_run(const Args& args) {
  if (args.resume || args.auto_resume) return EarlierRun::kContinue;
  return args.overwrite ? EarlierRun::kReplace : EarlierRun::kRefuse;
}

}  // namespace

RunInputs prepare_run(const Args& args, int world_size, int rank) {
  RunInputs in;
  TrainConfig& c = in.config;
  c = load_config(args.config, args.overrides);
  c.validate(args.world > 0 ? args.world : world_size);
  in.memory = estimate_rank_memory(c);
  if (args.estimate) return in;
  training_device(c.device);  // a device this process cannot use is named before anything starts
  check_fits_node(c, in.memory, hp::local_world_size());
  in.data = make_dataset(c.data, c.seq_length, c.model->vocab(), c.seed);  // checks the file
  // A Hugging Face folder's config.json, index and shard headers: checked here, so that what
  // is wrong with it is the command's error, said once (the load in the Trainer would raise
  // it on every rank).
  if (!c.init_from_hf.empty()) internal::hf_sources(c, c.init_from_hf);
  if (c.eval_interval > 0) {
    in.valid = make_validation_dataset(c);
    validation_batches(c, *in.valid);  // holds what an evaluation reads
  }
  HP_CHECK(!args.auto_resume || c.save_interval > 0, "--auto-resume: save_interval=0: this run saves no "
           "checkpoint to resume from (set save_interval)");
  return in;
}

std::unique_ptr<RunFolders> claim_folders(const Args& args, const TrainConfig& c, int rank) {
  // Every folder the run writes, made and probed now, not at the first save; locked against
  // a second run; an earlier run's checkpoints refused unless told otherwise.
  return std::make_unique<RunFolders>(c, rank, earlier_run(args));
}

double ReferenceLosses::at(int64_t step) const {
  return step >= 1 && step <= static_cast<int64_t>(loss.size()) ? loss[static_cast<size_t>(step - 1)] : kNone;
}

double ReferenceLosses::valid_at(int64_t step) const {
  auto it = valid.find(step);
  return it != valid.end() ? it->second : kNone;
}

ReferenceLosses train_reference(const TrainConfig& c, std::shared_ptr<const TokenDataset> data,
                                std::shared_ptr<const TokenDataset> valid) {
  ReferenceLosses ref;
  const int threads = at::get_num_threads();
  hp::set_compute_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  try {
    ReferenceTrainer trainer(c, std::move(data), std::move(valid));
    for (int64_t s = 0; s < c.train_steps; ++s) {
      const StepStats st = trainer.step();
      ref.loss.push_back(st.loss);
      ref.seconds += st.step_time_s;
      if (eval_due(c, st.step)) {
        const EvalStats ev = trainer.evaluate();
        ref.valid[ev.step] = ev.loss;
        ref.seconds += ev.seconds;
      }
    }
  } catch (...) {
    hp::set_compute_threads(threads);
    throw;
  }
  hp::set_compute_threads(threads);
  return ref;
}

namespace {

// --plan's options (and elastic_layout's): the links of --link, else HP_SIM_NET, else this
// machine's shared memory (measured; `spec` left empty then).
PlanOptions plan_options(const Args& args, int world, std::string& spec) {
  PlanOptions o;
  o.world = world;
  spec = args.link.empty() ? hp::env::get_string("HP_SIM_NET") : args.link;
  o.network = spec.empty() ? measured_local_link() : hp::SimulatedNetwork::parse(spec);
  if (args.ranks_per_node > 0) o.network.ranks_per_node = args.ranks_per_node;
  o.device = args.device_tflops > 0;
  o.memory_per_rank = args.memory_per_rank;
  return o;
}

// A whole number the checkpoint `from` records as run.<key>, within [1, 2^24].
int64_t recorded_count(const std::map<std::string, std::string>& saved, const std::string& from, const char* key) {
  auto it = saved.find(std::string("run.") + key);
  HP_CHECK(it != saved.end(), "--elastic: ", from, " records no ", key,
           " (a checkpoint written before runs recorded their settings): its layout is unknown; resume it on its own "
           "number of ranks");
  int64_t v = 0;
  size_t used = 0;
  try {
    v = std::stoll(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  HP_CHECK(used == it->second.size() && used > 0 && v >= 1 && v <= (int64_t{1} << 24), "--elastic: ", from, " records ",
           key, "='", it->second, "': expected a whole number from 1 to 2^24");
  return v;
}

}  // namespace

ElasticChoice elastic_layout(const Args& args, int world_size) {
  ElasticChoice out;
  const TrainConfig given = load_config(args.config, args.overrides);
  const std::string save_dir = given.checkpoint_dir();
  const bool resuming = args.resume || (args.auto_resume && !save_dir.empty() && std::filesystem::exists(save_dir + "/latest"));
  if (!resuming) return out;  // nothing trained yet: the config's own layout
  const std::string from = CheckpointManager::resolve(args.resume_dir.empty() ? save_dir : args.resume_dir);
  const std::map<std::string, std::string> saved = ckpt::load({}, from);
  TrainConfig before = given;  // the checkpoint's run's layout
  before.data_parallel = recorded_count(saved, from, "data_parallel");
  before.data_parallel_shard = recorded_count(saved, from, "data_parallel_shard");
  before.context_parallel = recorded_count(saved, from, "context_parallel");
  before.tensor_parallel = recorded_count(saved, from, "tensor_parallel");
  before.pipeline_parallel = recorded_count(saved, from, "pipeline_parallel");
  before.expert_parallel = recorded_count(saved, from, "expert_parallel");
  before.micro_batch_num = recorded_count(saved, from, "micro_batch_num");
  const int64_t batch = recorded_count(saved, from, "global_batch_size");
  double world0 = 1;
  for (int64_t d : {before.data_parallel, before.data_parallel_shard, before.context_parallel, before.tensor_parallel,
                    before.pipeline_parallel}) {
    world0 *= static_cast<double>(d);
  }
  const double per_micro = static_cast<double>(before.dp_size()) * static_cast<double>(before.micro_batch_num);
  HP_CHECK(world0 <= static_cast<double>(int64_t{1} << 24) && per_micro <= static_cast<double>(batch) &&
               batch % (before.dp_size() * before.micro_batch_num) == 0,
           "--elastic: ", from, " records a layout of ", world0, " rank(s) with global_batch_size=", batch,
           " in micro_batch_num=", before.micro_batch_num, " over ", before.dp_size(),
           " data-parallel rank(s), which no run makes");
  const int64_t samples = batch / (before.dp_size() * before.micro_batch_num);
  const std::string was = detail::str_cat(static_cast<int64_t>(world0), " rank(s) (", PlanRow{before}.layout(),
                                          ", micro_batch_num=", before.micro_batch_num, ")");
  // The choice as --set items: every key a layout sets (plan_layouts' admit).
  const auto overrides_to = [](const TrainConfig& to) {
    return std::vector<std::string>{
        detail::str_cat("data_parallel=", to.data_parallel),
        detail::str_cat("data_parallel_shard=", to.data_parallel_shard),
        detail::str_cat("context_parallel=", to.context_parallel),
        "context_parallel_method=" + to_string(to.context_parallel_method),
        detail::str_cat("tensor_parallel=", to.tensor_parallel),
        detail::str_cat("pipeline_parallel=", to.pipeline_parallel),
        detail::str_cat("expert_parallel=", to.expert_parallel),
        "moe_dispatcher=" + to_string(to.moe_dispatcher),
        detail::str_cat("moe_overlap_chunks=", to.moe_overlap_chunks),
        detail::str_cat("micro_batch_num=", to.micro_batch_num),
        "data_parallel_shard_strategy=" + to_string(to.data_parallel_shard_strategy),
        detail::str_cat("reshard_after_forward_group_size=", to.reshard_after_forward_group_size)};
  };
  const auto seconds = [](double s) {
    char b[32];
    std::snprintf(b, sizeof b, "%.3g s", s);
    return std::string(b);
  };
  if (static_cast<int64_t>(world0) == world_size) {
    TrainConfig probe = given;
    try {
      probe.validate(world_size);
      return out;  // the config's own layout fits: it is the run's
    } catch (const std::exception&) {
    }
    out.overrides = overrides_to(before);
    out.lines.push_back("elastic: the config's layout does not fit " + std::to_string(world_size) +
                        " rank(s); the checkpoint's run's, on as many: " + was);
    return out;
  }
  std::string spec;
  PlanOptions o = plan_options(args, world_size, spec);
  o.tensor_parallel = before.tensor_parallel;
  o.pipeline_parallel = before.pipeline_parallel;
  o.micro_batch_samples = samples;
  TrainConfig base = given;
  base.tensor_parallel = before.tensor_parallel;
  base.pipeline_parallel = before.pipeline_parallel;
  const std::vector<PlanRow> rows = plan_layouts(base, o, measured_compute(base, args.device_tflops));
  const auto feasible = std::count_if(rows.begin(), rows.end(), [](const PlanRow& r) { return r.feasible; });
  const std::string kept = detail::str_cat("tensor_parallel=", before.tensor_parallel, " pipeline_parallel=",
                                           before.pipeline_parallel, " and micro-batches of ", samples,
                                           " sample(s) per data-parallel rank (global_batch_size=",
                                           given.global_batch_size, ")");
  if (feasible == 0) {
    std::string why;
    for (size_t i = 0; i < rows.size() && i < 3; ++i) why += "; " + rows[i].layout() + ": " + rows[i].reason;
    throw Error(detail::str_cat("--elastic: the checkpoint's run had ", was, "; no layout of ", world_size,
                                " rank(s) keeps ", kept, rows.empty() ? std::string(": there is none") : why));
  }
  const PlanRow& best = rows.front();
  out.overrides = overrides_to(best.config);
  out.lines.push_back(detail::str_cat(
      "elastic: the checkpoint's run had ", was, "; on ", world_size, " rank(s) now: ", best.layout(),
      ", micro_batch_num=", best.config.micro_batch_num, ", keeping ", kept));
  std::string next;
  if (feasible > 1) next = detail::str_cat("; next ", rows[1].layout(), " at ", seconds(rows[1].step_s));
  out.lines.push_back(detail::str_cat("elastic: the planner's fastest of ", feasible, " feasible layout(s) keeping them: ",
                                      seconds(best.step_s), " a step predicted, ",
                                      format_bytes(static_cast<int64_t>(best.memory.estimate.total() + best.activations)),
                                      " per rank", next, " (links: ", spec.empty() ? "this machine's, measured" : spec,
                                      ")"));
  return out;
}

std::string plan_output(const Args& args, int world_size) {
  const TrainConfig c = load_config(args.config, args.overrides);
  std::string spec;
  const PlanOptions o = plan_options(args, args.world > 0 ? args.world : world_size, spec);
  const auto rows = plan_layouts(c, o, measured_compute(c, args.device_tflops));
  if (args.plan_json) return plan_json(rows);
  return "plan: " + args.config + " over " + std::to_string(o.world) + " rank(s)" +
         (o.network.ranks_per_node > 0 ? ", " + std::to_string(o.network.ranks_per_node) + " per node"
                                       : std::string(", one node")) +
         "; links: " + (spec.empty() ? "this machine's shared memory (measured), " : "") + o.network.to_string() +
         "\n" + format_plan(rows);
}

std::vector<std::string> check_resume_settings(const TrainConfig& c, const std::string& dir,
                                               const std::vector<std::string>& allowed) {
  const std::string from = CheckpointManager::resolve(dir.empty() ? c.save_dir : dir);
  const std::vector<std::pair<std::string, std::string>> mine = resolved_settings(c);
  for (const std::string& k : allowed) {
    const bool known = std::any_of(mine.begin(), mine.end(), [&k](const auto& e) { return e.first == k; });
    HP_CHECK(known, "--resume-changes: '", k, "' is not a config key of this run (hp-train --list-keys lists them)");
  }
  const std::map<std::string, std::string> saved = ckpt::load({}, from);
  std::vector<std::string> lines, free, allowed_changes, refused, refused_keys, unrecorded;
  for (const auto& [k, v] : mine) {
    const ResumeRule rule = resume_rule(c, k);
    if (rule == ResumeRule::kFixed) continue;   // Trainer::load compares the model's
    if (follows_another_key(c, k)) continue;    // compared through the key it follows
    const bool model = k.rfind("model.", 0) == 0;
    auto it = saved.find((model ? "config." : "run.") + k);
    if (it == saved.end()) {
      if (rule == ResumeRule::kTrajectory) unrecorded.push_back(k);
      continue;
    }
    if (it->second == v) continue;
    const std::string change = k + " " + it->second + " -> " + v;
    if (rule == ResumeRule::kFree) {
      free.push_back(change);
    } else if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) {
      allowed_changes.push_back(change);
    } else {
      refused.push_back(k + "=" + it->second + " in the checkpoint but " + k + "=" + v + " now");
      refused_keys.push_back(k);
    }
  }
  const auto joined = [](const std::vector<std::string>& l, const char* sep) {
    std::string s;
    for (const auto& e : l) s += (s.empty() ? "" : sep) + e;
    return s;
  };
  if (!refused.empty()) {
    throw Error(detail::str_cat(
        "resume from ", from, ": ", refused.size(), " setting(s) differ from the checkpoint's run and would change its ",
        "course: ", joined(refused, ", "), ". To continue with them, name them: --resume-changes ", joined(refused_keys, ","),
        "; for a new experiment, train into another save_dir (or --overwrite this one)"));
  }
  if (!free.empty()) lines.push_back("resume: changed (layout, timing or output): " + joined(free, ", "));
  if (!allowed_changes.empty()) lines.push_back("resume: changed (--resume-changes): " + joined(allowed_changes, ", "));
  if (ckpt::format_version(from) == 1) {
    lines.push_back("resume: '" + from + "' is a format-1 checkpoint (written before checksums): its files are read " +
                    "unchecked for damage; hp-train --upgrade-checkpoint " + from + " checksums them");
  }
  if (!unrecorded.empty()) {
    lines.push_back(detail::str_cat("resume: the checkpoint records no ", unrecorded.size(),
                                    " of this run's settings (written before settings were recorded): taken as given"));
  }
  return lines;
}

Resumed resume(Trainer& trainer, const TrainConfig& c, const std::string& dir) {
  Resumed r;
  r.dir = CheckpointManager::resolve(dir.empty() ? c.save_dir : dir);
  r.report = trainer.load(r.dir);
  HP_CHECK(trainer.steps_done() <= c.train_steps, "resume from ", r.dir, ": it is at step ", trainer.steps_done(),
           ", past train_steps=", c.train_steps);
  return r;
}

RunReport::RunReport(const TrainConfig& c, int world_size, bool lead, const ReferenceLosses* reference,
                     std::function<void(const std::string&)> say)
    : c_(c), world_size_(world_size), lead_(lead), reference_(reference), say_(std::move(say)), last_valid_(kNone) {}

void RunReport::open_metrics(int64_t resumed_step, const std::string& from, const std::string& cause,
                             const std::vector<std::string>& earlier_causes) {
  if (!lead_ || c_.output_dir.empty()) return;
  // A previous run's curve must not sit beside this run's metrics.
  std::remove((c_.output_dir + "/loss.svg").c_str());
  metrics_ = std::make_unique<MetricsLog>(c_.output_dir + "/metrics.jsonl", resumed_step);
  if (resumed_step < 0) return;
  // What the earlier run had done beyond its checkpoint is trained again: lost.
  const int64_t lost = std::max<int64_t>(0, metrics_->last_step_seen() - resumed_step);
  const auto& kept = metrics_->kept_resume_causes();
  for (const std::string& earlier : earlier_causes) {
    if (earlier.empty() || earlier == cause || std::find(kept.begin(), kept.end(), earlier) != kept.end()) continue;
    metrics_->resumed(resumed_step, from, 0, earlier, world_size_, /*ended_before_training=*/true);
  }
  metrics_->resumed(resumed_step, from, lost, cause, world_size_);
  if (lost > 0) {
    say_(std::to_string(lost) + " step(s) lost: the earlier run had reached step " +
         std::to_string(metrics_->last_step_seen()) + "; they are trained again");
  }
}

std::vector<std::string> launcher_restart_causes() {
  std::vector<std::string> out;
  std::istringstream lines(hp::env::get_string("HP_RESTART_CAUSES"));
  for (std::string l; std::getline(lines, l);) out.push_back(l);
  return out;
}

void leave_failure_marker(int rank, const std::string& error) {
  const std::string markers = hp::env::get_string("HP_FAILURE_MARKERS");
  if (markers.empty()) return;
  // Best effort, on the way out: a marker that cannot be written leaves the launcher to
  // mpirun's own end of the job, as without one.
  std::ofstream(markers + "/rank" + std::to_string(rank)) << "exit status " << kFailedExit << ": " << error << "\n";
}

bool collapsed(const StepStats& st, int64_t vocab) {
  const double uniform = std::log(static_cast<double>(vocab));
  return st.grad_norm == 0 && std::abs(st.loss - uniform) <= 1e-3 * uniform;
}

TrainCallbacks RunReport::callbacks(int64_t first_step) {
  TrainCallbacks cb;
  cb.on_step = [this, first_step](const StepStats& st) {
    if (collapsed(st, c_.model->vocab())) {
      const std::string what = detail::str_cat("step ", st.step, ": the gradient norm is 0 at loss ", st.loss,
                                               ", ln(vocab=", c_.model->vocab(), "): the model has collapsed to ",
                                               "uniform predictions and its weights no longer change ",
                                               diverged_hint(c_));
      if (strict_) throw TrainingDiverged(what + " (--strict)");
      if (!warned_collapse_) say_("warning: " + what + "; --strict makes this an error");
      warned_collapse_ = true;
    }
    total_s_ += st.step_time_s;
    const double ref = reference_ && lead_ ? reference_->at(st.step) : kNone;
    verify_.add(st.step, st.loss, ref);
    if (metrics_) metrics_->step(st, ref);
    if (lead_ && (st.step % c_.log_interval == 0 || st.step == 1 || st.step == c_.train_steps)) {
      const double eta =
          total_s_ / static_cast<double>(st.step - first_step) * static_cast<double>(c_.train_steps - st.step);
      say_(progress_line(st, c_.train_steps, eta, ref, last_valid_));
    }
  };
  cb.on_eval = [this](const EvalStats& ev) {
    const double ref = reference_ && lead_ ? reference_->valid_at(ev.step) : kNone;
    verify_valid_.add(ev.step, ev.loss, ref);
    last_valid_ = ev.loss;
    valid_curve_.emplace_back(ev.step, ev.loss);
    if (metrics_) metrics_->eval(ev, ref);
    say_(eval_line(ev, c_.train_steps, ref));
  };
  cb.on_save = [this](const std::string& dir, bool background) {
    say_(background ? "saving " + dir + " in the background" : "saved " + dir);
  };
  return cb;
}

void RunReport::stopped(const TrainSummary& s, int64_t step) {
  const std::string signal = signal_name(s.stopped_by);
  say_("stopped by " + signal + " (received first by rank " + std::to_string(s.stop_rank) + ") after step " +
       std::to_string(step) + ": " +
       (s.stop_saved.empty() ? std::string("nothing saved (the run saves nowhere: save_interval=0)")
                             : "saved " + s.stop_saved + "; continue with --resume") +
       "; exit status " + std::to_string(kPreemptedExit));
  // The metrics stay under their temporary name: the run is not finished.
  if (metrics_) metrics_->stopped(step, signal, s.stop_rank, s.stop_saved);
}

int RunReport::ended(const TrainSummary& s, int64_t steps_done) {
  if (s.stopped_by != 0 && steps_done < c_.train_steps) {
    stopped(s, steps_done);
    return kPreemptedExit;
  }
  if (s.stopped_by != 0) {
    say_("a stop signal (" + signal_name(s.stopped_by) + ") came during the last step: the run is complete" +
         (s.stop_saved.empty() ? std::string() : ", saved " + s.stop_saved));
  }
  finished(s);
  return kFinishedExit;
}

bool RunReport::finish_earlier() {
  if (!lead_ || c_.output_dir.empty()) return false;
  const std::string path = c_.output_dir + "/metrics.jsonl";
  struct stat st{};
  if (::stat((path + ".partial").c_str(), &st) != 0 || ::stat(path.c_str(), &st) == 0) return false;
  MetricsLog log(path, c_.train_steps);
  const auto& losses = log.kept_losses();
  std::vector<std::pair<std::string, double>> fields = {{"steps", static_cast<double>(c_.train_steps)},
                                                        {"ranks", static_cast<double>(world_size_)}};
  if (!losses.empty()) {
    fields.push_back({"first_loss", losses.front().second});
    fields.push_back({"final_loss", losses.back().second});
  }
  if (!log.kept_evals().empty()) fields.push_back({"final_valid_loss", log.kept_evals().back().second});
  log.summary(fields);
  log.finish();
  LossCurve curve;
  for (const auto& [step, loss] : losses) curve.loss.push_back(loss);
  curve.first_step = losses.empty() ? 0 : losses.front().first - 1;
  curve.validation = log.kept_evals();
  write_loss_svg(c_.output_dir + "/loss.svg", curve,
                 c_.model.family().name() + " " + c_.model.preset() + ", " + std::to_string(world_size_) + " rank(s)");
  say_("the earlier run ended before its report: wrote " + path + " (" + std::to_string(losses.size()) +
       " steps) and " + c_.output_dir + "/loss.svg");
  return true;
}

void RunReport::finished(const TrainSummary& s) {
  say_(summary_line(s));
  if (reference_) say_(verify_.line(c_.train_steps));
  if (reference_ && verify_valid_.any) {
    say_(verify_valid_.line(static_cast<int64_t>(s.evals.size()), "validation loss", "evaluations"));
  }
  if (!metrics_) return;
  const auto per_step = [&](int64_t bytes) {
    return static_cast<double>(bytes) / static_cast<double>(std::max<int64_t>(1, s.steps));
  };
  std::vector<std::pair<std::string, double>> fields = {
      {"steps", static_cast<double>(c_.train_steps)}, {"seconds", s.seconds},
      {"first_loss", s.losses.front()},               {"final_loss", s.losses.back()},
      {"tokens_per_s", s.tokens_per_s},               {"peak_bytes", static_cast<double>(s.peak_bytes)},
      {"ranks", static_cast<double>(world_size_)},    {"optimizer_seconds", s.optimizer_seconds},
      {"comm_bytes_per_step", per_step(s.comm_bytes)},
      {"optimizer_comm_bytes_per_step", per_step(s.optimizer_comm_bytes)}};
  if (!s.evals.empty()) fields.push_back({"final_valid_loss", s.evals.back().loss});
  if (reference_) {
    fields.push_back({"verify_max_abs_diff", verify_.worst_abs});
    fields.push_back({"verify_max_rel_diff", verify_.worst_rel});
  }
  if (reference_ && verify_valid_.any) fields.push_back({"verify_valid_max_abs_diff", verify_valid_.worst_abs});
  metrics_->summary(fields);
  metrics_->finish();
  LossCurve curve;
  curve.loss = s.losses;
  curve.first_step = s.first_step;
  // A resumed run draws the steps before its checkpoint too, where the metrics kept them all.
  const auto& kept = metrics_->kept_losses();
  if (!kept.empty() && static_cast<int64_t>(kept.size()) == s.first_step && kept.front().first == 1 &&
      kept.back().first == s.first_step) {
    std::vector<double> all;
    for (const auto& [step, loss] : kept) all.push_back(loss);
    all.insert(all.end(), s.losses.begin(), s.losses.end());
    curve.loss = all;
    curve.first_step = 0;
  }
  if (reference_) curve.reference = reference_->loss;
  curve.validation = metrics_->kept_evals();
  curve.validation.insert(curve.validation.end(), valid_curve_.begin(), valid_curve_.end());
  write_loss_svg(c_.output_dir + "/loss.svg", curve,
                 c_.model.family().name() + " " + c_.model.preset() + ", " + std::to_string(world_size_) + " rank(s)");
  say_("wrote " + c_.output_dir + "/metrics.jsonl and " + c_.output_dir + "/loss.svg");
}

}  // namespace hp::train
