"""hyperparallel's DeepSeek against Hugging Face's own DeepseekV3ForCausalLM (transformers 5
on PyTorch 2.x).

  python hf_deepseek_test.py HF_LOGITS HP_TRAIN WORKDIR [MPIRUN]

Import: small random DeepseekV3ForCausalLM models (every weight and the balancing bias
e_score_correction_bias perturbed, so that a swapped projection, expert or bias shows),
written by save_pretrained in several files in the published checkpoints' layout (a tensor
per expert), are read by hyperparallel (hf_logits), and the logits on the same tokens
agree: group-limited routing (4 groups of 2 experts, a token's 2 from its best 2 groups)
with routing weights scaled by 2.5 and a dense first block; and a model of MoE blocks only
with 2 shared experts and plain routing.
Export: hp-train trains a tiny DeepSeek (group-limited routing, a balancing bias that moves)
with expert parallelism over 2 ranks when MPIRUN is given, saves and exports it;
from_pretrained loads the folder, its balancing bias is the trained one (not zero), and its
logits agree with hyperparallel's on it. The checkpoint, read by hp_checkpoint.py (the
independent reader), holds every exported tensor byte for byte.
Export --dtype fp8: the projections quantized as this test quantizes them, read back as their
dequantized values. FP8: a model's projections quantized here to the published float8_e4m3fn format with 128 x 128
block scales; hyperparallel's import of that folder equals, bit for bit, its import of the
same weights dequantized, matches transformers on them, and hp-train starts from either
with the same first loss.
The bound: fp32 on both sides, 1e-5 of the logits' largest magnitude (rounding only: the
rotary tables, the order of the experts' sums). Prints 'N passed, N failed'.
"""
import subprocess
import sys

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from hf_common import CONFIGS, Interop

HF_LOGITS, HP_TRAIN, WORK = sys.argv[1:4]
MPIRUN = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
t = Interop(HF_LOGITS, HP_TRAIN, WORK, MPIRUN, bound=1e-5)


def import_case(name, **kw):
    torch.manual_seed(1)
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5)
    base.update(kw)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**base)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    folder = t.folder("hf_" + name)
    model.save_pretrained(folder, max_shard_size="60KB")
    tokens, tpath = t.tokens_file(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("import " + name, theirs, t.ours(folder, tpath))


def export_case(name):
    ranks = 2 if MPIRUN else 1
    sets = ["params_dtype=float32", "compute_dtype=float32", "accumulate_allreduce_grads_in_fp32=false",
            "data_parallel=1", "data_parallel_shard=-1", f"expert_parallel={ranks}", "global_batch_size=4",
            "micro_batch_num=1", "seq_length=16", "train_steps=3", "lr_warmup_steps=1", "save_interval=3", "lr=3e-3",
            "model.expert_groups=2", "model.groups_per_token=1", "model.routed_scale=2.5",
            "model.bias_update_rate=0.01"]
    folder, ckpt = t.train_and_export(name, "deepseek_tiny.yaml", sets, ranks)
    model = DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    t.check("export " + name + " bias", bias.dtype == torch.float32 and bias.abs().max().item() > 0,
            f"layer 1's e_score_correction_bias {bias.tolist()}")
    tokens, tpath = t.tokens_file(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    t.compare("export " + name, theirs, t.ours(folder, tpath))
    t.checkpoint_case(name, ckpt, folder, split_expected=False)
    export_fp8_case(name, ckpt, folder, ranks, tpath)


def export_fp8_case(name, ckpt, folder, ranks, tpath):
    """--dtype fp8: every projection (*proj.weight) written as float8_e4m3fn with a scale per
    128 x 128 block, equal byte for byte to this test's own quantization of the fp32 export
    (amax / 448 a block, 1 for a block of zeros); the rest bf16 (the balancing bias fp32). Read
    back, the folder gives the logits of its weights dequantized here, bit for bit."""
    import json
    import os

    from safetensors.torch import load_file, save_file
    fp8 = t.folder("exported_fp8_" + name)
    subprocess.run(t.launch([HP_TRAIN, "--export-hf", ckpt, fp8, "--dtype", "fp8", "--max-shard-size", "60KB"], ranks),
                   check=True)
    load = lambda d: {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                      for k, v in load_file(os.path.join(d, f)).items()}
    plain, got = load(folder), load(fp8)
    bad, quantized, dequantized = [], 0, {}
    for k, w in plain.items():
        if k.endswith("proj.weight") and w.dim() == 2:
            rows, cols = w.shape
            nr, nc = -(-rows // 128), -(-cols // 128)
            padded = torch.zeros(nr * 128, nc * 128)
            padded[:rows, :cols] = w
            amax = padded.view(nr, 128, nc, 128).abs().amax(dim=(1, 3))
            scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            each = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
            codes = (w / each).to(torch.float8_e4m3fn)
            ok = (got[k].dtype == torch.float8_e4m3fn and torch.equal(got[k].view(torch.uint8), codes.view(torch.uint8))
                  and torch.equal(got[k + "_scale_inv"], scale))
            quantized += 1
            dequantized[k] = got[k].to(torch.float32) * got[k + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(
                128, 1)[:rows, :cols]
        else:
            want = w if k.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
            ok = torch.equal(got[k], want)
            dequantized[k] = got[k]
        if not ok:
            bad.append(k)
    extra = sorted(set(got) - set(plain) - {k + "_scale_inv" for k in plain})
    config = json.load(open(os.path.join(fp8, "config.json")))
    t.check("export fp8 " + name, not bad and not extra and quantized > 10 and
            config.get("quantization_config", {}).get("weight_block_size") == [128, 128],
            f"{quantized} projections FP8 as quantized here, the rest bf16; differing: {bad[:3]}, unexpected: {extra[:3]}")
    deq = t.folder("exported_fp8_dequantized_" + name)
    os.makedirs(deq)
    del config["quantization_config"]
    json.dump(config, open(os.path.join(deq, "config.json"), "w"))
    save_file(dequantized, os.path.join(deq, "model.safetensors"), metadata={"format": "pt"})
    t.check("export fp8 " + name + " read back", torch.equal(t.ours(fp8, tpath), t.ours(deq, tpath)),
            "the FP8 export's logits equal those of its weights dequantized here, bit for bit")


def fp8_case():
    """The published FP8 format: the projections of a perturbed model quantized here to
    float8_e4m3fn with an fp32 scale per 128 x 128 block (amax / 448; 200 rows and 64 columns:
    blocks cut short), beside the same weights dequantized (fp32). hyperparallel reads the FP8
    folder bit for bit as the dequantized one, both match transformers on the dequantized
    weights, and hp-train starts from either with the same first loss."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    torch.manual_seed(2)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=200, moe_intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
               q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5, first_k_dense_replace=1,
               n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    plain = t.folder("fp8_source")
    model.save_pretrained(plain)
    weights = {}
    for f in sorted(os.listdir(plain)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(plain, f)))
    quantized, dequantized, count = {}, {}, 0
    for name, w in weights.items():
        if w.dim() != 2 or not name.endswith("proj.weight"):  # as published: the projections only
            quantized[name] = dequantized[name] = w
            continue
        rows, cols = w.shape
        nr, nc = -(-rows // 128), -(-cols // 128)
        padded = torch.zeros(nr * 128, nc * 128)
        padded[:rows, :cols] = w
        scale = (padded.view(nr, 128, nc, 128).abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12).float()
        each = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        codes = (w / each).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = codes, scale
        dequantized[name] = codes.to(torch.float32) * each
        count += 1
    config = json.load(open(os.path.join(plain, "config.json")))
    folders = {}
    for kind, tensors in (("fp8", quantized), ("dequantized", dequantized)):
        folder = t.folder("fp8_" + kind)
        os.makedirs(folder)
        c = dict(config)
        if kind == "fp8":
            c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
        json.dump(c, open(os.path.join(folder, "config.json"), "w"))
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        folders[kind] = folder
    tokens, tpath = t.tokens_file(model.config.vocab_size)
    theirs_model = DeepseekV3ForCausalLM.from_pretrained(folders["dequantized"], dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = theirs_model(tokens).logits
    from_fp8, from_deq = t.ours(folders["fp8"], tpath), t.ours(folders["dequantized"], tpath)
    t.check("import fp8 bitwise", count > 10 and torch.equal(from_fp8, from_deq),
            f"{count} FP8 weights; logits from the FP8 folder equal those from the dequantized one bit for bit")
    t.compare("import fp8 against transformers", theirs, from_fp8)
    # hp-train from either folder (the trainer's import: every tensor read, the scales counted;
    # on 2 ranks each reads the bytes of its shards and the scales of their blocks).
    losses = {}
    for kind, folder in folders.items():
        out = subprocess.run(t.launch([HP_TRAIN, "--config", os.path.join(CONFIGS, "deepseek_tiny.yaml"),
                              "--set", "data_parallel=1", "--set", f"model.from_hf={folder}", "--set", f"init_from_hf={folder}",
                              "--set", "params_dtype=float32", "--set", "compute_dtype=float32",
                              "--set", "accumulate_allreduce_grads_in_fp32=false", "--set", "train_steps=1",
                              "--set", "lr_warmup_steps=0", "--set", "eval_interval=0", "--set", "output_dir="],
                                      2 if MPIRUN else 1),  # 2 ranks: each reads its shards' bytes and blocks
                             capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("step 1/1")]
        losses[kind] = line[0].split("|")[1].strip() if out.returncode == 0 and line else out.stdout + out.stderr
    t.check("hp-train from fp8", losses["fp8"] == losses["dequantized"] and losses["fp8"].startswith("loss"),
            f"first step from the FP8 folder {losses['fp8']!r}, from the dequantized one {losses['dequantized']!r}")


def yarn_cases():
    """DeepSeek with YaRN as published (mscale and mscale_all_dim 1: the attention scale times
    (0.1 ln factor + 1)^2), at three factors over 16 original positions, 64 tokens past them;
    and the factor-40 folder read as unscaled differs."""
    for factor, extra in ((4.0, {}), (16.0, {"beta_fast": 16, "beta_slow": 2}), (40.0, {})):
        rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 16, "mscale": 1.0,
                "mscale_all_dim": 1.0, "rope_theta": 5000.0, **extra}
        torch.manual_seed(3)
        cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                   q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   max_position_embeddings=128, rms_norm_eps=1e-5, first_k_dense_replace=1, n_shared_experts=1,
                   n_group=1, topk_group=1, rope_parameters=rope)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).float().eval()
        name = f"yarn_{factor:g}"
        t.yarn_case(name, model, t.perturbed(model, name), unscaled_too=factor == 40.0)


import_case("grouped", first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2,
            routed_scaling_factor=2.5)
import_case("moe_only", num_hidden_layers=2, first_k_dense_replace=0, n_shared_experts=2, n_group=1, topk_group=1,
            routed_scaling_factor=1.0)
export_case("ep")
fp8_case()
yarn_cases()
sys.exit(t.finish())
