"""hyperparallel's Llama variants against transformers 5's LlamaForCausalLM.

  python hf_llama_variants_test.py HF_LOGITS HP_TRAIN WORKDIR [MPIRUN]

Import: small random Llamas (every weight perturbed, biases included) with an explicit
head_dim (24, where hidden_size / num_attention_heads is 16), attention and MLP biases, and
one key/value head, saved by save_pretrained, are read by hyperparallel (hf_logits; the
sizes from config.json) and the logits agree. Export: hp-train trains a tiny Llama with
head_dim 24 and every bias over 2 ranks, exports it; from_pretrained reads it (config and
weights) and the logits agree. The bound: fp32 on both sides, 1e-5 of the largest logit.
Prints 'N passed, N failed'.
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_common import Interop

HF_LOGITS, HP_TRAIN, WORK = sys.argv[1:4]
MPIRUN = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
t = Interop(HF_LOGITS, HP_TRAIN, WORK, MPIRUN, bound=1e-5)


def import_case(name, kv_heads, head_dim, attention_bias, mlp_bias):
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=64, rms_norm_eps=1e-5, attention_bias=attention_bias,
                      mlp_bias=mlp_bias, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    model = LlamaForCausalLM(cfg).float().eval()
    folder = t.perturbed(model, name)
    tokens, tpath = t.tokens_file(256)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("import " + name, theirs, t.ours(folder, tpath))


def export_case():
    sets = ["model.type=llama", "model.dim=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
            "model.head_dim=24", "model.attention_bias=true", "model.mlp_bias=true", "params_dtype=float32",
            "global_batch_size=4", "seq_length=16", "train_steps=3", "lr_warmup_steps=1", "save_interval=3",
            "lr=3e-3"]
    folder, _ = t.train_and_export("head_dim_biases", "llama_tiny.yaml", sets, ranks=2 if MPIRUN else 1)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    c = model.config
    t.check("export head_dim_biases config", c.head_dim == 24 and c.attention_bias and c.mlp_bias,
            f"head_dim {c.head_dim}, attention_bias {c.attention_bias}, mlp_bias {c.mlp_bias}")
    tokens, tpath = t.tokens_file(c.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("export head_dim_biases", theirs, t.ours(folder, tpath))


import_case("head_dim_biases", kv_heads=2, head_dim=24, attention_bias=True, mlp_bias=True)
import_case("head_dim_one_kv_head", kv_heads=1, head_dim=24, attention_bias=False, mlp_bias=True)
export_case()
sys.exit(t.finish())
