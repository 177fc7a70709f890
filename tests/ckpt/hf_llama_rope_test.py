"""hyperparallel's Llama with rotary scaling against transformers 5's LlamaForCausalLM.

  python hf_llama_rope_test.py HF_LOGITS HP_TRAIN WORKDIR [MPIRUN]

Import: small random Llamas (every weight perturbed) with Llama 3.1's rotary scaling
(rope_type llama3: factor 8, low/high frequency factors 1 and 4, 32 original positions, so
that the 48 tokens below reach past them and all three frequency bands differ from plain
rotary) and with linear scaling (factor 4), saved by save_pretrained, are read by
hyperparallel (hf_logits; the config.json in transformers 5's rope_parameters form) and
the logits agree. A model without scaling read as if it had it (a changed config.json)
differs, so the cases test the scaling. YaRN at three factors (one with its betas, one with
mscale and mscale_all_dim), 64 positions past the original 16, and read as unscaled: differs.
Export: hp-train trains a tiny Llama with llama3
scaling, exports it (the config.json in transformers 4's rope_scaling form); from_pretrained
reads it and the logits agree. The bound: fp32 on both sides, 1e-5 of the largest logit.
Prints 'N passed, N failed'.
"""
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_common import Interop

HF_LOGITS, HP_TRAIN, WORK = sys.argv[1:4]
MPIRUN = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
t = Interop(HF_LOGITS, HP_TRAIN, WORK, MPIRUN, bound=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def model_with(rope, name):
    torch.manual_seed(2)
    params = {"rope_theta": 5000.0, **(rope or {"rope_type": "default"})}
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                      rope_parameters=params)
    model = LlamaForCausalLM(cfg).float().eval()
    folder = t.perturbed(model, name)
    return model, folder


def import_case(name, rope):
    model, folder = model_with(rope, name)
    tokens, tpath = t.tokens_file(256, shape=(2, 48))
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("import " + name, theirs, t.ours(folder, tpath))
    return model, folder, tokens, tpath


def scaling_matters():
    """The plain model's weights read with llama3 scaling written into its config.json."""
    model, folder = model_with(None, "plain")
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {"rope_theta": 5000.0, **LLAMA3}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    tokens, tpath = t.tokens_file(256, shape=(2, 48))
    with torch.no_grad():
        theirs = model(tokens).logits
    mine = t.ours(folder, tpath)
    rel = ((theirs - mine).abs().max() / theirs.abs().max()).item()
    t.check("scaling changes the logits", rel > 1e-3, f"plain rotary against llama3-scaled: {rel:.2e} of the largest")


def export_case():
    sets = ["model.type=llama", "model.dim=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
            "model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_original_max_seq=32",
            "params_dtype=float32", "global_batch_size=4", "seq_length=48", "train_steps=3", "lr_warmup_steps=1",
            "save_interval=3", "lr=3e-3"]
    folder, _ = t.train_and_export("llama3_rope", "llama_tiny.yaml", sets, ranks=2 if MPIRUN else 1)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    rp = model.config.rope_parameters
    t.check("export llama3_rope config", rp.get("rope_type") == "llama3" and rp.get("factor") == 8.0,
            f"rope_parameters as transformers read them: {rp}")
    tokens, tpath = t.tokens_file(model.config.vocab_size, shape=(2, 48))
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("export llama3_rope", theirs, t.ours(folder, tpath))


def yarn_cases():
    """YaRN at three factors over 16 original positions, the 80 tokens read 64 past them (the
    rotary tables times the attention factor 0.1 ln(factor) + 1; with mscale and
    mscale_all_dim given, their ratio); and the same weights read as unscaled differ."""
    for factor, extra in ((2.0, {}), (4.0, {"beta_fast": 16, "beta_slow": 2}), (8.0, {"mscale": 1.0, "mscale_all_dim": 0.5})):
        rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 16, **extra}
        name = f"yarn_{factor:g}"
        model, folder = model_with(rope, name)
        t.yarn_case(name, model, folder, unscaled_too=factor == 8.0)


import_case("llama3", LLAMA3)
import_case("linear", {"rope_type": "linear", "factor": 4.0})
scaling_matters()
yarn_cases()
export_case()
sys.exit(t.finish())
