// Llama behind the model-family seam.
#include "family_util.h"
#include "hp/attn/attention.h"
#include "hp/models/llama.h"

namespace hp::models {

namespace {

class LlamaArgs : public detail::ReferenceArgs<LlamaArgs, LlamaConfig, Llama> {
 public:
  using ReferenceArgs::ReferenceArgs;

  int64_t ffn_hidden() const override { return config.hidden_dim(); }
  int64_t largest_block_params() const override { return config.block_params(); }

  int64_t stage_params(const PipelineSlice& sl) const override {
    const LlamaConfig& l = config;
    const int64_t end = check_slice(sl, l.layers);
    // Tied embeddings: the last stage holds a copy of the embedding for its head.
    const int64_t embedding = sl.embedding || (sl.head && l.tie_embeddings) ? l.vocab * l.dim : 0;
    const int64_t head = sl.head ? l.dim + (l.tie_embeddings ? 0 : l.vocab * l.dim) : 0;
    return embedding + (end - sl.first_layer) * l.block_params() + head;
  }
  std::string whole_under_tp() const override { return "norms"; }
  // Without sequence parallelism the norms and row biases see whole activations: their
  // gradients are whole on every rank.
  SummedParams tp_summed_params(bool sequence_parallel) const override {
    if (!sequence_parallel) return {};
    return {2 + (config.attention_bias ? 1 : 0) + (config.mlp_bias ? 1 : 0), kinds().front().whole};
  }

  FlopCount flops_per_token(int64_t seq_length) const override {
    const LlamaConfig& l = config;
    const double T = static_cast<double>(seq_length);
    FlopCount f;
    // Attention: two products of head_dim per score, over the scores the causal tiles compute.
    f.block = 2.0 * static_cast<double>(l.block_params()) +
              4.0 * attn::causal_score_elements(seq_length, l.attention_tile) / T * static_cast<double>(l.heads) *
                  static_cast<double>(l.head_dim());
    f.head = 2.0 * static_cast<double>(l.vocab * l.dim);
    return f;
  }
  // The norms' inputs and outputs, q, k, v, attention's log-sum-exp (one per head) and
  // output, the MLP's four hidden-size products; the head's logits. Attention's tiles while
  // they compute.
  ActivationCount activations_per_token(int64_t seq_length) const override {
    const LlamaConfig& l = config;
    const double kv = static_cast<double>(l.kv_heads * l.head_dim());
    ActivationCount a;
    a.block = 6.0 * static_cast<double>(l.dim) + 2.0 * kv + 4.0 * static_cast<double>(l.hidden_dim()) +
              static_cast<double>(l.heads);
    a.head = static_cast<double>(l.vocab);
    a.attention = static_cast<double>(l.heads);
    a.attention_workspace = static_cast<double>(l.heads) * attn::tile_workspace_elements(seq_length, l.attention_tile);
    // Light recompute: the block's input; wq, wk, wv, wo, w1, w3 and w2's outputs;
    // attention's output and log-sum-exps.
    const double q = static_cast<double>(l.heads * l.head_dim()), d = static_cast<double>(l.dim);
    a.light = d + q + 2.0 * kv + d + 2.0 * static_cast<double>(l.hidden_dim()) + d + q + static_cast<double>(l.heads);
    return a;
  }
  AttentionWidths attention_widths() const override {
    const LlamaConfig& l = config;
    return {2.0 * static_cast<double>(l.kv_heads * l.head_dim()), 2.0 * static_cast<double>(l.heads * l.head_dim()),
            l.heads, l.kv_heads};
  }

  std::vector<std::string> tied_parameters() const override {
    if (config.tie_embeddings) return {"tok_emb.weight"};
    return {};
  }

  // A tied model's folder may still hold lm_head.weight; transformers ties it to the
  // embedding all the same.
  bool hf_ignores(const std::string& theirs) const override {
    return ModelArgs::hf_ignores(theirs) || (config.tie_embeddings && theirs == "lm_head.weight");
  }

  // The one kind of block (ReferenceArgs reads it).
  std::vector<detail::BlockKind> kinds() const {
    // Whole under tensor parallelism: the two norms, and the row-parallel projections' biases.
    const int64_t whole = 2 * config.dim + (config.attention_bias ? config.dim : 0) + (config.mlp_bias ? config.dim : 0);
    return {detail::BlockKind{config.block_params(), whole, config.layers}};
  }
};

class LlamaFamily : public ModelFamily {
 public:
  std::string name() const override { return "llama"; }
  std::vector<std::string> presets() const override { return {"tiny", "llama3_8b"}; }
  std::unique_ptr<ModelArgs> preset(const std::string& name) const override {
    if (name == "tiny") return std::make_unique<LlamaArgs>(*this, LlamaConfig::tiny());
    HP_CHECK(name == "llama3_8b", "model preset '", name, "' is not one of llama's: tiny, llama3_8b");
    return std::make_unique<LlamaArgs>(*this, LlamaConfig::llama3_8b());
  }
  // Qwen2 is a Llama with biases on the query, key and value projections (qkv_bias).
  std::vector<std::string> hf_model_types() const override { return {"llama", "qwen2"}; }
  std::unique_ptr<ModelArgs> from_hf_config(const std::string& text, const std::string& path) const override {
    return std::make_unique<LlamaArgs>(*this, llama_config_from_hf(text, path));
  }
  const std::vector<ModelKey>& keys() const override {
    using L = LlamaConfig;
    // One token leaves nothing to predict (the loss is 0 from the start): vocab >= 2.
    static const std::vector<ModelKey> k = {
        int_key<L>("vocab", &L::vocab, 2, "vocabulary size (at least 2)"),
        int_key<L>("dim", &L::dim, 1, "hidden size"),
        int_key<L>("layers", &L::layers, 1, "transformer blocks"),
        int_key<L>("heads", &L::heads, 1, "attention heads"),
        int_key<L>("max_seq", &L::max_seq, 1, "longest sequence (rotary table)"),
        on_resume(int_key<L>("attention_tile", &L::attention_tile, 1,
                             "attention's tile: queries and keys in tiles of this many positions (no S x S scores)"),
                  ResumeRule::kFree),
        float_key<L>("rope_theta", &L::rope_theta, 0, true, "rotary base"),
        float_key<L>("norm_eps", &L::norm_eps, 0, true, "RMSNorm epsilon"),
        int_key<L>("kv_heads", &L::kv_heads, 1, "grouped-query key/value heads"),
        int_key<L>("ffn_dim", &L::ffn_dim, 0, "SwiGLU hidden size (0: 8/3 dim, rounded)"),
        bool_key<L>("tie_embeddings", &L::tie_embeddings, "output head shares the embedding"),
        int_key<L>("head_dim", &L::explicit_head_dim, 0, "attention head size (0: dim / heads)"),
        bool_key<L>("attention_bias", &L::attention_bias, "biases on the query, key, value and output projections"),
        bool_key<L>("mlp_bias", &L::mlp_bias, "biases on the MLP's three projections"),
        bool_key<L>("qkv_bias", &L::qkv_bias,
                    "biases on the query, key and value projections only (Qwen2; exported as Qwen2ForCausalLM)"),
    };
    static const std::vector<ModelKey> all = [] {
      std::vector<ModelKey> v = k;
      for (ModelKey& r : detail::rope_keys<L>()) v.push_back(std::move(r));
      return v;
    }();
    return all;
  }
};

}  // namespace

std::shared_ptr<const ModelFamily> llama_family() {
  static const auto f = std::make_shared<LlamaFamily>();
  return f;
}

}  // namespace hp::models
