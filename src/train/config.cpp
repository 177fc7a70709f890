#include "hp/train/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "hp/core/error.h"
#include "hp/models/tensor_parallel.h"

namespace hp::train {

int64_t ModelSpec::vocab() const { return type == "llama" ? llama.vocab : deepseek.vocab; }
int64_t ModelSpec::dim() const { return type == "llama" ? llama.dim : deepseek.dim; }
int64_t ModelSpec::layers() const { return type == "llama" ? llama.layers : deepseek.layers; }
int64_t ModelSpec::max_seq() const { return type == "llama" ? llama.max_seq : deepseek.max_seq; }
int64_t ModelSpec::num_params() const {
  return type == "llama" ? llama.num_params() : deepseek.num_params();
}
int64_t ModelSpec::largest_param() const {
  return type == "llama" ? llama.largest_param() : deepseek.largest_param();
}
int64_t ModelSpec::largest_block_params() const {
  return type == "llama" ? llama.block_params() : deepseek.largest_block_params();
}

namespace {
// One block's parameters split by tensor parallelism and kept whole on every tp rank.
struct BlockCount {
  int64_t total = 0, whole = 0;
  int64_t layers = 0;  // blocks of this kind
  int64_t per_rank(int64_t tp) const { return (total - whole) / tp + whole; }
};

std::vector<BlockCount> block_counts(const ModelSpec& m) {
  if (m.type == "llama") return {BlockCount{m.llama.block_params(), 2 * m.llama.dim, m.llama.layers}};  // 2 norms
  const models::DeepSeekConfig& d = m.deepseek;
  std::vector<BlockCount> out;
  for (bool dense : {true, false}) {
    if (dense ? d.dense_layers == 0 : d.layers == d.dense_layers) continue;
    models::DeepSeekConfig one = d;
    one.layers = 1;
    one.dense_layers = dense ? 1 : 0;
    // Norms, MLA's down-projections and their norms; the MoE router.
    const int64_t mla_whole = d.dim * d.q_lora_rank + d.q_lora_rank + d.dim * (d.kv_lora_rank + d.qk_rope_dim) +
                              d.kv_lora_rank;
    out.push_back(BlockCount{one.num_params() - 2 * d.vocab * d.dim - d.dim,
                             2 * d.dim + mla_whole + (dense ? 0 : d.dim * d.experts),
                             dense ? d.dense_layers : d.layers - d.dense_layers});
  }
  return out;
}
}  // namespace

int64_t ModelSpec::stage_params(const models::PipelineSlice& sl) const {
  const int64_t L = layers(), end = sl.end_layer < 0 ? L : sl.end_layer;
  if (type == "llama") {
    const auto& l = llama;
    // Tied embeddings: the last stage holds a copy of the embedding for its head.
    const int64_t embedding = sl.embedding || (sl.head && l.tie_embeddings) ? l.vocab * l.dim : 0;
    const int64_t head = sl.head ? l.dim + (l.tie_embeddings ? 0 : l.vocab * l.dim) : 0;
    return embedding + (end - sl.first_layer) * l.block_params() + head;
  }
  const auto& d = deepseek;
  int64_t n = (sl.embedding ? d.vocab * d.dim : 0) + (sl.head ? d.dim + d.vocab * d.dim : 0);
  // block_counts lists the dense kind first (when there is one), the MoE kind last.
  const auto kinds = block_counts(*this);
  for (int64_t i = sl.first_layer; i < end; ++i) n += (i < d.dense_layers ? kinds.front() : kinds.back()).total;
  return n;
}

int64_t ModelSpec::params_per_tp_rank(int64_t tp) const {
  if (tp <= 1) return num_params();
  int64_t whole = dim();  // the final norm
  for (const auto& k : block_counts(*this)) whole += k.layers * k.whole;
  return (num_params() - whole) / tp + whole;
}

int64_t ModelSpec::largest_block_params_per_tp_rank(int64_t tp) const {
  if (tp <= 1) return largest_block_params();
  int64_t biggest = 0;
  for (const auto& k : block_counts(*this)) biggest = std::max(biggest, k.per_rank(tp));
  return biggest;
}

namespace {

// One key's value as written, with where it came from.
struct Value {
  std::string key, text, origin;

  template <typename... A>
  [[noreturn]] void fail(const A&... what) const {
    std::ostringstream os;
    os << origin << ": " << key << "=" << text << ": ";
    (os << ... << what);
    throw Error(os.str());
  }
};

// The whole text as one number (std::stoll / std::stod), else an error naming `kind`.
template <typename T>
T parse_whole(const Value& v, T (*parse)(const std::string&, size_t*), const char* kind) {
  size_t used = 0;
  T x{};
  try {
    x = parse(v.text, &used);
  } catch (const std::exception&) {
    v.fail("expected ", kind);
  }
  if (used != v.text.size()) v.fail("expected ", kind);
  return x;
}

int64_t as_int(const Value& v, int64_t min = INT64_MIN, int64_t max = INT64_MAX) {
  const int64_t x = parse_whole<long long>(v, [](const std::string& t, size_t* n) { return std::stoll(t, n); },
                                           "an integer");
  if (x < min) v.fail("must be >= ", min);
  if (x > max) v.fail("must be <= ", max);
  return x;
}

// "[2, 1, 1]" or "2,1,1" (empty: none), each entry an integer in [min, max].
std::vector<int64_t> as_int_list(const Value& v, int64_t min, int64_t max) {
  std::string t = v.text;
  if (!t.empty() && t.front() == '[') {
    if (t.back() != ']') v.fail("expected a list like [2, 1, 1]");
    t = t.substr(1, t.size() - 2);
  }
  std::vector<int64_t> out;
  std::stringstream ss(t);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) v.fail("an empty entry in the list");
    out.push_back(as_int(Value{v.key, item.substr(a, b - a + 1), v.origin}, min, max));
  }
  return out;
}

double as_double(const Value& v) {
  const double x = parse_whole<double>(v, [](const std::string& t, size_t* n) { return std::stod(t, n); }, "a number");
  if (!std::isfinite(x)) v.fail("expected a finite number");
  return x;
}

bool as_bool(const Value& v) {
  if (v.text == "true" || v.text == "True" || v.text == "yes" || v.text == "on") return true;
  if (v.text == "false" || v.text == "False" || v.text == "no" || v.text == "off") return false;
  v.fail("expected true or false");
}

std::string as_choice(const Value& v, const std::vector<std::string>& choices) {
  if (std::find(choices.begin(), choices.end(), v.text) != choices.end()) return v.text;
  std::string all;
  for (auto& c : choices) all += (all.empty() ? "" : ", ") + c;
  v.fail("expected one of: ", all);
}

at::ScalarType as_dtype(const Value& v) {
  static const std::map<std::string, at::ScalarType> names = {
      {"float32", at::kFloat}, {"fp32", at::kFloat},     {"bfloat16", at::kBFloat16},
      {"bf16", at::kBFloat16}, {"float16", at::kHalf}, {"fp16", at::kHalf}};
  auto it = names.find(v.text);
  if (it == names.end()) v.fail("expected float32, bfloat16 or float16");
  return it->second;
}

using Setter = std::function<void(TrainConfig&, const Value&)>;

// Upper bounds that keep every product of sizes far from int64 overflow.
constexpr int64_t kMaxModelInt = int64_t(1) << 31;
constexpr int64_t kMaxRanks = int64_t(1) << 24;
constexpr int64_t kMaxCount = int64_t(1) << 40;

struct Key {
  std::string name, type, def, help;
  Setter set;
  std::string model_type;  // non-empty: a key of that model type only
};

using DS = models::DeepSeekConfig;
using LL = models::LlamaConfig;

// Model fields: of one model type, or (same name) of both.
Key ds_int(const char* name, int64_t DS::*f, int64_t min, const char* help) {
  return {std::string("model.") + name, "int", "preset", help,
          [f, min](TrainConfig& c, const Value& v) { c.model.deepseek.*f = as_int(v, min, kMaxModelInt); }, "deepseek"};
}
Key ll_int(const char* name, int64_t LL::*f, int64_t min, const char* help) {
  return {std::string("model.") + name, "int", "preset", help,
          [f, min](TrainConfig& c, const Value& v) { c.model.llama.*f = as_int(v, min, kMaxModelInt); }, "llama"};
}
Key both_int(const char* name, int64_t DS::*d, int64_t LL::*l, const char* help, int64_t min = 1) {
  return {std::string("model.") + name, "int", "preset", help,
          [d, l, min](TrainConfig& c, const Value& v) {
            c.model.deepseek.*d = c.model.llama.*l = as_int(v, min, kMaxModelInt);
          },
          ""};
}
Key both_double(const char* name, double DS::*d, double LL::*l, const char* help) {
  return {std::string("model.") + name, "float", "preset", help,
          [d, l](TrainConfig& c, const Value& v) {
            double x = as_double(v);
            if (x <= 0) v.fail("must be > 0");
            c.model.deepseek.*d = c.model.llama.*l = x;
          },
          ""};
}

const std::vector<Key>& keys() {
  static const std::vector<Key> k = [] {
    std::vector<Key> k;
    auto top = [&](const char* name, const char* type, const char* def, const char* help, Setter s) {
      k.push_back({name, type, def, help, std::move(s), ""});
    };
    // model: type and preset are applied first, then the fields override the preset.
    top("model.type", "deepseek|llama", "deepseek", "reference model",
        [](TrainConfig& c, const Value& v) { c.model.type = as_choice(v, {"deepseek", "llama"}); });
    top("model.preset", "name", "tiny", "base sizes: tiny; deepseek_v3 (deepseek); llama3_8b (llama)",
        [](TrainConfig& c, const Value& v) {
          if (c.model.type == "deepseek") {
            c.model.preset = as_choice(v, {"tiny", "deepseek_v3"});
            c.model.deepseek = c.model.preset == "tiny" ? DS::tiny() : DS::deepseek_v3();
          } else {
            c.model.preset = as_choice(v, {"tiny", "llama3_8b"});
            c.model.llama = c.model.preset == "tiny" ? LL::tiny() : LL::llama3_8b();
          }
        });
    // One token leaves nothing to predict (the loss is 0 from the start).
    k.push_back(both_int("vocab", &DS::vocab, &LL::vocab, "vocabulary size (at least 2)", 2));
    k.push_back(both_int("dim", &DS::dim, &LL::dim, "hidden size"));
    k.push_back(both_int("layers", &DS::layers, &LL::layers, "transformer blocks"));
    k.push_back(both_int("heads", &DS::heads, &LL::heads, "attention heads"));
    k.push_back(both_int("max_seq", &DS::max_seq, &LL::max_seq, "longest sequence (rotary table)"));
    k.push_back(both_double("rope_theta", &DS::rope_theta, &LL::rope_theta, "rotary base"));
    k.push_back(both_double("norm_eps", &DS::norm_eps, &LL::norm_eps, "RMSNorm epsilon"));
    k.push_back(ll_int("kv_heads", &LL::kv_heads, 1, "grouped-query key/value heads"));
    k.push_back(ll_int("ffn_dim", &LL::ffn_dim, 0, "SwiGLU hidden size (0: 8/3 dim, rounded)"));
    k.push_back({"model.tie_embeddings", "bool", "preset", "output head shares the embedding",
                 [](TrainConfig& c, const Value& v) { c.model.llama.tie_embeddings = as_bool(v); }, "llama"});
    k.push_back(ds_int("dense_layers", &DS::dense_layers, 0, "first blocks with a dense feed-forward"));
    k.push_back(ds_int("q_lora_rank", &DS::q_lora_rank, 1, "MLA query latent rank"));
    k.push_back(ds_int("kv_lora_rank", &DS::kv_lora_rank, 1, "MLA key/value latent rank"));
    k.push_back(ds_int("qk_nope_dim", &DS::qk_nope_dim, 1, "MLA per-head non-rotary query/key dims"));
    k.push_back(ds_int("qk_rope_dim", &DS::qk_rope_dim, 2, "MLA decoupled rotary key dims"));
    k.push_back(ds_int("v_head_dim", &DS::v_head_dim, 1, "MLA per-head value dims"));
    k.push_back(ds_int("dense_hidden", &DS::dense_hidden, 1, "dense feed-forward hidden size"));
    k.push_back(ds_int("experts", &DS::experts, 1, "routed experts per MoE block"));
    k.push_back(ds_int("experts_per_token", &DS::experts_per_token, 1, "routed experts each token uses"));
    k.push_back(ds_int("shared_experts", &DS::shared_experts, 0, "always-on experts"));
    k.push_back(ds_int("expert_hidden", &DS::expert_hidden, 1, "expert hidden size"));
    k.push_back({"model.bias_update_rate", "float", "preset", "balancing-bias step per update",
                 [](TrainConfig& c, const Value& v) {
                   double x = as_double(v);
                   if (x < 0) v.fail("must be >= 0");
                   c.model.deepseek.bias_update_rate = x;
                 },
                 "deepseek"});

    top("data.type", "synthetic|binary|text", "synthetic",
        "synthetic corpus, a file of token ids, or UTF-8 text (byte tokens)",
        [](TrainConfig& c, const Value& v) { c.data.type = as_choice(v, {"synthetic", "binary", "text"}); });
    top("data.path", "path", "", "the binary or text file",
        [](TrainConfig& c, const Value& v) { c.data.path = v.text; });
    top("data.token_dtype", "uint16|uint32", "uint16", "token id width of a binary file",
        [](TrainConfig& c, const Value& v) { c.data.token_dtype = as_choice(v, {"uint16", "uint32"}); });
    top("data.num_samples", "int", "4096", "samples in the synthetic corpus",
        [](TrainConfig& c, const Value& v) { c.data.num_samples = as_int(v, 1, kMaxCount); });
    top("data.shuffle", "bool", "true", "a new sample order each epoch",
        [](TrainConfig& c, const Value& v) { c.data.shuffle = as_bool(v); });

    top("params_dtype", "dtype", "float32", "dtype of the (sharded) parameters",
        [](TrainConfig& c, const Value& v) { c.params_dtype = as_dtype(v); });
    top("compute_dtype", "dtype", "params_dtype", "dtype of forward/backward (the all-gather)",
        [](TrainConfig& c, const Value& v) { c.compute_dtype = as_dtype(v); });
    top("accumulate_allreduce_grads_in_fp32", "bool", "false",
        "reduce gradients in fp32; with low-precision params, fp32 main grads and master weights",
        [](TrainConfig& c, const Value& v) { c.accumulate_allreduce_grads_in_fp32 = as_bool(v); });
    top("apply_grad_on_fp32_main_grad", "bool", "false",
        "reduced gradients accumulate into an fp32 main gradient per shard, which the optimizer steps "
        "with (needs accumulate_allreduce_grads_in_fp32; implied for low-precision params)",
        [](TrainConfig& c, const Value& v) { c.apply_grad_on_fp32_main_grad = as_bool(v); });
    top("data_parallel", "int", "1", "replicas (HSDP dp_replicate)",
        [](TrainConfig& c, const Value& v) { c.data_parallel = as_int(v, 1, kMaxRanks); });
    top("data_parallel_shard", "int", "-1", "ranks a replica is sharded over; -1 = the rest",
        [](TrainConfig& c, const Value& v) {
          c.data_parallel_shard = as_int(v, -1, kMaxRanks);
          if (c.data_parallel_shard == 0) v.fail("must be >= 1 or -1");
        });
    top("data_parallel_shard_strategy", "optim_grads_params|optim_grads", "optim_grads_params",
        "ZeRO-3 (reshard after forward) or ZeRO-2 (keep parameters until backward)",
        [](TrainConfig& c, const Value& v) {
          if (v.text == "optim") v.fail("sharding only the optimizer state (ZeRO-1) is not supported yet");
          c.data_parallel_shard_strategy = as_choice(v, {"optim_grads_params", "optim_grads"});
        });
    top("reshard_after_forward_group_size", "int", "0",
        "with optim_grads_params: after forward keep parameters sharded over groups of this many "
        "data_parallel_shard ranks, gathered within the group for backward; 0 = over all of them",
        [](TrainConfig& c, const Value& v) { c.reshard_after_forward_group_size = as_int(v, 0, kMaxRanks); });
    top("comm_fusion", "bool", "true", "one fused all-gather/reduce-scatter per block",
        [](TrainConfig& c, const Value& v) { c.comm_fusion = as_bool(v); });
    top("wait_per_submodule", "bool", "false",
        "in forward, wait for each of a block's parameters when its layer is called, not for the whole block "
        "at its start (needs comm_fusion false)",
        [](TrainConfig& c, const Value& v) { c.wait_per_submodule = as_bool(v); });
    top("recompute", "none|full|selective", "none",
        "activation checkpointing of every block: full recomputes its activations in backward, "
        "selective keeps its matmul outputs and recomputes the rest",
        [](TrainConfig& c, const Value& v) { c.recompute = as_choice(v, {"none", "full", "selective"}); });
    top("tensor_parallel", "int", "1", "tensor-parallel size (ranks each layer is split over)",
        [](TrainConfig& c, const Value& v) { c.tensor_parallel = as_int(v, 1, kMaxRanks); });
    top("sequence_parallel", "bool", "false", "sequence parallel (needs tensor_parallel > 1)",
        [](TrainConfig& c, const Value& v) { c.sequence_parallel = as_bool(v); });
    top("pipeline_parallel", "int", "1", "pipeline-parallel size (ranks the layers are split over)",
        [](TrainConfig& c, const Value& v) { c.pipeline_parallel = as_int(v, 1, kMaxRanks); });
    top("pipeline_parallel_interleave_num", "int", "1", "stages per pipeline rank (interleaved schedule)",
        [](TrainConfig& c, const Value& v) { c.pipeline_parallel_interleave_num = as_int(v, 1, kMaxRanks); });
    top("pipeline_schedule", "auto|gpipe|1f1b|interleaved|zbh1|zbv", "auto",
        "pipeline schedule; auto = 1f1b, or interleaved with pipeline_parallel_interleave_num > 1; zbh1 = "
        "zero bubble (backward split into input and weight gradients); zbv = zero bubble with 2 stages per rank "
        "in a V (pipeline_parallel_interleave_num 2)",
        [](TrainConfig& c, const Value& v) {
          c.pipeline_schedule = as_choice(v, {"auto", "gpipe", "1f1b", "interleaved", "zbh1", "zbv"});
        });
    top("pipeline_stage_layers", "list", "[] (even)",
        "layers of each pipeline stage, e.g. [2, 1, 1] (pipeline_parallel x interleave entries); empty = even",
        [](TrainConfig& c, const Value& v) { c.pipeline_stage_layers = as_int_list(v, 1, kMaxModelInt); });
    top("micro_batch_num", "int", "1", "micro-batches per step (pipeline micro-batches, or gradient accumulation)",
        [](TrainConfig& c, const Value& v) { c.micro_batch_num = as_int(v, 1, kMaxRanks); });
    top("global_batch_size", "int", "8", "samples per optimizer step, all ranks together",
        [](TrainConfig& c, const Value& v) { c.global_batch_size = as_int(v, 1, kMaxRanks); });
    top("seq_length", "int", "64", "tokens per sample", [](TrainConfig& c, const Value& v) {
      c.seq_length = as_int(v, 1, kMaxModelInt);
    });
    auto nonneg = [](const Value& v) {
      double x = as_double(v);
      if (x < 0) v.fail("must be >= 0");
      return x;
    };
    top("lr", "float", "1e-3", "peak learning rate", [](TrainConfig& c, const Value& v) {
      c.lr = as_double(v);
      if (c.lr <= 0) v.fail("must be > 0");
    });
    top("min_lr", "float", "0", "learning rate at the end of the decay",
        [nonneg](TrainConfig& c, const Value& v) { c.min_lr = nonneg(v); });
    top("lr_warmup_steps", "int", "0", "steps of linear warmup",
        [](TrainConfig& c, const Value& v) { c.lr_warmup_steps = as_int(v, 0, kMaxCount); });
    top("lr_decay_style", "cosine|linear|constant", "cosine", "decay from lr to min_lr after warmup",
        [](TrainConfig& c, const Value& v) { c.lr_decay_style = as_choice(v, {"cosine", "linear", "constant"}); });
    top("weight_decay", "float", "0", "AdamW decoupled weight decay (matrices only)",
        [nonneg](TrainConfig& c, const Value& v) { c.weight_decay = nonneg(v); });
    auto beta = [](const Value& v) {
      double x = as_double(v);
      if (x < 0 || x >= 1) v.fail("must be in [0, 1)");
      return x;
    };
    top("adam_beta1", "float", "0.9", "AdamW beta1", [beta](TrainConfig& c, const Value& v) { c.adam_beta1 = beta(v); });
    top("adam_beta2", "float", "0.95", "AdamW beta2", [beta](TrainConfig& c, const Value& v) { c.adam_beta2 = beta(v); });
    top("adam_eps", "float", "1e-8", "AdamW epsilon", [](TrainConfig& c, const Value& v) {
      c.adam_eps = as_double(v);
      if (c.adam_eps <= 0) v.fail("must be > 0");
    });
    top("clip_grad", "float", "1.0", "global gradient-norm limit; 0 = no clipping",
        [nonneg](TrainConfig& c, const Value& v) { c.clip_grad = nonneg(v); });
    top("train_steps", "int", "20", "optimizer steps", [](TrainConfig& c, const Value& v) {
      c.train_steps = as_int(v, 1, kMaxCount);
    });
    top("seed", "int", "1234", "initialization and data order", [](TrainConfig& c, const Value& v) {
      c.seed = static_cast<uint64_t>(as_int(v, 0));
    });
    top("log_interval", "int", "1", "steps between progress lines", [](TrainConfig& c, const Value& v) {
      c.log_interval = as_int(v, 1, kMaxCount);
    });
    top("output_dir", "path", "hp-train-out", "metrics.jsonl and loss.svg go here; empty = none",
        [](TrainConfig& c, const Value& v) { c.output_dir = v.text; });
    top("save_interval", "int", "0", "save a checkpoint every this many steps and after the last; 0 = never",
        [](TrainConfig& c, const Value& v) { c.save_interval = as_int(v, 0, kMaxModelInt); });
    top("save_dir", "path", "output_dir/checkpoints", "checkpoints go here (step_<k> folders and 'latest')",
        [](TrainConfig& c, const Value& v) { c.save_dir = v.text; });
    top("keep_last_n", "int", "0", "keep only the newest n checkpoints (older ones removed after a save); 0 = all",
        [](TrainConfig& c, const Value& v) { c.keep_last_n = as_int(v, 0, kMaxModelInt); });
    top("async_save", "bool", "false", "write checkpoints in the background (the state is copied first)",
        [](TrainConfig& c, const Value& v) { c.async_save = as_bool(v); });
    top("init_from_hf", "path", "", "start from the weights of this Hugging Face Llama folder instead of the seed",
        [](TrainConfig& c, const Value& v) { c.init_from_hf = v.text; });
    return k;
  }();
  return k;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

const Key& find_key(const Value& v) {
  const Key* best = nullptr;
  size_t best_d = SIZE_MAX;
  for (const Key& k : keys()) {
    if (k.name == v.key) return k;
    size_t d = edit_distance(k.name, v.key);
    if (d < best_d) best_d = d, best = &k;
  }
  std::ostringstream os;
  os << v.origin << ": unknown config key '" << v.key << "'";
  if (best && best_d <= std::max<size_t>(2, v.key.size() / 4)) os << " (did you mean '" << best->name << "'?)";
  os << "; hp-train --list-keys lists them all";
  throw Error(os.str());
}

// Flattens YAML maps into dotted keys (model: {dim: 64} -> model.dim).
void flatten(const YAML::Node& n, const std::string& prefix, const std::string& origin, std::vector<Value>& out) {
  for (const auto& kv : n) {
    if (!kv.first.IsScalar()) {
      throw Error(origin + ": a key under '" + prefix + "' is not a plain name");
    }
    std::string key = prefix + kv.first.Scalar();
    const YAML::Node& v = kv.second;
    if (v.IsMap()) {
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

}  // namespace

TrainConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& source) {
  std::vector<Value> values;
  try {
    std::vector<YAML::Node> docs = YAML::LoadAll(yaml_text);
    if (docs.size() > 1) throw Error(source + ": holds " + std::to_string(docs.size()) + " YAML documents; expected one");
    YAML::Node root = docs.empty() ? YAML::Node() : docs[0];
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

  // Unknown keys first, then the model type and preset, then everything else.
  for (const Value& v : values) find_key(v);
  TrainConfig c;
  // Errors of combinations name the file and, when there are any, the overrides, so that a
  // value that came from --set is not blamed on the file.
  c.source = source;
  for (size_t i = 0; i < overrides.size(); ++i) c.source += (i ? " --set " : " with --set ") + overrides[i];
  for (const Value& v : values) c.given.insert(v.key);
  bool compute_given = false;
  for (const char* first : {"model.type", "model.preset"}) {
    for (const Value& v : values) {
      if (v.key == first) find_key(v).set(c, v);
    }
  }
  for (const Value& v : values) {
    if (v.key == "model.type" || v.key == "model.preset") continue;
    const Key& k = find_key(v);
    if (!k.model_type.empty() && k.model_type != c.model.type) {
      v.fail("a key of model.type ", k.model_type, ", but model.type is ", c.model.type);
    }
    k.set(c, v);
    compute_given |= v.key == "compute_dtype";
  }
  if (!compute_given) c.compute_dtype = c.params_dtype;
  return c;
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  HP_CHECK(std::filesystem::is_regular_file(path, ec), "config file '", path, "' ",
           std::filesystem::exists(path, ec) ? "is not a regular file" : "does not exist");
  std::ifstream f(path);
  HP_CHECK(f.good(), "cannot read config file '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  HP_CHECK(!f.bad(), "reading config file '", path, "' failed");
  // An empty (or comment-only) file is most likely the wrong file: it would train defaults.
  bool has_keys = false;
  try {
    for (const YAML::Node& doc : YAML::LoadAll(ss.str())) has_keys = has_keys || (doc.IsMap() && doc.size() > 0);
  } catch (const YAML::Exception&) {
    has_keys = true;  // parse_config names the YAML error
  }
  HP_CHECK(has_keys, "config file '", path, "' holds no settings (it is empty or only comments); it must be one ",
           "YAML map of keys to values");
  return parse_config(ss.str(), overrides, path);
}

void TrainConfig::validate(int world_size) {
  const std::string& s = source;
  if (save_dir.empty() && !output_dir.empty()) save_dir = output_dir + "/checkpoints";
  HP_CHECK(save_interval == 0 || !save_dir.empty(), s, ": save_interval=", save_interval,
           " needs save_dir (or output_dir, whose checkpoints/ it defaults to)");
  HP_CHECK(init_from_hf.empty() || model.type == "llama", s, ": init_from_hf is not supported yet for model.type=",
           model.type, " (llama only)");
  HP_CHECK(!wait_per_submodule || !comm_fusion, s,
           ": wait_per_submodule=true needs comm_fusion=false (a fused all-gather per block leaves nothing to wait "
           "for per layer)");
  HP_CHECK(!sequence_parallel || tensor_parallel > 1, s,
           ": sequence_parallel=true needs tensor_parallel > 1 (tensor_parallel=", tensor_parallel, ")");
  if (tensor_parallel > 1) {
    try {
      if (model.type == "llama") {
        models::check_tensor_parallel(model.llama, tensor_parallel);
      } else {
        models::check_tensor_parallel(model.deepseek, tensor_parallel);
      }
    } catch (const Error& e) {
      throw Error(detail::str_cat(s, ": ", e.what()));
    }
    HP_CHECK(!sequence_parallel || seq_length % tensor_parallel == 0, s, ": seq_length=", seq_length,
             " is not divisible by tensor_parallel=", tensor_parallel, " (sequence_parallel splits the sequence)");
  }
  const int64_t pp = pipeline_parallel, v = pipeline_parallel_interleave_num;
  HP_CHECK(v == 1 || pp > 1, s, ": pipeline_parallel_interleave_num=", v,
           " needs pipeline_parallel > 1 (pipeline_parallel=", pp, ")");
  if (pipeline_schedule == "auto") pipeline_schedule = v > 1 ? "interleaved" : "1f1b";
  HP_CHECK(pipeline_stage_layers.empty() || pp > 1, s, ": pipeline_stage_layers needs pipeline_parallel > 1 ",
           "(pipeline_parallel=", pp, ")");
  HP_CHECK(v == 1 || pipeline_schedule == "interleaved" || pipeline_schedule == "zbv", s, ": pipeline_schedule=",
           pipeline_schedule, " runs one stage per rank, but pipeline_parallel_interleave_num=", v,
           " (use interleaved or zbv)");
  HP_CHECK(pipeline_schedule != "zbv" || v == 2, s, ": pipeline_schedule=zbv places two stages per rank: it needs ",
           "pipeline_parallel_interleave_num=2, not ", v);
  if (pp > 1) {
    HP_CHECK(pp * v <= model.layers(), s, ": pipeline_parallel=", pp, " x pipeline_parallel_interleave_num=", v,
             " = ", pp * v, " stages, but the model has ", model.layers(),
             " layers (each stage needs at least one: more stages than layers)");
    // Interleaved runs the micro-batches in rounds of m / max(1, m / pp): that must divide.
    const int64_t rounds = std::max<int64_t>(1, micro_batch_num / pp);
    HP_CHECK(pipeline_schedule != "interleaved" || micro_batch_num % rounds == 0, s, ": micro_batch_num=",
             micro_batch_num, " with the interleaved schedule over pipeline_parallel=", pp, " would run in ", rounds,
             " rounds that do not divide it (not supported yet; a multiple of ", pp, " always works)");
    try {
      models::split_layers(model.layers(), static_cast<int>(pp * v), pipeline_stage_layers);
    } catch (const Error& e) {
      throw Error(detail::str_cat(s, ": pipeline_stage_layers: ", e.what()));
    }
    HP_CHECK((pipeline_schedule != "zbh1" && pipeline_schedule != "zbv") || recompute == "none", s,
             ": pipeline_schedule=", pipeline_schedule, " with recompute=", recompute,
             " is not supported yet (the weight gradients are taken from the forward's graph)");
  }
  // Products checked step by step against the world size, so none can overflow.
  auto layout_error = [&] {
    return detail::str_cat(s, ": data_parallel=", data_parallel, " x data_parallel_shard=", data_parallel_shard,
                           " x tensor_parallel=", tensor_parallel, " x pipeline_parallel=", pipeline_parallel,
                           " does not match the world of ", world_size, " ranks");
  };
  int64_t others = 1;
  for (int64_t f : {data_parallel, tensor_parallel, pipeline_parallel}) {
    HP_CHECK(f <= world_size / others, layout_error());
    others *= f;
  }
  if (data_parallel_shard == -1) {
    HP_CHECK(world_size % others == 0, s, ": data_parallel=", data_parallel, " x tensor_parallel=", tensor_parallel,
             " x pipeline_parallel=", pipeline_parallel, " = ", others, " does not divide the world size ", world_size,
             " (so data_parallel_shard=-1 has no value)");
    data_parallel_shard = world_size / others;
  }
  HP_CHECK(data_parallel_shard <= world_size / others && others * data_parallel_shard == world_size, layout_error());
  if (reshard_after_forward_group_size > 0) {
    HP_CHECK(data_parallel_shard_strategy == "optim_grads_params", s, ": reshard_after_forward_group_size=",
             reshard_after_forward_group_size, " needs data_parallel_shard_strategy=optim_grads_params (",
             data_parallel_shard_strategy, " keeps parameters gathered until backward)");
    HP_CHECK(data_parallel_shard % reshard_after_forward_group_size == 0, s, ": reshard_after_forward_group_size=",
             reshard_after_forward_group_size, " does not divide data_parallel_shard=", data_parallel_shard);
  }
  HP_CHECK(!apply_grad_on_fp32_main_grad || accumulate_allreduce_grads_in_fp32, s,
           ": apply_grad_on_fp32_main_grad=true needs accumulate_allreduce_grads_in_fp32=true (an fp32 main gradient ",
           "of a gradient reduced in ", c10::toString(compute_dtype), " would keep only its precision)");
  HP_CHECK(params_dtype != at::kHalf, s, ": params_dtype=float16 is not supported yet (needs loss scaling); use bfloat16");
  HP_CHECK(compute_dtype != at::kHalf, s, ": compute_dtype=float16 is not supported yet (needs loss scaling); use bfloat16");
  HP_CHECK(global_batch_size % micro_batch_num == 0 && (global_batch_size / micro_batch_num) % dp_size() == 0, s, ": global_batch_size=", global_batch_size,
           " must be a multiple of data-parallel ranks (", dp_size(), ") x micro_batch_num (", micro_batch_num, ")");
  HP_CHECK(seq_length <= model.max_seq(), s, ": seq_length=", seq_length, " is longer than model.max_seq=",
           model.max_seq());
  HP_CHECK(min_lr <= lr, s, ": min_lr=", min_lr, " is above lr=", lr);
  HP_CHECK(lr_warmup_steps <= train_steps, s, ": lr_warmup_steps=", lr_warmup_steps, " exceeds train_steps=",
           train_steps);
  if (data.type == "synthetic") {
    HP_CHECK(data.path.empty(), s, ": data.path='", data.path, "' is only read when data.type is binary or text");
  } else {
    HP_CHECK(!data.path.empty(), s, ": data.type=", data.type, " needs data.path");
    HP_CHECK(!given.count("data.num_samples"), s, ": data.num_samples=", data.num_samples,
             " is only read for synthetic data (a file's samples are its tokens / seq_length)");
  }
  HP_CHECK(data.type == "binary" || !given.count("data.token_dtype"), s, ": data.token_dtype=", data.token_dtype,
           " is only read when data.type is binary");
  HP_CHECK(data.type != "text" || model.vocab() >= 256, s, ": data.type=text uses byte tokens 0..255 but model.vocab=",
           model.vocab());
  try {
    if (model.type == "llama") {
      model.llama.validate();
    } else {
      model.deepseek.validate();
    }
  } catch (const Error& e) {
    throw Error(s + ": model: " + e.what());
  }
}

std::vector<KeyInfo> config_keys() {
  std::vector<KeyInfo> out;
  for (const Key& k : keys()) {
    std::string help = k.help;
    if (!k.model_type.empty()) help += " [" + k.model_type + "]";
    out.push_back({k.name, k.type, k.def, help});
  }
  return out;
}

MixedPrecisionPolicy mixed_precision(const TrainConfig& c) {
  MixedPrecisionPolicy p;
  if (c.compute_dtype != c.params_dtype) p.param_dtype = c.compute_dtype;
  if (c.accumulate_allreduce_grads_in_fp32) p.reduce_dtype = at::kFloat;
  p.apply_grad_on_fp32_main_grad = c.fp32_master() || c.apply_grad_on_fp32_main_grad;
  return p;
}

std::vector<std::pair<std::string, std::string>> resolved_settings(const TrainConfig& c) {
  std::vector<std::pair<std::string, std::string>> out;
  auto add = [&](const char* key, const auto& v) {
    std::ostringstream os;
    os.precision(17);
    os << v;
    out.emplace_back(key, os.str());
  };
  add("model.type", c.model.type);
  add("model.preset", c.model.preset);
  if (c.model.type == "llama") {
    const auto& m = c.model.llama;
    add("model.vocab", m.vocab), add("model.dim", m.dim), add("model.layers", m.layers), add("model.heads", m.heads);
    add("model.kv_heads", m.kv_heads), add("model.ffn_dim", m.ffn_dim), add("model.max_seq", m.max_seq);
    add("model.rope_theta", m.rope_theta), add("model.norm_eps", m.norm_eps), add("model.tie_embeddings", m.tie_embeddings);
  } else {
    const auto& m = c.model.deepseek;
    add("model.vocab", m.vocab), add("model.dim", m.dim), add("model.layers", m.layers);
    add("model.dense_layers", m.dense_layers), add("model.heads", m.heads), add("model.q_lora_rank", m.q_lora_rank);
    add("model.kv_lora_rank", m.kv_lora_rank), add("model.qk_nope_dim", m.qk_nope_dim);
    add("model.qk_rope_dim", m.qk_rope_dim), add("model.v_head_dim", m.v_head_dim);
    add("model.dense_hidden", m.dense_hidden), add("model.experts", m.experts);
    add("model.experts_per_token", m.experts_per_token), add("model.shared_experts", m.shared_experts);
    add("model.expert_hidden", m.expert_hidden), add("model.bias_update_rate", m.bias_update_rate);
    add("model.max_seq", m.max_seq), add("model.rope_theta", m.rope_theta), add("model.norm_eps", m.norm_eps);
  }
  add("data.type", c.data.type), add("data.path", c.data.path), add("data.token_dtype", c.data.token_dtype);
  add("data.num_samples", c.data.num_samples), add("data.shuffle", c.data.shuffle);
  add("params_dtype", c10::toString(c.params_dtype)), add("compute_dtype", c10::toString(c.compute_dtype));
  add("accumulate_allreduce_grads_in_fp32", c.accumulate_allreduce_grads_in_fp32);
  add("apply_grad_on_fp32_main_grad", c.apply_grad_on_fp32_main_grad);
  add("data_parallel", c.data_parallel), add("data_parallel_shard", c.data_parallel_shard);
  add("data_parallel_shard_strategy", c.data_parallel_shard_strategy);
  add("reshard_after_forward_group_size", c.reshard_after_forward_group_size);
  add("comm_fusion", c.comm_fusion), add("wait_per_submodule", c.wait_per_submodule);
  add("recompute", c.recompute);
  add("tensor_parallel", c.tensor_parallel), add("sequence_parallel", c.sequence_parallel);
  add("pipeline_parallel", c.pipeline_parallel), add("pipeline_parallel_interleave_num", c.pipeline_parallel_interleave_num);
  add("pipeline_schedule", c.pipeline_schedule);
  {
    std::string l;
    for (int64_t n : c.pipeline_stage_layers) l += (l.empty() ? "" : ",") + std::to_string(n);
    add("pipeline_stage_layers", "[" + l + "]");
  }
  add("micro_batch_num", c.micro_batch_num), add("global_batch_size", c.global_batch_size);
  add("seq_length", c.seq_length), add("lr", c.lr), add("min_lr", c.min_lr), add("lr_warmup_steps", c.lr_warmup_steps);
  add("lr_decay_style", c.lr_decay_style), add("weight_decay", c.weight_decay), add("adam_beta1", c.adam_beta1);
  add("adam_beta2", c.adam_beta2), add("adam_eps", c.adam_eps), add("clip_grad", c.clip_grad);
  add("train_steps", c.train_steps), add("seed", c.seed), add("log_interval", c.log_interval);
  add("output_dir", c.output_dir);
  add("save_interval", c.save_interval), add("save_dir", c.save_dir), add("keep_last_n", c.keep_last_n);
  add("async_save", c.async_save), add("init_from_hf", c.init_from_hf);
  return out;
}

std::string describe(const TrainConfig& c) {
  std::ostringstream os;
  os << "model " << c.model.type << " (" << c.model.preset << " preset, " << c.model.num_params()
     << " parameters); data " << c.data.type << (c.data.path.empty() ? "" : " " + c.data.path) << "\n";
  os << "layout: data_parallel " << c.data_parallel << " x data_parallel_shard " << c.data_parallel_shard
     << (c.tensor_parallel > 1 ? detail::str_cat(" x tensor_parallel ", c.tensor_parallel) : std::string())
     << (c.pipeline_parallel > 1 ? detail::str_cat(" x pipeline_parallel ", c.pipeline_parallel) : std::string())
     << (c.data_parallel > 1 ? " (HSDP" : " (FSDP")
     << (c.tensor_parallel > 1 ? detail::str_cat(" + TP, sequence_parallel ", c.sequence_parallel ? "on" : "off",
                                                 ", loss parallel)")
                               : std::string(")"))
     << ", " << c.data_parallel_shard_strategy
     << (c.reshard_after_forward_group_size > 1
             ? detail::str_cat(" (resharded to groups of ", c.reshard_after_forward_group_size, " after forward)")
             : c.reshard_after_forward_group_size == 1 ? std::string(" (group of 1: kept gathered after forward)")
                                                       : std::string())
     << (c.pipeline_parallel > 1
             ? detail::str_cat(", pipeline ", c.pipeline_schedule, " with ", c.pipeline_parallel * c.pipeline_parallel_interleave_num,
                               " stages (", c.pipeline_parallel_interleave_num, " per rank) x ", c.micro_batch_num,
                               " micro-batches")
             : std::string())
     << ", comm_fusion " << (c.comm_fusion ? "on" : "off") << (c.wait_per_submodule ? ", wait per submodule" : "")
     << (c.recompute == "none" ? std::string() : ", recompute " + c.recompute) << "\n";
  const GroupDtypes d = resolve_dtypes(mixed_precision(c), c.params_dtype);
  os << "dtypes: params " << c10::toString(d.param) << ", compute " << c10::toString(d.compute)
     << ", gradient reduction " << c10::toString(d.reduce)
     << (d.main_grad ? ", fp32 main grads" : "") << (c.fp32_master() ? " and master weights" : "") << "\n";
  os << "batch: " << c.global_batch_size << " samples x " << c.seq_length << " tokens, " << c.micro_batch_num
     << " micro-batch(es) of " << c.micro_batch_size() << " per rank; " << c.train_steps << " steps, lr " << c.lr
     << " (" << c.lr_warmup_steps << " warmup, " << c.lr_decay_style << " to " << c.min_lr << "), clip_grad "
     << c.clip_grad << ", weight_decay " << c.weight_decay;
  return os.str();
}

}  // namespace hp::train
