"""hyperparallel's Llama against Hugging Face's own LlamaForCausalLM (transformers).

  python hf_interop_test.py HF_LOGITS HP_TRAIN WORKDIR [MPIRUN]

Import: a small random LlamaForCausalLM (every weight perturbed, so that a swapped norm or
projection shows; grouped-query and tied variants) written by save_pretrained in several
files is read by hyperparallel (hf_logits), and the logits on the same tokens agree; with
one key/value head and attention biases too (head_dim and mlp_bias, which transformers 4.40
lacks, are in hf_llama_variants_test.py), and a Qwen2ForCausalLM (biases on q, k and v),
imported and exported as one.
Export: hp-train trains a tiny Llama, saves a checkpoint and exports it (over 2 ranks when
MPIRUN is given, in several files); from_pretrained loads the folder and its logits agree
with hyperparallel's on it. The bound: fp32 on both sides, 1e-5 of the logits' largest
magnitude (the two differ only in rounding: rotary tables in float64 here, float32 there,
and the order of the matmuls' sums). The checkpoint the export started from (written over 2
ranks when MPIRUN is given, so its tensors are split in chunks) is read by hp_checkpoint.py,
a standard-library reader written from docs/ckpt.md alone: its checksums hold, and every
exported tensor equals, byte for byte, exactly one tensor it reassembled.
Prints 'N passed, N failed'.
"""
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_common import Interop

HF_LOGITS, HP_TRAIN, WORK = sys.argv[1:4]
MPIRUN = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
t = Interop(HF_LOGITS, HP_TRAIN, WORK, MPIRUN, bound=1e-5)


def import_case(name, tie, kv_heads, bias=False):
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tie, attention_bias=bias)
    model = LlamaForCausalLM(cfg).float().eval()
    folder = t.perturbed(model, name, safe_serialization=True, max_shard_size="60KB")
    tokens, tpath = t.tokens_file(cfg.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("import " + name, theirs, t.ours(folder, tpath))


def qwen2_import_case():
    """Qwen2: a Llama with biases on q, k and v, read by model_type."""
    torch.manual_seed(4)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                      rope_theta=5000.0, tie_word_embeddings=False, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).float().eval()
    folder = t.perturbed(model, "qwen2")
    tokens, tpath = t.tokens_file(cfg.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("import qwen2", theirs, t.ours(folder, tpath))


def qwen2_export_case():
    sets = ["model.type=llama", "model.dim=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
            "model.qkv_bias=true", "params_dtype=float32", "global_batch_size=4", "seq_length=16", "train_steps=3",
            "lr_warmup_steps=1", "save_interval=3", "lr=3e-3"]
    folder, _ = t.train_and_export("qwen2", "llama_tiny.yaml", sets, ranks=2)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    t.check("export qwen2 class", type(model).__name__ == "Qwen2ForCausalLM", f"loaded as {type(model).__name__}")
    tokens, tpath = t.tokens_file(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("export qwen2", theirs, t.ours(folder, tpath))


def export_case(name, tie, bias=False):
    sets = ["model.type=llama", "model.dim=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
            "model.tie_embeddings=" + ("true" if tie else "false"), "params_dtype=float32", "global_batch_size=4",
            "seq_length=16", "train_steps=3", "lr_warmup_steps=1", "save_interval=3", "lr=3e-3",
            "model.attention_bias=" + ("true" if bias else "false")]
    folder, ckpt = t.train_and_export(name, "llama_tiny.yaml", sets, ranks=2)
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    tokens, tpath = t.tokens_file(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("export " + name, theirs, t.ours(folder, tpath))
    t.checkpoint_case(name, ckpt, folder, split_expected=bool(MPIRUN))


import_case("gqa", tie=False, kv_heads=2)
import_case("tied", tie=True, kv_heads=4)
# One key/value head for all four query heads, and biases on every attention projection.
import_case("one_kv_head_bias", tie=False, kv_heads=1, bias=True)
export_case("gqa", tie=False)
export_case("tied", tie=True)
export_case("attention_bias", tie=False, bias=True)
qwen2_import_case()
qwen2_export_case()
sys.exit(t.finish())
