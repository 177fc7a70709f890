#include "hp/train/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <limits>
#include <sstream>

#include "config_keys.h"
#include "hp/optim/muon.h"
#include "hp/core/error.h"
#include "hp/core/untrusted.h"

namespace hp::train {

using internal::apply;
using internal::apply_model_first;
using internal::is_model_first;
using internal::check_known;
using internal::Value;

ModelSpec::ModelSpec() : ModelSpec(models::default_model_family().name()) {}

ModelSpec::ModelSpec(const std::string& family, const std::string& preset) {
  const models::ModelFamily& f = models::model_family(family);
  preset_ = preset.empty() ? f.presets().front() : preset;
  args_ = f.preset(preset_);
}

ModelSpec::ModelSpec(std::unique_ptr<models::ModelArgs> args, std::string source)
    : preset_(args->family().presets().front()), source_(std::move(source)), args_(std::move(args)) {}

ModelSpec::ModelSpec(const ModelSpec& o) : preset_(o.preset_), source_(o.source_), args_(o.args_->clone()) {}

ModelSpec& ModelSpec::operator=(const ModelSpec& o) {
  if (this != &o) {
    preset_ = o.preset_;
    source_ = o.source_;
    args_ = o.args_->clone();
  }
  return *this;
}

c10::optional<RecomputePolicy> recompute_policy(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return c10::nullopt;
    case Recompute::kFull:
      return RecomputePolicy::kFull;
    case Recompute::kSelective:
      return RecomputePolicy::kKeepMatmuls;
    case Recompute::kLight:
      return RecomputePolicy::kLight;
  }
  return c10::nullopt;
}

namespace {

void flatten(const YAML::Node& n, const std::string& prefix, const std::string& origin, std::vector<Value>& out) {
  for (const auto& kv : n) {
    if (!kv.first.IsScalar()) {
      throw Error(origin + ": a key under '" + prefix + "' is not a plain name");
    }
    std::string key = prefix + kv.first.Scalar();
    const YAML::Node& v = kv.second;
    if (v.IsMap()) {
      // An empty section sets nothing: most likely its keys were lost (`model: {}` alone
      // trained the default model without a word).
      if (v.size() == 0) throw Error(origin + ": the section '" + key + "' is empty (it sets nothing: give its keys, or leave it out)");
      flatten(v, key + ".", origin, out);
    } else if (v.IsScalar()) {
      out.push_back({key, v.Scalar(), origin});
    } else if (v.IsNull()) {
      throw Error(origin + ": config key '" + key + "' has no value");
    } else if (v.IsSequence() && key == "pipeline_stage_layers") {
      // The one list-valued key: its items as "[a, b, ...]" (as_int_list reads that form).
      std::string text;
      for (const auto& item : v) {
        if (!item.IsScalar()) throw Error(origin + ": config key '" + key + "' must be a list of numbers");
        text += (text.empty() ? "" : ", ") + item.Scalar();
      }
      out.push_back({key, "[" + text + "]", origin});
    } else {
      throw Error(origin + ": config key '" + key + "' is a list; every key takes a single value");
    }
  }
}

// Counts the documents of a YAML text. yaml-cpp 0.7 (Debian's) has a parser that, on a token
// it cannot place (a line starting with ',', jbeder/yaml-cpp#1040), returns an empty document
// without consuming it: its LoadAll then loops forever, allocating (fixed upstream in 0.8 by
// jbeder/yaml-cpp#1319). Here a document that starts where the one before it started is
// that stall, and an error naming the place.
class DocumentCounter : public YAML::EventHandler {
 public:
  explicit DocumentCounter(const std::string& source) : source_(source) {}
  size_t count() const { return count_; }
  void OnDocumentStart(const YAML::Mark& mark) override {
    if (count_ > 0 && mark.pos == last_.pos) {
      throw Error(detail::str_cat(source_, ": not valid YAML at line ", mark.line + 1, ", column ", mark.column + 1,
                                  " (a token that cannot start a value, such as ',')"));
    }
    last_ = mark;
    ++count_;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

 private:
  std::string source_;
  size_t count_ = 0;
  YAML::Mark last_;
};

// The documents of `text` (in place of YAML::LoadAll, see DocumentCounter): how many, and the
// first one when there is one. Raises YAML::Exception for text that is not YAML, hp::Error
// (naming `source`) for the stall above.
struct YamlDocuments {
  size_t count = 0;
  YAML::Node first;
};
YamlDocuments load_documents(const std::string& text, const std::string& source) {
  hp::text::check_yaml_nesting(text, source);  // yaml-cpp's reader recurses
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentCounter counter(source);
  while (parser.HandleNextDocument(counter)) {
  }
  YamlDocuments docs;
  docs.count = counter.count();
  if (docs.count > 0) docs.first = YAML::Load(text);
  return docs;
}

}  // namespace


TrainConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& source) {
  std::vector<Value> values;
  try {
    const YamlDocuments docs = load_documents(yaml_text, source);
    if (docs.count > 1) throw Error(source + ": holds " + std::to_string(docs.count) + " YAML documents; expected one");
    YAML::Node root = docs.first;
    if (root.IsMap()) {
      flatten(root, "", source, values);
    } else if (!root.IsNull()) {
      throw Error(source + ": the config must be a map of keys to values");
    }
  } catch (const YAML::Exception& e) {
    throw Error(source + ": not valid YAML: " + e.what());
  }
  for (size_t i = 0; i < values.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (values[i].key == values[j].key) throw Error(source + ": config key '" + values[i].key + "' is given twice");
    }
  }
  std::vector<std::string> overridden;
  for (const std::string& o : overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw Error("--set " + o + ": expected key=value");
    }
    Value v{o.substr(0, eq), o.substr(eq + 1), "--set"};
    // A key given twice in the file is an error; so it is on the command line.
    for (const std::string& earlier : overridden) {
      if (earlier.compare(0, eq + 1, o, 0, eq + 1) == 0) {
        throw Error("--set " + v.key + " is given twice (--set " + earlier + " and --set " + o + ")");
      }
    }
    overridden.push_back(o);
    auto same = [&](const Value& x) { return x.key == v.key; };
    values.erase(std::remove_if(values.begin(), values.end(), same), values.end());
    values.push_back(v);
  }

  // Unknown keys first, then the model type, preset and Hugging Face folder, then
  // everything else.
  for (const Value& v : values) check_known(v);
  TrainConfig c;
  // Errors of combinations name the file and, when there are any, the overrides, so that a
  // value that came from --set is not blamed on the file.
  c.source = source;
  for (size_t i = 0; i < overrides.size(); ++i) c.source += (i ? " --set " : " with --set ") + overrides[i];
  for (const Value& v : values) c.given.insert(v.key);
  apply_model_first(c, values);
  for (const Value& v : values) {
    if (!is_model_first(v.key)) apply(c, v);
  }
  if (!c.given.count("compute_dtype")) c.compute_dtype = c.params_dtype;
  return c;
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  const std::string text = hp::files::read_regular(path, "config file", int64_t(1) << 24);
  // An empty (or comment-only) file is most likely the wrong file: it would train defaults.
  bool has_keys = false;
  try {
    const YamlDocuments docs = load_documents(text, path);
    // More than one: parse_config names that.
    has_keys = docs.count > 1 || (docs.first.IsMap() && docs.first.size() > 0);
  } catch (const YAML::Exception&) {
    has_keys = true;  // parse_config names the YAML error
  }
  HP_CHECK(has_keys, "config file '", path, "' holds no settings (it is empty or only comments); it must be one ",
           "YAML map of keys to values");
  return parse_config(text, overrides, path);
}

namespace {

// Muon's keys: none given under adamw; the derived ones resolved; the iteration's dtype and steps.
void validate_optimizer(TrainConfig& c) {
  const std::string& s = c.source;
  if (c.optimizer != OptimizerKind::kMuon) {
    // A Muon setting other than what it would be unset would be ignored: named instead.
    TrainConfig unset = c;
    const TrainConfig d;
    unset.muon_lr = d.muon_lr;
    unset.muon_momentum = d.muon_momentum;
    unset.muon_nesterov = d.muon_nesterov;
    unset.muon_weight_decay = d.muon_weight_decay;
    unset.muon_ns_coefficients = d.muon_ns_coefficients;
    unset.muon_ns_steps = d.muon_ns_steps;
    unset.muon_ns_dtype = d.muon_ns_dtype;
    unset.muon_update_scale = d.muon_update_scale;
    unset.muon_update_rms = d.muon_update_rms;
    unset.muon_scheme = d.muon_scheme;
    unset.muon_to_adamw = d.muon_to_adamw;
    unset.muon_to_muon = d.muon_to_muon;
    const auto mine = resolved_settings(c), defaults = resolved_settings(unset);
    for (size_t i = 0; i < mine.size() && i < defaults.size(); ++i) {
      const std::string& k = mine[i].first;
      HP_CHECK(k.rfind("muon_", 0) != 0 || !c.given.count(k) || mine[i].second == defaults[i].second, s, ": ", k, "=",
               mine[i].second, " is given but optimizer=adamw (set optimizer: muon to use it)");
    }
  }
  if (c.muon_lr < 0) c.muon_lr = c.lr;
  HP_CHECK(c.muon_update_scale == optim::MuonScale::kRms || !c.given.count("muon_update_rms"), s, ": muon_update_rms=",
           c.muon_update_rms, " is given but muon_update_scale=", to_string(c.muon_update_scale),
           " (it is the rms scale's target)");
  if (c.muon_weight_decay < 0) c.muon_weight_decay = c.weight_decay;
  HP_CHECK(c.muon_ns_dtype == at::kBFloat16 || c.muon_ns_dtype == at::kFloat || c.muon_ns_dtype == at::kDouble, s,
           ": muon_ns_dtype=", c.muon_ns_dtype, " is not supported yet (bfloat16, float32 or float64)");
  try {
    optim::ns_steps(c.muon_ns_coefficients, c.muon_ns_steps);
  } catch (const std::exception& e) {
    HP_CHECK(false, s, ": muon_ns_steps=", c.muon_ns_steps, ": ", e.what());
  }
}

// Checkpoints, Hugging Face import, fully_shard's waits, tensor and sequence parallelism.
void validate_features(TrainConfig& c) {
  const std::string& s = c.source;
  HP_CHECK(c.save_interval == 0 || !c.save_dir.empty(), s, ": save_interval=", c.save_interval,
           " needs save_dir (or output_dir, whose checkpoints/ it defaults to)");
  HP_CHECK(c.init_from_hf.empty() || c.model->supports_hf(), s, ": init_from_hf is not supported yet for model.type=",
           c.model.family().name(), " (no Hugging Face names)");
  HP_CHECK(!c.wait_per_submodule || !c.comm_fusion, s,
           ": wait_per_submodule=true needs comm_fusion=false (a fused all-gather per block leaves nothing to wait "
           "for per layer)");
  HP_CHECK(!c.sequence_parallel || c.tensor_parallel > 1, s,
           ": sequence_parallel=true needs tensor_parallel > 1 (tensor_parallel=", c.tensor_parallel, ")");
  if (c.tensor_parallel > 1) {
    try {
      c.model->check_tensor_parallel(c.tensor_parallel);
    } catch (const Error& e) {
      throw Error(detail::str_cat(s, ": ", e.what()));
    }
    HP_CHECK(!c.sequence_parallel || c.seq_length % c.tensor_parallel == 0, s, ": seq_length=", c.seq_length,
             " is not divisible by tensor_parallel=", c.tensor_parallel, " (sequence_parallel splits the sequence)");
  }
}

// The pipeline schedule, resolved from auto, and its stages against the model.
void validate_pipeline(TrainConfig& c) {
  const std::string& s = c.source;
  const int64_t pp = c.pipeline_parallel, v = c.pipeline_parallel_interleave_num;
  HP_CHECK(v == 1 || pp > 1, s, ": pipeline_parallel_interleave_num=", v,
           " needs pipeline_parallel > 1 (pipeline_parallel=", pp, ")");
  using P = PipelineScheduleKind;
  if (c.pipeline_schedule == P::kAuto) c.pipeline_schedule = v > 1 ? P::kInterleaved : P::k1F1B;
  const std::string schedule = to_string(c.pipeline_schedule);
  HP_CHECK(c.pipeline_stage_layers.empty() || pp > 1, s, ": pipeline_stage_layers needs pipeline_parallel > 1 ",
           "(pipeline_parallel=", pp, ")");
  const bool v_shaped = c.pipeline_schedule == P::kZBV || c.pipeline_schedule == P::kDualPipeV;
  HP_CHECK(v == 1 || c.pipeline_schedule == P::kInterleaved || v_shaped, s, ": pipeline_schedule=", schedule,
           " runs one stage per rank, but pipeline_parallel_interleave_num=", v, " (use interleaved, zbv or dualpipev)");
  HP_CHECK(!v_shaped || v == 2, s, ": pipeline_schedule=", schedule, " places two stages per rank: it needs ",
           "pipeline_parallel_interleave_num=2, not ", v);
  HP_CHECK(c.pipeline_schedule != P::kDualPipeV || pp == 1 || c.micro_batch_num >= 2 * pp, s,
           ": pipeline_schedule=dualpipev needs micro_batch_num >= 2 x pipeline_parallel = ", 2 * pp, ", not ",
           c.micro_batch_num, " (its steady phase pairs them)");
  if (pp > 1) {
    HP_CHECK(pp * v <= c.model->layers(), s, ": pipeline_parallel=", pp, " x pipeline_parallel_interleave_num=", v,
             " = ", pp * v, " stages, but the model has ", c.model->layers(),
             " layers (each stage needs at least one: more stages than layers)");
    // Interleaved runs the micro-batches in rounds of m / max(1, m / pp): that must divide.
    const int64_t rounds = std::max<int64_t>(1, c.micro_batch_num / pp);
    HP_CHECK(c.pipeline_schedule != P::kInterleaved || c.micro_batch_num % rounds == 0, s, ": micro_batch_num=",
             c.micro_batch_num, " with the interleaved schedule over pipeline_parallel=", pp, " would run in ", rounds,
             " rounds that do not divide it (not supported yet; a multiple of ", pp, " always works)");
    try {
      models::split_layers(c.model->layers(), static_cast<int>(pp * v), c.pipeline_stage_layers);
    } catch (const Error& e) {
      throw Error(detail::str_cat(s, ": pipeline_stage_layers: ", e.what()));
    }
    HP_CHECK((c.pipeline_schedule != P::kZBH1 && !v_shaped) || c.recompute == Recompute::kNone, s,
             ": pipeline_schedule=", schedule, " with recompute=", to_string(c.recompute),
             " is not supported yet (the weight gradients are taken from the forward's graph)");
  }
}

// Expert parallelism against the model, the degrees against the world (ParallelDims, which resolves
// data_parallel_shard = -1), the reshard group, and context parallelism.
void validate_layout(TrainConfig& c, int world_size) {
  const std::string& s = c.source;
  HP_CHECK(c.moe_dispatcher == ep::DispatcherKind::kAllToAll || c.expert_parallel > 1, s, ": moe_dispatcher=",
           to_string(c.moe_dispatcher), " needs expert_parallel > 1 (expert_parallel=", c.expert_parallel, ")");
  HP_CHECK(c.moe_overlap_chunks == 1 || c.expert_parallel > 1, s, ": moe_overlap_chunks=", c.moe_overlap_chunks,
           " needs expert_parallel > 1 (expert_parallel=", c.expert_parallel, "): without it nothing is exchanged");
  HP_CHECK(c.moe_overlap_chunks == 1 || c.moe_dispatcher == ep::DispatcherKind::kAllToAll, s, ": moe_overlap_chunks=",
           c.moe_overlap_chunks, " with moe_dispatcher=", to_string(c.moe_dispatcher),
           " is not supported yet (the all_to_all dispatcher overlaps)");
  if (c.expert_parallel > 1) {
    const int64_t ep = c.expert_parallel, experts = c.model->routed_experts();
    HP_CHECK(experts > 0, s, ": expert_parallel=", ep, " needs a model with routed experts (model.type=",
             c.model.family().name(), " has none)");
    HP_CHECK(experts % ep == 0, s, ": expert_parallel=", ep, " does not divide the ", experts,
             " routed experts (model.experts)");
    HP_CHECK(c.moe_overlap_chunks <= experts / ep, s, ": moe_overlap_chunks=", c.moe_overlap_chunks, " exceeds the ",
             experts / ep, " experts each rank holds (", experts, " over expert_parallel=", ep,
             "): a chunk is a whole number of experts");
    // The EP group is tensor_parallel's ranks and ep / tensor_parallel of dp_shard x cp's
    // (ParallelDims checks that they divide).
    HP_CHECK(c.tensor_parallel == 1 || c.sequence_parallel, s, ": expert_parallel=", ep, " with tensor_parallel=",
             c.tensor_parallel, " needs sequence_parallel=true (each tensor-parallel rank routes its piece of the ",
             "sequence); without it is not supported yet");
    if (c.tensor_parallel > 1 && c.model->mtp_layers() > 0) {
      HP_NOT_SUPPORTED(s, ": expert_parallel=", ep, " with tensor_parallel=", c.tensor_parallel,
                       " and multi-token prediction (model.mtp_layers=", c.model->mtp_layers(), ")");
    }
  }
  try {
    c.data_parallel_shard = ParallelDims(c.degrees(), world_size).dp_shard();
  } catch (const Error& e) {
    throw Error(detail::str_cat(s, ": ", e.what()));
  }
  if (c.reshard_after_forward_group_size > 0) {
    HP_CHECK(c.data_parallel_shard_strategy == ShardStrategy::kOptimGradsParams, s, ": reshard_after_forward_group_size=",
             c.reshard_after_forward_group_size, " needs data_parallel_shard_strategy=optim_grads_params (",
             to_string(c.data_parallel_shard_strategy), " keeps parameters gathered until backward)");
    HP_CHECK(c.data_parallel_shard % c.reshard_after_forward_group_size == 0, s, ": reshard_after_forward_group_size=",
             c.reshard_after_forward_group_size, " does not divide data_parallel_shard=", c.data_parallel_shard);
  }
  HP_CHECK(c.context_parallel_method == cp::Method::kRing || c.context_parallel > 1, s, ": context_parallel_method=",
           cp::method_name(c.context_parallel_method), " needs context_parallel > 1 (context_parallel=", c.context_parallel, ")");
  if (c.context_parallel > 1) {
    const int64_t cp = c.context_parallel;
    HP_CHECK(c.recompute != Recompute::kLight, s, ": recompute=light with context_parallel=", cp,
             " is not supported yet (the context-parallel attention's results are not kept: use full or selective)");
    try {
      cp::SequenceSplit(c.seq_length, static_cast<int>(cp));
    } catch (const Error& e) {
      throw Error(detail::str_cat(s, ": seq_length=", c.seq_length, " with context_parallel=", cp, ": ", e.what()));
    }
    HP_CHECK(c.model->attention_widths().kv > 0, s, ": context_parallel=", cp, " is not supported yet for model.type=",
             c.model.family().name(), " (its attention does not take a context-parallel group)");
    if (c.context_parallel_method == cp::Method::kUlysses) {
      // Ulysses trades the sequence for heads: each rank's (after tensor parallelism) query
      // and key/value heads split over the CP ranks.
      const models::AttentionWidths w = c.model->attention_widths();
      const int64_t h = w.heads / c.tensor_parallel, kv = w.kv_heads / c.tensor_parallel;
      HP_CHECK(h % cp == 0 && kv % cp == 0, s, ": context_parallel_method=ulysses needs the ", h, " query heads and ",
               kv, " key/value heads of a rank", c.tensor_parallel > 1 ? " (after tensor_parallel)" : "",
               " divisible by context_parallel=", cp, ": use ring or allgather");
    }
    // Sequence parallelism splits each CP rank's tokens over the tp ranks.
    HP_CHECK(!c.sequence_parallel || (c.seq_length / cp) % c.tensor_parallel == 0, s, ": seq_length=", c.seq_length,
             " over context_parallel=", cp, " leaves ", c.seq_length / cp, " tokens per rank, not divisible by tensor_parallel=",
             c.tensor_parallel, " (sequence_parallel splits them)");
  }
}

// Dtypes, batch, schedule, data and validation, and the model's own consistency.
void validate_training(TrainConfig& c) {
  const std::string& s = c.source;
  HP_CHECK(!c.apply_grad_on_fp32_main_grad || c.accumulate_allreduce_grads_in_fp32, s,
           ": apply_grad_on_fp32_main_grad=true needs accumulate_allreduce_grads_in_fp32=true (an fp32 main gradient ",
           "of a gradient reduced in ", c10::toString(c.compute_dtype), " would keep only its precision)");
  HP_CHECK(c.params_dtype != at::kHalf, s, ": params_dtype=float16 is not supported yet (needs loss scaling); use bfloat16");
  HP_CHECK(c.compute_dtype != at::kHalf, s, ": compute_dtype=float16 is not supported yet (needs loss scaling); use bfloat16");
  HP_CHECK(c.global_batch_size % c.micro_batch_num == 0 && (c.global_batch_size / c.micro_batch_num) % c.dp_size() == 0, s, ": global_batch_size=", c.global_batch_size,
           " must be a multiple of data-parallel ranks (", c.dp_size(), ") x micro_batch_num (", c.micro_batch_num, ")");
  HP_CHECK(c.seq_length <= c.model->max_seq(), s, ": seq_length=", c.seq_length, " is longer than model.max_seq=",
           c.model->max_seq());
  HP_CHECK(c.min_lr <= c.lr, s, ": min_lr=", c.min_lr, " is above lr=", c.lr);
  // Accepted as PyTorch's optimizers and torchtitan accept them, with a word: lr 0 (an
  // evaluation or a checkpoint's round trip through the trainer) and a run shorter than its
  // warmup (a smoke run of a shipped config: the warmup is cut to the run).
  const auto warn = [&c](const std::string& w) {  // once, however often validated
    if (std::find(c.warnings.begin(), c.warnings.end(), w) == c.warnings.end()) c.warnings.push_back(w);
  };
  if (c.lr == 0) warn("lr=0: the weights do not change");
  if (c.lr_warmup_steps > c.train_steps) {
    warn(detail::str_cat("lr_warmup_steps=", c.lr_warmup_steps, " exceeds train_steps=", c.train_steps,
                         ": the warmup is cut to ", c.train_steps, " steps"));
    c.lr_warmup_steps = c.train_steps;
  }
  if (c.data.type == DataType::kSynthetic) {
    HP_CHECK(c.data.path.empty(), s, ": data.path='", c.data.path, "' is only read when data.type is binary, text or megatron");
  } else {
    HP_CHECK(!c.data.path.empty(), s, ": data.type=", to_string(c.data.type), " needs data.path");
    HP_CHECK(!c.given.count("data.num_samples"), s, ": data.num_samples=", c.data.num_samples,
             " is only read for synthetic data (a file's samples are its tokens / seq_length)");
  }
  if (c.eval_interval == 0) {
    HP_CHECK(c.data.valid_path.empty(), s, ": data.valid_path='", c.data.valid_path,
             "' is only read when eval_interval > 0 (eval_interval=0: no validation)");
  } else if (c.data.type == DataType::kSynthetic) {
    HP_CHECK(c.data.valid_path.empty(), s, ": data.valid_path='", c.data.valid_path,
             "' is for files: synthetic data holds out its own validation samples");
    HP_CHECK(c.eval_steps > 0, s, ": eval_steps=0 (all of the validation set) with synthetic data, whose held-out ",
             "set is eval_steps global batches: give eval_steps > 0");
    // The held-out samples are numbered after the training ones: num_samples + eval_steps x
    // global_batch_size must be countable.
    HP_CHECK(c.global_batch_size <= 0 ||
                 c.eval_steps <= (std::numeric_limits<int64_t>::max() - c.data.num_samples) / c.global_batch_size,
             s, ": eval_steps=", c.eval_steps, " x global_batch_size=", c.global_batch_size,
             " held-out samples after data.num_samples=", c.data.num_samples, " are too many to count");
  } else {
    HP_CHECK(!c.data.valid_path.empty(), s, ": eval_interval=", c.eval_interval, " needs data.valid_path (the ",
             "validation set, of data.type=", to_string(c.data.type), ")");
  }
  HP_CHECK(c.data.type == DataType::kBinary || !c.given.count("data.token_dtype"), s, ": data.token_dtype=",
           to_string(c.data.token_dtype),
           " is only read when data.type is binary (megatron's index says its own)");
  HP_CHECK(c.data.type != DataType::kText || c.model->vocab() >= 256, s,
           ": data.type=text uses byte tokens 0..255 but model.vocab=", c.model->vocab());
  try {
    c.model->validate();
  } catch (const Error& e) {
    throw Error(s + ": model: " + e.what());
  }
}

}  // namespace

void TrainConfig::validate(int world_size) {
  save_dir = checkpoint_dir();
  validate_optimizer(*this);
  validate_features(*this);
  validate_pipeline(*this);
  validate_layout(*this, world_size);
  validate_training(*this);
}

ParallelDims TrainConfig::parallel_dims() const {
  HP_CHECK(data_parallel_shard > 0, "TrainConfig::parallel_dims: the config is not validated (data_parallel_shard=",
           data_parallel_shard, ")");
  const int64_t world = data_parallel * data_parallel_shard * context_parallel * tensor_parallel * pipeline_parallel;
  return ParallelDims(degrees(), static_cast<int>(world));
}

MixedPrecisionPolicy mixed_precision(const TrainConfig& c) {
  MixedPrecisionPolicy p;
  if (c.compute_dtype != c.params_dtype) p.param_dtype = c.compute_dtype;
  if (c.accumulate_allreduce_grads_in_fp32) p.reduce_dtype = at::kFloat;
  p.apply_grad_on_fp32_main_grad = c.fp32_master() || c.apply_grad_on_fp32_main_grad;
  return p;
}

std::string describe(const TrainConfig& c) {
  std::ostringstream os;
  os << "model " << c.model.family().name() << " ("
     << (c.model.source().empty() ? c.model.preset() + " preset" : "read from " + c.model.source()) << ", "
     << c.model->num_params()
     << " parameters); data " << to_string(c.data.type) << (c.data.path.empty() ? "" : " " + c.data.path)
     << (c.eval_interval > 0
             ? detail::str_cat("; validation every ", c.eval_interval, " steps on ",
                               c.eval_steps > 0 ? detail::str_cat(c.eval_steps, " batches of ") : std::string("all of "),
                               c.data.valid_path.empty() ? std::string("held-out synthetic samples") : c.data.valid_path)
             : std::string())
     << "\n";
  // Also for a config not validated yet (data_parallel_shard -1: the rest of the world).
  os << "layout: " << ParallelDims::describe(c.degrees()) << (c.data_parallel > 1 ? " (HSDP" : " (FSDP")
     << (c.tensor_parallel > 1 ? detail::str_cat(" + TP, sequence_parallel ", c.sequence_parallel ? "on" : "off",
                                                 ", loss parallel)")
                               : std::string(")"))
     << (c.context_parallel > 1
             ? detail::str_cat(", sequences over context_parallel ", c.context_parallel, " (",
                               to_string(c.context_parallel_method), ", head-tail split)")
             : std::string())
     << (c.expert_parallel > 1
             ? detail::str_cat(", experts over expert_parallel ", c.expert_parallel, " x ",
                               c.data_parallel_shard > 0 ? std::to_string(c.parallel_dims().size(Group::kExpertShard))
                                                         : std::string("(dp_shard x cp x tp / ep)"),
                               " ranks holding the same ones (", to_string(c.moe_dispatcher), " dispatch)")
             : std::string())
     << ", " << to_string(c.data_parallel_shard_strategy)
     << (c.reshard_after_forward_group_size > 1
             ? detail::str_cat(" (resharded to groups of ", c.reshard_after_forward_group_size, " after forward)")
             : c.reshard_after_forward_group_size == 1 ? std::string(" (group of 1: kept gathered after forward)")
                                                       : std::string())
     << (c.pipeline_parallel > 1
             ? detail::str_cat(", pipeline ", to_string(c.pipeline_schedule), " with ", c.pipeline_parallel * c.pipeline_parallel_interleave_num,
                               " stages (", c.pipeline_parallel_interleave_num, " per rank) x ", c.micro_batch_num,
                               " micro-batches")
             : std::string())
     << ", comm_fusion " << (c.comm_fusion ? "on" : "off") << (c.wait_per_submodule ? ", wait per submodule" : "")
     << (c.recompute == Recompute::kNone ? std::string() : ", recompute " + to_string(c.recompute)) << "\n";
  const GroupDtypes d = resolve_dtypes(mixed_precision(c), c.params_dtype);
  os << "dtypes: params " << c10::toString(d.param) << ", compute " << c10::toString(d.compute)
     << ", gradient reduction " << c10::toString(d.reduce)
     << (d.main_grad ? ", fp32 main grads" : "") << (c.fp32_master() ? " and master weights" : "")
     << "; device " << to_string(c.device) << "\n";
  os << "batch: " << c.global_batch_size << " samples x " << c.seq_length << " tokens, " << c.micro_batch_num
     << " micro-batch(es) of " << c.micro_batch_size() << " per rank; " << c.train_steps << " steps, lr " << c.lr
     << " (" << c.lr_warmup_steps << " warmup, " << to_string(c.lr_decay_style) << " to " << c.min_lr << "), clip_grad "
     << c.clip_grad << ", weight_decay " << c.weight_decay;
  if (c.optimizer == OptimizerKind::kMuon) {
    os << "\noptimizer: muon for the hidden matrices (lr " << c.muon_lr << ", momentum " << c.muon_momentum
       << (c.muon_nesterov ? " nesterov" : "") << ", weight_decay " << c.muon_weight_decay << ", "
       << to_string(c.muon_ns_coefficients) << " x " << optim::ns_steps(c.muon_ns_coefficients, c.muon_ns_steps).size()
       << " in " << c10::toString(c.muon_ns_dtype) << ", " << to_string(c.muon_update_scale) << " scale";
    if (c.muon_update_scale == optim::MuonScale::kRms) os << " (update RMS " << c.muon_update_rms << ")";
    os << ", " << to_string(c.muon_scheme) << " scheme), adamw for the rest";
  }
  for (const std::string& w : c.warnings) os << "\nwarning: " << w;
  return os.str();
}

}  // namespace hp::train
