// DeepSeek-V3 behind the model-family seam.
#include "family_util.h"
#include "hp/attn/attention.h"
#include "hp/models/deepseek.h"

namespace hp::models {

namespace {

// The model, with its multi-token prediction modules: fully_shard units after the blocks,
// trained from the targets, their loss kept for the metrics.
class DeepSeekModel : public detail::MoEModelOf<DeepSeek> {
 public:
  using MoEModelOf::MoEModelOf;
  std::vector<torch::nn::Module*> blocks() override {
    std::vector<torch::nn::Module*> out = MoEModelOf::blocks();
    for (auto& m : m_->mtp) out.push_back(m.get());
    return out;
  }
  void set_loss_scale(double scale) override {
    MoEModelOf::set_loss_scale(scale);
    m_->loss_scale = scale;
  }
  void set_targets(const at::Tensor& targets) override { m_->set_targets(targets); }
  LossSum take_mtp_loss() override {
    const auto [sum, count] = m_->take_mtp_loss();
    return {sum, count};
  }
};

class DeepSeekArgs : public detail::ReferenceArgs<DeepSeekArgs, DeepSeekConfig, DeepSeek, DeepSeekModel> {
 public:
  using ReferenceArgs::ReferenceArgs;

  int64_t ffn_hidden() const override { return config.dense_hidden; }
  int64_t largest_block_params() const override { return config.largest_block_params(); }

  int64_t stage_params(const PipelineSlice& sl) const override {
    const DeepSeekConfig& d = config;
    const int64_t end = check_slice(sl, d.layers);
    int64_t n = (sl.embedding ? d.vocab * d.dim : 0) + (sl.head ? d.dim + d.vocab * d.dim : 0);
    // The head's stage holds the multi-token prediction modules and, unless it is also the
    // first, its own copy of the embedding (tied_parameters).
    if (sl.head) n += d.mtp_layers * d.mtp_module_params() + (sl.embedding || d.mtp_layers == 0 ? 0 : d.vocab * d.dim);
    // kinds() lists the dense kind first (when there is one), the MoE kind last.
    const auto k = kinds();
    for (int64_t i = sl.first_layer; i < end; ++i) n += (i < d.dense_layers ? k.front() : k.back()).total;
    return n;
  }
  std::string whole_under_tp() const override { return "norms, MLA down-projections and routers"; }
  // MLA's two down-projections and their norms, the router of a MoE block, and under
  // sequence parallelism the block's two norms. kinds() lists the MoE kind last.
  SummedParams tp_summed_params(bool sequence_parallel) const override {
    const int64_t whole = kinds().back().whole, norms = 2 * config.dim;
    const bool moe = config.layers > config.dense_layers;
    if (sequence_parallel) return {4 + (moe ? 1 : 0) + 2, whole};
    return {4 + (moe ? 1 : 0), whole - norms};
  }

  // The matmuls of the active parameters (the routed experts a token does not use left out)
  // and attention's two products over the sequence.
  FlopCount flops_per_token(int64_t seq_length) const override {
    const DeepSeekConfig& d = config;
    const double T = static_cast<double>(seq_length);
    const double idle_experts =
        static_cast<double>(d.experts - d.experts_per_token) * 3.0 * static_cast<double>(d.dim * d.expert_hidden);
    const double active = static_cast<double>(d.largest_block_params()) - (d.layers > d.dense_layers ? idle_experts : 0);
    FlopCount f;
    // Attention: a product of qk and one of v_head_dim per score, over the scores the causal
    // tiles compute.
    f.block = 2.0 * active + 2.0 * attn::causal_score_elements(seq_length, d.attention_tile) / T *
                                 static_cast<double>(d.heads * (d.qk_nope_dim + d.qk_rope_dim + d.v_head_dim));
    f.head = 2.0 * static_cast<double>(d.vocab * d.dim);
    if (d.layers > d.dense_layers) {
      const double expert = 2.0 * 3.0 * static_cast<double>(d.dim * d.expert_hidden);
      f.routed = expert * static_cast<double>(d.experts_per_token);
      f.shared = expert * static_cast<double>(d.shared_experts);
    }
    // A multi-token prediction module runs after the head: eh_proj, a MoE block, the head
    // again (on T-1 positions of T: counted per position as the others).
    if (d.mtp_layers > 0) {
      DeepSeekConfig moe = d;
      moe.dense_layers = 0;
      const double moe_active = static_cast<double>(moe.largest_block_params()) - idle_experts;
      const double moe_block = f.block - 2.0 * active + 2.0 * moe_active;
      f.head += static_cast<double>(d.mtp_layers) * (moe_block + 2.0 * static_cast<double>(2 * d.dim * d.dim) + f.head);
    }
    // Light recompute runs the up-projections again (wq_b, wkv_b).
    f.light_recompute = 2.0 * static_cast<double>(d.heads) *
                        static_cast<double>(d.q_lora_rank * (d.qk_nope_dim + d.qk_rope_dim) +
                                            d.kv_lora_rank * (d.qk_nope_dim + d.v_head_dim));
    return f;
  }
  // As Llama's, with MLA's latents and per-head query/key/value widths, and the hidden
  // products of the experts a token runs.
  ActivationCount activations_per_token(int64_t seq_length) const override {
    const DeepSeekConfig& d = config;
    const double hidden = d.layers > d.dense_layers
                              ? static_cast<double>(d.expert_hidden * (d.experts_per_token + d.shared_experts))
                              : static_cast<double>(d.dense_hidden);
    ActivationCount a;
    a.block = 6.0 * static_cast<double>(d.dim) +
              static_cast<double>(d.heads * (2 * (d.qk_nope_dim + d.qk_rope_dim) + d.v_head_dim)) +
              static_cast<double>(d.q_lora_rank + d.kv_lora_rank) + 4.0 * hidden + static_cast<double>(d.heads);
    a.head = static_cast<double>(d.vocab);
    // A multi-token prediction module keeps a MoE block's, eh_proj's input (2 dim) and
    // output, the norms' outputs, and its logits.
    if (d.mtp_layers > 0) {
      const double moe_hidden = static_cast<double>(d.expert_hidden * (d.experts_per_token + d.shared_experts));
      const double moe_block = a.block - 4.0 * hidden + 4.0 * moe_hidden;
      a.head += static_cast<double>(d.mtp_layers) * (moe_block + 5.0 * static_cast<double>(d.dim) + a.head);
    }
    a.attention = static_cast<double>(d.heads);
    a.attention_workspace = static_cast<double>(d.heads) * attn::tile_workspace_elements(seq_length, d.attention_tile);
    // Light recompute: the block's input; wq_a, wkv_a and wo's outputs; attention's output
    // and log-sum-exps; the feed-forward's Linear outputs: a MoE's router scores, w1, w3 and
    // w2 of each routed expert a token uses and of the shared experts, or the dense MLP's.
    const double dim = static_cast<double>(d.dim);
    const double ffn = d.layers > d.dense_layers
                           ? static_cast<double>(d.experts) +
                                 static_cast<double>(d.experts_per_token) *
                                     (2.0 * static_cast<double>(d.expert_hidden) + dim) +
                                 2.0 * static_cast<double>(d.shared_experts * d.expert_hidden) + dim
                           : 2.0 * static_cast<double>(d.dense_hidden) + dim;
    a.light = dim + static_cast<double>(d.q_lora_rank + d.kv_lora_rank + d.qk_rope_dim) + dim +
              static_cast<double>(d.heads * (d.v_head_dim + 1)) + ffn;
    return a;
  }
  // Under context parallelism MLA exchanges the decompressed per-head keys and values.
  AttentionWidths attention_widths() const override {
    const DeepSeekConfig& d = config;
    const double qk = static_cast<double>(d.qk_nope_dim + d.qk_rope_dim), v = static_cast<double>(d.v_head_dim);
    const double h = static_cast<double>(d.heads);
    return {h * (qk + v), h * (qk + v), d.heads, d.heads};
  }

  // Keeps a dense first block and MoE blocks after it, where the model has those kinds.
  void set_layers(int64_t layers) override {
    DeepSeekConfig& d = config;
    const bool any_moe = d.layers > d.dense_layers;
    const bool any_dense = d.dense_layers > 0;
    d.layers = layers;
    d.dense_layers = any_moe ? (any_dense ? 1 : 0) : layers;
  }
  int64_t routed_experts() const override { return config.layers > config.dense_layers ? config.experts : 0; }
  int64_t stage_expert_params(const PipelineSlice& sl) const override {
    const int64_t end = check_slice(sl, config.layers);
    const int64_t moe = std::max<int64_t>(0, end - std::max(sl.first_layer, config.dense_layers));
    return moe * block_expert_params();
  }
  // Each routed expert a SwiGLU without biases: three dim x expert_hidden matrices.
  int64_t block_expert_params() const override {
    return routed_experts() * 3 * config.dim * config.expert_hidden;
  }
  int64_t experts_per_token() const override { return routed_experts() > 0 ? config.experts_per_token : 0; }
  int64_t block_shared_expert_params() const override {
    return routed_experts() > 0 ? config.shared_experts * 3 * config.dim * config.expert_hidden : 0;
  }
  int64_t largest_block_params_outside_experts() const override {
    // kinds() lists the MoE kind last, when the model has one.
    const auto k = kinds();
    int64_t out = 0;
    for (size_t i = 0; i < k.size(); ++i) {
      const bool moe = i + 1 == k.size() && routed_experts() > 0;
      out = std::max(out, k[i].total - (moe ? block_expert_params() : 0));
    }
    return out;
  }

  int64_t mtp_layers() const override { return config.mtp_layers; }
  void set_mtp_layers(int64_t n) override { config.mtp_layers = n; }
  // The head's stage embeds the next tokens for multi-token prediction: a pipeline's last
  // stage holds a copy of the embedding.
  std::vector<std::string> tied_parameters() const override {
    if (config.mtp_layers > 0) return {"tok_emb.weight"};
    return {};
  }

  // DeepSeek-V3's multi-token prediction modules are stored as the blocks after the last
  // (model.layers.61 for 61 blocks); those past this model's own are unbuilt ones.
  bool hf_unbuilt_mtp(const std::string& theirs) const override {
    const std::string prefix = "model.layers.";
    if (theirs.compare(0, prefix.size(), prefix) != 0) return false;
    const size_t end = theirs.find('.', prefix.size());
    const std::string index = theirs.substr(prefix.size(), end == std::string::npos ? end : end - prefix.size());
    if (index.empty() || index.size() > 9 || index.find_first_not_of("0123456789") != std::string::npos) return false;
    return std::stoll(index) >= config.layers + config.mtp_layers;
  }

  // Per kind of block (dense, MoE): its parameters, and those kept whole under tensor
  // parallelism: the norms, MLA's down-projections and their norms, the MoE router.
  std::vector<detail::BlockKind> kinds() const {
    const DeepSeekConfig& d = config;
    std::vector<detail::BlockKind> out;
    for (bool dense : {true, false}) {
      if (dense ? d.dense_layers == 0 : d.layers == d.dense_layers) continue;
      DeepSeekConfig one = d;
      one.layers = 1;
      one.dense_layers = dense ? 1 : 0;
      one.mtp_layers = 0;
      const int64_t mla_whole =
          d.dim * d.q_lora_rank + d.q_lora_rank + d.dim * (d.kv_lora_rank + d.qk_rope_dim) + d.kv_lora_rank;
      out.push_back(detail::BlockKind{one.num_params() - 2 * d.vocab * d.dim - d.dim,
                                      2 * d.dim + mla_whole + (dense ? 0 : d.dim * d.experts),
                                      dense ? d.dense_layers : d.layers - d.dense_layers});
    }
    return out;
  }
};

class DeepSeekFamily : public ModelFamily {
 public:
  std::string name() const override { return "deepseek"; }
  std::vector<std::string> presets() const override { return {"tiny", "deepseek_v3"}; }
  std::unique_ptr<ModelArgs> preset(const std::string& name) const override {
    if (name == "tiny") return std::make_unique<DeepSeekArgs>(*this, DeepSeekConfig::tiny());
    HP_CHECK(name == "deepseek_v3", "model preset '", name, "' is not one of deepseek's: tiny, deepseek_v3");
    return std::make_unique<DeepSeekArgs>(*this, DeepSeekConfig::deepseek_v3());
  }
  std::vector<std::string> hf_model_types() const override { return {"deepseek_v3"}; }
  std::unique_ptr<ModelArgs> from_hf_config(const std::string& text, const std::string& path) const override {
    return std::make_unique<DeepSeekArgs>(*this, deepseek_config_from_hf(text, path));
  }
  const std::vector<ModelKey>& keys() const override {
    using D = DeepSeekConfig;
    static const std::vector<ModelKey> k = {
        int_key<D>("vocab", &D::vocab, 2, "vocabulary size (at least 2)"),
        int_key<D>("dim", &D::dim, 1, "hidden size"),
        int_key<D>("layers", &D::layers, 1, "transformer blocks"),
        int_key<D>("heads", &D::heads, 1, "attention heads"),
        int_key<D>("max_seq", &D::max_seq, 1, "longest sequence (rotary table)"),
        on_resume(int_key<D>("attention_tile", &D::attention_tile, 1,
                             "attention's tile: queries and keys in tiles of this many positions (no S x S scores)"),
                  ResumeRule::kFree),
        float_key<D>("rope_theta", &D::rope_theta, 0, true, "rotary base"),
        float_key<D>("norm_eps", &D::norm_eps, 0, true, "RMSNorm epsilon"),
        int_key<D>("dense_layers", &D::dense_layers, 0, "first blocks with a dense feed-forward"),
        int_key<D>("q_lora_rank", &D::q_lora_rank, 1, "MLA query latent rank"),
        int_key<D>("kv_lora_rank", &D::kv_lora_rank, 1, "MLA key/value latent rank"),
        int_key<D>("qk_nope_dim", &D::qk_nope_dim, 1, "MLA per-head non-rotary query/key dims"),
        int_key<D>("qk_rope_dim", &D::qk_rope_dim, 2, "MLA decoupled rotary key dims"),
        int_key<D>("v_head_dim", &D::v_head_dim, 1, "MLA per-head value dims"),
        int_key<D>("dense_hidden", &D::dense_hidden, 1, "dense feed-forward hidden size"),
        int_key<D>("experts", &D::experts, 1, "routed experts per MoE block"),
        int_key<D>("experts_per_token", &D::experts_per_token, 1, "routed experts each token uses"),
        int_key<D>("shared_experts", &D::shared_experts, 0, "always-on experts"),
        int_key<D>("expert_hidden", &D::expert_hidden, 1, "expert hidden size"),
        int_key<D>("expert_groups", &D::expert_groups, 1, "groups of consecutive experts for group-limited routing"),
        int_key<D>("groups_per_token", &D::groups_per_token, 1,
                   "groups a token's experts come from (its best by their two top scores; = expert_groups: no limit)"),
        float_key<D>("routed_scale", &D::routed_scale, 0, true, "routing weights' factor after normalizing"),
        // How the routing is steered and limited, not what the weights are: a resume may
        // change them when told to.
        on_resume(float_key<D>("bias_update_rate", &D::bias_update_rate, 0, false, "balancing-bias step per update"),
                  ResumeRule::kTrajectory),
        on_resume(float_key<D>("aux_loss_coeff", &D::aux_loss_coeff, 0, false,
                               "weight of the sequence-wise balance loss (0: none)"),
                  ResumeRule::kTrajectory),
        int_key<D>("mtp_layers", &D::mtp_layers, 0,
                   "multi-token prediction modules after the last block (0 or 1; DeepSeek-V3 publishes 1)"),
        on_resume(float_key<D>("mtp_loss_scale", &D::mtp_loss_scale, 0, false,
                               "weight of the multi-token prediction loss in the gradient (DeepSeek-V3: 0.3, then 0.1)"),
                  ResumeRule::kTrajectory),
    };
    static const std::vector<ModelKey> all = [] {
      std::vector<ModelKey> v = k;
      for (ModelKey& c : detail::capacity_keys<D>()) v.push_back(std::move(c));
      for (ModelKey& r : detail::rope_keys<D>()) v.push_back(std::move(r));
      return v;
    }();
    return all;
  }
};

}  // namespace

std::shared_ptr<const ModelFamily> deepseek_family() {
  static const auto f = std::make_shared<DeepSeekFamily>();
  return f;
}

}  // namespace hp::models
