// DeepSeek-V3-style decoder: Multi-head Latent Attention and a mixture-of-experts
// feed-forward, as far as training needs them (no KV cache).
//
// MLA: queries come from a low-rank latent (W_dq, RMSNorm, W_uq); keys and values from a
// compressed latent (W_dkv, RMSNorm, W_ukv) plus one decoupled rotary key shared by all
// heads. MoE: sigmoid affinity scores; each token picks its top-k routed experts by score
// plus a per-expert balancing bias (the bias only selects; weights are the chosen scores
// normalized to sum 1, times routed_scale), optionally within the token's best groups of
// experts; shared experts always run. The bias is a buffer updated from
// expert load after each step (update_balancing_bias), never by gradient. The first
// `dense_layers` layers use a dense SwiGLU instead of the MoE. The routed rows reach their
// experts through a token dispatcher (hp/ep/dispatch.h): on this rank by default, over an
// expert-parallel group after expert_parallel().
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include "hp/comm/communicator.h"
#include "hp/ep/dispatch.h"
#include "hp/models/llama.h"

namespace hp::models {

// Which of an expert's routed slots a capacity limit keeps: the highest router scores, or
// the first tokens in order.
enum class DropPolicy { kProbs, kPosition };

// How a router turns its logits into the scores it ranks experts by: each on its own
// (sigmoid: DeepSeek-V3), or over all experts (softmax: Qwen3-MoE, Mixtral); in fp32.
enum class RouterScore { kSigmoid, kSoftmax };

struct DeepSeekConfig {
  int64_t vocab = 256;
  int64_t dim = 64;
  int64_t layers = 3;
  int64_t dense_layers = 1;
  int64_t heads = 4;
  int64_t q_lora_rank = 32;
  int64_t kv_lora_rank = 24;
  int64_t qk_nope_dim = 16;
  int64_t qk_rope_dim = 8;
  int64_t v_head_dim = 16;
  int64_t dense_hidden = 128;
  int64_t experts = 8;
  int64_t experts_per_token = 2;
  int64_t shared_experts = 1;
  int64_t expert_hidden = 32;
  // Group-limited routing (DeepSeek-V3's node-limited routing): the experts form
  // expert_groups equal groups of consecutive ids; a token ranks the groups by the sum of
  // each group's two highest scores plus bias and picks its k experts within its best
  // groups_per_token groups. 1 and 1: no limit.
  int64_t expert_groups = 1;
  int64_t groups_per_token = 1;
  // The routing weights (the chosen scores normalized to sum 1) are multiplied by this
  // (DeepSeek-V3: 2.5).
  double routed_scale = 1.0;
  // The router's scores (hp-train's deepseek family: sigmoid, always), and whether the
  // chosen ones are normalized to sum 1 before routed_scale (Qwen3-MoE's norm_topk_prob;
  // DeepSeek-V3 and Mixtral: always). MoELlama's MoEs set both (moe_llama.h).
  RouterScore router_score = RouterScore::kSigmoid;
  bool norm_topk = true;
  double bias_update_rate = 1e-3;
  // Weight of the sequence-wise balance loss (DeepSeek-V3 eq. 17-20; 0: none, as trained).
  double aux_loss_coeff = 0;
  // > 0: each expert takes at most ceil(capacity_factor x tokens x k / experts) of a
  // micro-batch's routed slots from each rank's tokens (before they are sent), the rest are
  // dropped by drop_policy (a token keeps its other experts and the shared ones; weights are
  // not renormalized). 0: no limit, nothing dropped (as DeepSeek-V3 trains).
  double capacity_factor = 0;
  DropPolicy drop_policy = DropPolicy::kProbs;
  int64_t max_seq = 256;
  int64_t attention_tile = attn::kDefaultTile;  // as LlamaConfig's
  double rope_theta = 10000.0;
  double norm_eps = 1e-6;  // the blocks' and the final norm's (MLA's latent norms: always 1e-6)
  // The rotary dims' scaling (RopeOptions; DeepSeek-V3 publishes yarn, factor 40 over 4096
  // positions, mscale and mscale_all_dim 1). With yarn and rope_mscale_all_dim given, the
  // attention's scale is multiplied by yarn_mscale(rope_factor, rope_mscale_all_dim) squared.
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 40.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_seq = 4096;
  double rope_beta_fast = 32, rope_beta_slow = 1, rope_mscale = 1, rope_mscale_all_dim = 1;
  // Multi-token prediction (DeepSeek-V3 section 2.2): 0, or 1 module after the last block
  // that predicts the token after the next from the last block's output and the next
  // token's embedding, through one more MoE block and the shared output head (the published
  // model has 1). Its loss (the mean cross-entropy over the first T-1 positions) times
  // mtp_loss_scale joins the next-token loss's gradient; the reported loss stays the
  // next-token one. More than 1 module is not supported yet.
  int64_t mtp_layers = 0;
  double mtp_loss_scale = 0.3;  // DeepSeek-V3: 0.3, then 0.1 for the last 4.8T tokens
  RopeOptions rope() const { return rope_of(*this); }
  // What the attention's 1 / sqrt(qk_nope_dim + qk_rope_dim) is multiplied by (above).
  double attention_scale_factor() const;

  int64_t num_params() const;  // the multi-token prediction modules' included
  // The parameters of one multi-token prediction module besides the embedding and head it
  // shares: its norms, eh_proj and its MoE block.
  int64_t mtp_module_params() const;
  int64_t largest_block_params() const;  // a MoE block (or a dense one when all are dense)
  int64_t largest_param() const;         // elements of the largest single parameter
  void validate() const;
  static DeepSeekConfig tiny();
  static DeepSeekConfig deepseek_v3();  // the published 671B configuration
};

struct MLAImpl : torch::nn::Module {
  explicit MLAImpl(const DeepSeekConfig& c);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  DeepSeekConfig c;
  torch::nn::Linear wq_a{nullptr}, wq_b{nullptr}, wkv_a{nullptr}, wkv_b{nullptr}, wo{nullptr};
  RMSNorm q_norm{nullptr}, kv_norm{nullptr};
  // Set by context_parallel(): attention over the whole sequence, on the decompressed
  // per-head keys (the rotary key repeated for every head) and values.
  std::shared_ptr<cp::ContextParallel> context_parallel;
};
TORCH_MODULE(MLA);

// The routed experts held on this rank, each registered under its index in the whole model
// (experts.<e>), so that names and checkpoints do not depend on the layout. forward runs
// list[i] on the i-th block of counts[i] rows (a token dispatcher's expert-major rows);
// an expert with no rows runs on an empty block and gets a zero gradient.
struct ExpertsImpl : torch::nn::Module {
  ExpertsImpl(int64_t first, std::vector<SwiGLU> experts);
  at::Tensor forward(const at::Tensor& rows, const std::vector<int64_t>& counts);
  // The rows of an overlapped dispatch, chunk by chunk: each chunk's experts run as its rows
  // arrive, and their outputs leave at once (ep::InFlight). Returns f.returned().
  at::Tensor forward(ep::InFlight& f);
  int64_t first = 0;          // list[i] is expert first + i
  std::vector<SwiGLU> list;

 private:
  // list[from + i] on its counts[i] rows of `rows`, in turn; their outputs in that order.
  at::Tensor run(int64_t from, const at::Tensor& rows, const std::vector<int64_t>& counts);
};
TORCH_MODULE(Experts);

struct MoEImpl : torch::nn::Module {
  explicit MoEImpl(const DeepSeekConfig& c);
  at::Tensor forward(const at::Tensor& x);
  // Chosen experts [tokens, k] and their weights [tokens, k] for x [tokens, dim].
  std::pair<at::Tensor, at::Tensor> route(const at::Tensor& x) const;
  // The same from the gate's scores [tokens, experts] (fp32; scores_of its logits).
  std::pair<at::Tensor, at::Tensor> route_scores(const at::Tensor& scores) const;
  // The router's scores of its logits (c.router_score), in fp32 (float64 for a float64 model).
  at::Tensor scores_of(const at::Tensor& logits) const;
  // The sequence-wise balance loss of sequences [B, T] from their scores [B*T, experts] and
  // chosen experts [B*T, k]: the mean over sequences of aux_loss_coeff x sum_e f_e P_e, with
  // f_e = experts / (k T) x the tokens choosing e and P_e the mean over the sequence of e's
  // score normalized over all experts.
  at::Tensor balance_loss(const at::Tensor& scores, const at::Tensor& chosen, int64_t B, int64_t T) const;
  // With capacity_factor > 0: which slots of chosen [tokens, k] each expert keeps ([tokens,
  // k] bool), ranked by drop_policy (their router scores [tokens, k] for kProbs, ties by
  // token order).
  at::Tensor capacity_keep(const at::Tensor& chosen_scores, const at::Tensor& chosen) const;
  // bias[e] += rate * sign(mean load - load[e]) from the tokens routed since the last
  // call (call after the optimizer step). With `dp`, the load is summed over the
  // data-parallel ranks first, so every replica (and a one-process run on the global
  // batch) makes the same update.
  void update_balancing_bias(double rate, const CommPtr& dp = nullptr);
  DeepSeekConfig c;
  torch::nn::Linear gate{nullptr};
  Experts experts{nullptr};  // all of them, or this rank's after expert_parallel
  std::shared_ptr<ep::TokenDispatcher> dispatcher;  // every expert here unless expert_parallel
  // Chunks of local experts the dispatcher's all-to-alls overlap the experts in (1: none).
  int64_t overlap_chunks = 1;
  SwiGLU shared{nullptr};  // null without shared experts
  at::Tensor bias;  // buffer [experts]
  at::Tensor load;  // buffer [experts]: tokens routed since the last bias update
  // The load of the last update_balancing_bias (summed over `dp`), for metrics; undefined
  // before the first.
  at::Tensor last_load;
  // Slots a capacity limit dropped since the last bias update (a double scalar; undefined
  // until the first), and the last update's sum over `dp`.
  at::Tensor dropped;
  double last_dropped = 0;
  // What each micro-batch's loss is multiplied by before backward (Model::set_loss_scale):
  // the balance loss's gradient is scaled alike.
  double loss_scale = 1;
  // Set by parallelize_deepseek: the tensor-parallel group, and whether its ranks each route
  // their own piece of the sequence (experts whole under expert parallelism, sequence
  // parallel) rather than all of them alike (experts split along their hidden dim).
  CommPtr tp;
  bool tp_sequence_pieces = false;
  // Set (bool [tokens] of each forward's x, flattened): the rows routed; the others are sent
  // to no expert, counted in no load and take no capacity slot (their routed output is 0).
  // The multi-token prediction module sets it under context parallelism, where a rank's
  // rows include the sequence's last position, which has no token after the next.
  at::Tensor routed_rows;
};
TORCH_MODULE(MoE);

struct DeepSeekBlockImpl : torch::nn::Module {
  DeepSeekBlockImpl(const DeepSeekConfig& c, bool dense);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  MLA attn{nullptr};
  SwiGLU dense{nullptr};  // the first dense_layers blocks
  MoE moe{nullptr};       // the others
};
TORCH_MODULE(DeepSeekBlock);

// One multi-token prediction module (DeepSeek-V3 section 2.2): from the main model's last
// hidden states h_i (before the final norm) and the embeddings e_{i+1} of the next tokens,
// eh_proj(cat[enorm(e), hnorm(h)]) through a MoE block and `norm`; the model's output head
// then gives the logits of the tokens after the next.
struct MTPImpl : torch::nn::Module {
  explicit MTPImpl(const DeepSeekConfig& c);
  // norm(block(eh_proj(cat[enorm(e), hnorm(h)]))) of the embeddings e and hidden states h
  // [B, n, dim] (the first T-1 positions; under context parallelism the rank's); the block
  // checkpointed with `recompute` when not null.
  at::Tensor forward(const at::Tensor& e, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                     const RecomputePolicy* recompute);
  RMSNorm enorm{nullptr}, hnorm{nullptr}, norm{nullptr};
  torch::nn::Linear eh_proj{nullptr};
  DeepSeekBlock block{nullptr};
};
TORCH_MODULE(MTP);

struct DeepSeekImpl : torch::nn::Module {
  explicit DeepSeekImpl(const DeepSeekConfig& c, const PipelineSlice& slice = {});
  // Logits of tokens (a pipeline stage: see PipelineSlice in llama.h). With multi-token
  // prediction, a differentiated forward of the stage with the head reads the targets
  // set_targets gave (and forgets them): the MTP loss's gradient joins the logits'
  // (mtp_loss_scale x loss_scale), its value is kept for take_mtp_loss.
  at::Tensor forward(const at::Tensor& tokens);
  // The targets [B, T] of the next forward (loss_of_logits's), read by multi-token
  // prediction; ignored by a model without it.
  void set_targets(const at::Tensor& targets) { mtp_targets = targets; }
  // The MTP losses of the differentiated forwards since the last call: their sum and count.
  std::pair<double, int64_t> take_mtp_loss();
  // Mean next-token cross-entropy of forward's logits (vocabulary-split ones with loss
  // parallel), computed in fp32.
  at::Tensor loss_of_logits(const at::Tensor& logits, const at::Tensor& targets) const;
  void init_weights(uint64_t seed) { init_parameters(*this, seed); }
  // `dp`: the data-parallel group (tensor-parallel ranks see the same tokens: not in it).
  void update_balancing_bias(const CommPtr& dp = nullptr);
  DeepSeekConfig config;
  PipelineSlice slice;
  int64_t stream_split = 1;  // as LlamaImpl::stream_split
  // Set by parallelize_deepseek with loss parallel (see LlamaImpl::vocab_parallel_loss).
  CommPtr vocab_parallel_loss;
  // Set by parallelize_deepseek: the tensor-parallel group (multi-token prediction gathers
  // the sequence pieces over it).
  CommPtr tensor_parallel;
  // Set: each block is checkpointed with this policy (activations recomputed in backward).
  c10::optional<RecomputePolicy> recompute;
  // Set by context_parallel() (as LlamaImpl::context_parallel).
  std::shared_ptr<cp::ContextParallel> context_parallel;
  // What each micro-batch's loss is multiplied by before backward (the MTP loss's gradient
  // is scaled alike; the MoEs keep their own copy).
  double loss_scale = 1;
  // The embedding: on the first stage, and a copy (same name) on the last stage for
  // multi-token prediction, whose gradient the trainer sums with the first's.
  torch::nn::Embedding tok_emb{nullptr};
  std::vector<DeepSeekBlock> blocks;
  RMSNorm norm{nullptr};              // null on a stage without the head
  torch::nn::Linear output{nullptr};  // null on a stage without the head
  std::vector<MTP> mtp;               // config.mtp_layers modules, on the stage with the head
  // Each MoE of this stage (the blocks', then the MTP modules') with its layer in the whole
  // model (an MTP module's block: layers + its index, as Hugging Face numbers it).
  std::vector<std::pair<int64_t, MoE>> moes() const;

 private:
  // The logits of the last block's output h, with the MTP loss's gradient attached
  // (forward's, above).
  at::Tensor with_mtp_loss(const at::Tensor& h, const at::Tensor& targets, const at::Tensor& cos,
                           const at::Tensor& sin);
  at::Tensor mtp_targets;
  at::Tensor mtp_loss_sum_;  // detached, undefined before the first
  int64_t mtp_losses_ = 0;
};
TORCH_MODULE(DeepSeek);

// Expert parallelism over `ep` (every rank of the group calls it): keeps only the experts
// [r*E/ep, (r+1)*E/ep) of EP rank r (the others are dropped) and routes tokens through an
// all-to-all dispatcher. Apply before fully_shard (the Experts module is a unit of its own,
// sharded over the ranks holding the same experts) and before initialization or loading
// (names stay the whole model's, so either fills the kept experts). Raises when the group
// size does not divide the expert count, or when the MoE no longer holds all its experts
// (applied twice). A group of one keeps everything (and the local dispatcher). `o` picks
// the dispatcher (plain all-to-all or de-duplicating; the same results) and the chunks its
// all-to-alls overlap the experts in (bitwise the same results; at most the local experts,
// and 1 for the de-duplicating dispatcher: raises naming the value otherwise).
void expert_parallel(MoEImpl& moe, const CommPtr& ep, const ep::DispatchOptions& o = {});
void expert_parallel(DeepSeekImpl& model, const CommPtr& ep, const ep::DispatchOptions& o = {});

// Context parallelism, as for Llama (llama.h). The MoE routes each rank's own tokens (a
// capacity limit counts them per rank, as under data parallelism). Raises "not supported
// yet" for the sequence-wise balance loss (aux_loss_coeff > 0): it counts a whole
// sequence's tokens, of which a CP rank holds a part.
void context_parallel(DeepSeekImpl& model, std::shared_ptr<cp::ContextParallel> ctx);

// Hugging Face interchange with transformers' DeepseekV3ForCausalLM, in the layout of the
// published checkpoints (one tensor per routed expert and projection). hf_names: (ours,
// theirs) for every parameter and each MoE's balancing bias (the buffer `bias`, theirs
// `mlp.gate.e_score_correction_bias`), in Hugging Face's order; the rotary dims are
// interleaved pairs on both sides (config.json's rope_interleave).
std::vector<std::pair<std::string, std::string>> hf_names(const DeepSeekConfig& c);
// The config.json of the model, its weights stored as `dtype`.
std::string hf_config(const DeepSeekConfig& c, at::ScalarType dtype);
// The model a config.json describes (its text; `path` names it). Raises naming the key for
// what the model cannot be: quantized weights, rotary scaling, softmax routing, ...
DeepSeekConfig deepseek_config_from_hf(const std::string& text, const std::string& path);
// Raises naming both keys where the config.json describes another model than `c`.
void check_hf_config(const DeepSeekConfig& c, const std::string& text, const std::string& path);

}  // namespace hp::models
