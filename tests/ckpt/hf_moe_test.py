"""hyperparallel's qwen3_moe and mixtral families against transformers 5's
Qwen3MoeForCausalLM and MixtralForCausalLM (PyTorch 2.x).

  python hf_moe_test.py HF_LOGITS HP_TRAIN WORKDIR [MPIRUN]

Import: small random models made by transformers (every weight perturbed, so that a swapped
projection, norm or expert shows), written by save_pretrained in several files in the
published layout (a tensor per expert), are read by hyperparallel (hf_logits; the sizes from
config.json) and the logits on the same tokens agree: Qwen3-MoE with a dense block between
MoE ones (decoder_sparse_step 2), an explicit head_dim, routing weights not normalized
(norm_topk_prob false), then normalized with attention biases; Mixtral with 3 experts a
token.
Export: hp-train trains each family with expert parallelism over 2 ranks when MPIRUN is
given, saves and exports; from_pretrained loads the folder and its logits agree with
hyperparallel's on it; the checkpoint, read by hp_checkpoint.py (the independent reader),
holds every exported tensor byte for byte.
Hostile: config.json with sliding-window attention, mlp_only_layers, the router's auxiliary
loss or router jitter is refused naming the key.
The bound: fp32 on both sides, 1e-5 of the logits' largest magnitude. Prints 'N passed, N
failed'.
"""
import json
import os
import subprocess
import sys

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_common import Interop

HF_LOGITS, HP_TRAIN, WORK = sys.argv[1:4]
MPIRUN = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
t = Interop(HF_LOGITS, HP_TRAIN, WORK, MPIRUN, bound=1e-5)

QWEN3 = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
             decoder_sparse_step=2, norm_topk_prob=False, max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
MIXTRAL = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=3, max_position_embeddings=64,
               rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})


def import_case(name, cls, config):
    torch.manual_seed(1)
    model = cls(config).float().eval()
    folder = t.perturbed(model, name, max_shard_size="60KB")
    tokens, tpath = t.tokens_file(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("import " + name, theirs, t.ours(folder, tpath))
    return folder, tpath


def export_case(name, config, cls):
    ranks = 2 if MPIRUN else 1
    sets = ["params_dtype=float32", f"expert_parallel={ranks}", "global_batch_size=4", "micro_batch_num=1",
            "seq_length=16", "train_steps=3", "lr_warmup_steps=1", "save_interval=3", "lr=3e-3", "eval_interval=0"]
    folder, ckpt = t.train_and_export(name, config, sets, ranks)
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, tpath = t.tokens_file(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("export " + name, theirs, t.ours(folder, tpath))
    t.checkpoint_case(name, ckpt, folder, split_expected=False)


def hostile_case(name, folder, tpath, key, value):
    """`folder` with config.json's `key` set to `value`: hf_logits refuses it naming the key."""
    bad = t.folder("hostile_" + name)
    os.makedirs(bad)
    for f in os.listdir(folder):
        if f != "config.json":
            os.link(os.path.join(folder, f), os.path.join(bad, f))
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    c[key] = value
    with open(os.path.join(bad, "config.json"), "w", encoding="utf-8") as f:
        json.dump(c, f)
    out = subprocess.run([HF_LOGITS, bad, tpath, os.path.join(WORK, "bad.safetensors")], capture_output=True,
                         text=True)
    said = out.stdout + out.stderr
    t.check("refuse " + name, out.returncode != 0 and key in said and "not supported yet" in said,
            f"exit {out.returncode}: {said.strip().splitlines()[-1] if said.strip() else ''}")


qwen3, qtokens = import_case("qwen3_moe", Qwen3MoeForCausalLM, Qwen3MoeConfig(**QWEN3))
import_case("qwen3_moe_normalized_biases", Qwen3MoeForCausalLM,
            Qwen3MoeConfig(**dict(QWEN3, decoder_sparse_step=1, norm_topk_prob=True, attention_bias=True, head_dim=16)))
mixtral, mtokens = import_case("mixtral", MixtralForCausalLM, MixtralConfig(**MIXTRAL))
export_case("qwen3_moe", "qwen3_moe_tiny.yaml", Qwen3MoeForCausalLM)
export_case("mixtral", "mixtral_tiny.yaml", MixtralForCausalLM)
hostile_case("qwen3_sliding_window", qwen3, qtokens, "use_sliding_window", True)
hostile_case("qwen3_mlp_only_layers", qwen3, qtokens, "mlp_only_layers", [1])
hostile_case("qwen3_router_loss", qwen3, qtokens, "output_router_logits", True)
hostile_case("mixtral_sliding_window", mixtral, mtokens, "sliding_window", 4096)
hostile_case("mixtral_jitter", mixtral, mtokens, "router_jitter_noise", 0.01)
sys.exit(t.finish())
