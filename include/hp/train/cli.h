// hp-train's command line: the arguments and their checks, apart from the program so that
// they can be tested (tests/train/cli_test.sh runs the program itself).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hp/runtime.h"

namespace hp::train {

struct Args {
  std::string config;
  std::vector<std::string> overrides;
  bool verify = false, list_keys = false, help = false, estimate = false;
  bool strict = false;  // a collapsed model is an error, not a warning
  bool resume = false;
  std::string resume_dir;  // empty: save_dir's latest
  bool overwrite = false;  // --overwrite: delete an earlier run's checkpoints in save_dir
  bool auto_resume = false;  // --auto-resume: save_dir's latest when there is one, else start
  bool elastic = false;  // --elastic: a checkpoint of another world size laid out anew (elastic_layout)
  // --resume-changes k1,k2: settings a resume may change although they change the run's
  // course (lr, train_steps, ...; ResumeRule::kTrajectory); each a config key.
  std::vector<std::string> resume_changes;
  int world = 0;  // --world: the rank count --estimate and --plan assume (0 = this run's)
  // --plan [--ranks-per-node K] [--link SPEC] [--device-tflops X] [--memory-per-rank N] [--json]
  // (all but --json also for --elastic's planner)
  bool plan = false, plan_json = false;
  int ranks_per_node = 0;
  std::string link;
  double device_tflops = 0;
  int64_t memory_per_rank = 0;
  // --export-hf CKPT OUT [--dtype D] [--max-shard-size N]
  std::string export_ckpt, export_out;
  std::string upgrade_ckpt;  // --upgrade-checkpoint DIR: a format-1 checkpoint rewritten as format 2
  c10::optional<at::ScalarType> export_dtype;  // --dtype; unset: the parameters'
  bool export_without_mtp = false;  // --without-mtp: the multi-token prediction modules left out
  bool export_float8 = false;                 // --dtype fp8: the projections FP8 with block scales, the rest bf16
  int64_t max_shard_bytes = 0;  // 0: the default
};

// The usage text (--help, and after an argument error).
extern const char* const kUsage;

// Parses argv; raises hp::Error naming the argument (with the usage text where it helps)
// for an unknown argument, a missing or bad value, or options that do not go together.
Args parse_args(int argc, char** argv);

// The flags every rank of a run must be given alike, as (flag, value) for
// settings_mismatch: all but --config and --set, whose resolved config is compared instead.
std::vector<std::pair<std::string, std::string>> command_line_settings(const Args& a);

// hp::init's options for the run `a` asks for: the nccl backend when it trains a config
// that says device: cuda, unless HP_BACKEND names one. A config that cannot be read leaves
// the default (the run then reports its error on every rank).
InitOptions init_options(const Args& a);

}  // namespace hp::train
