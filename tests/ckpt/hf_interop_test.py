"""hyperparallel's Llama against Hugging Face's own LlamaForCausalLM (transformers).

  python hf_interop_test.py HF_LOGITS HP_TRAIN WORKDIR [MPIRUN]

Import: a small random LlamaForCausalLM (every weight perturbed, so that a swapped norm or
projection shows; grouped-query and tied variants) written by save_pretrained in several
files is read by hyperparallel (hf_logits), and the logits on the same tokens agree.
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
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hp_checkpoint import Checkpoint, read_safetensors

HF_LOGITS, HP_TRAIN, WORK = sys.argv[1:4]
MPIRUN = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
BOUND = 1e-5
results = []


def tokens_file(vocab):
    torch.manual_seed(7)
    tokens = torch.randint(0, vocab, (2, 12), dtype=torch.int64)
    path = os.path.join(WORK, "tokens.safetensors")
    save_file({"tokens": tokens}, path)
    return tokens, path


def ours(model_dir, tokens_path):
    out = os.path.join(WORK, "ours.safetensors")
    subprocess.run([HF_LOGITS, model_dir, tokens_path, out], check=True)
    return load_file(out)["logits"]


def compare(name, theirs, mine):
    rel = ((theirs - mine).abs().max() / theirs.abs().max()).item()
    ok = theirs.shape == mine.shape and rel <= BOUND
    print(f"{'PASS' if ok else 'FAIL'} {name}: logits {tuple(mine.shape)}, max difference {rel:.2e} of the largest (bound {BOUND:.0e})")
    results.append(ok)


def import_case(name, tie, kv_heads):
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = os.path.join(WORK, "hf_" + name)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB")
    tokens, tpath = tokens_file(cfg.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    compare("import " + name, theirs, ours(folder, tpath))


def export_case(name, tie):
    out = os.path.join(WORK, "run_" + name)
    shutil.rmtree(out, ignore_errors=True)
    sets = ["model.type=llama", "model.dim=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
            "model.tie_embeddings=" + ("true" if tie else "false"), "params_dtype=float32", "global_batch_size=4",
            "seq_length=16", "train_steps=3", "lr_warmup_steps=1", "save_interval=3", "output_dir=" + out, "lr=3e-3"]
    cmd = [HP_TRAIN, "--config", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "llama_tiny.yaml")]
    for s in sets:
        cmd += ["--set", s]
    if MPIRUN:
        cmd = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none"] + cmd
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    folder = os.path.join(WORK, "exported_" + name)
    shutil.rmtree(folder, ignore_errors=True)
    export = [HP_TRAIN, "--export-hf", os.path.join(out, "checkpoints"), folder, "--max-shard-size", "60KB"]
    if MPIRUN:
        export = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none"] + export
    subprocess.run(export, check=True)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    print(f"exported {name}: {', '.join(files)}")
    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    tokens, tpath = tokens_file(model.config.vocab_size)
    with torch.no_grad():
        theirs = model(tokens).logits
    ok_files = len(files) > 1
    if not ok_files:
        print(f"FAIL export {name}: one file, expected several at 60KB each")
        results.append(False)
    compare("export " + name, theirs, ours(folder, tpath))
    saves = os.path.join(out, "checkpoints")
    with open(os.path.join(saves, "latest"), encoding="utf-8") as f:
        checkpoint_case(name, os.path.join(saves, f.read().strip()), folder)


def checkpoint_case(name, ckpt_dir, exported):
    """The checkpoint read by the independent reader against the export's tensors."""
    ckpt = Checkpoint(ckpt_dir)
    by_bytes = {}
    split = 0
    for t in ckpt.tensors:
        dtype, shape, data = ckpt.tensor(t)
        by_bytes.setdefault((dtype, tuple(shape), data), []).append(t)
        split += len(ckpt.tensors[t]["chunks"]) > 1
    matched, problems = 0, []
    for f in sorted(x for x in os.listdir(exported) if x.endswith(".safetensors")):
        header, raw, start = read_safetensors(os.path.join(exported, f))
        for hf_name, e in header.items():
            data = raw[start + e["data_offsets"][0]:start + e["data_offsets"][1]]
            owners = by_bytes.get((e["dtype"], tuple(e["shape"]), data), [])
            if len(owners) == 1:
                matched += 1
            else:
                problems.append(f"{hf_name} equals {len(owners)} checkpoint tensors")
    ok = not problems and matched > 0 and (split > 0 or not MPIRUN)
    print(f"{'PASS' if ok else 'FAIL'} checkpoint {name}: {len(ckpt.tensors)} tensors ({split} split in chunks), "
          f"{ckpt.blocks_checked} checksummed blocks, {matched} exported tensors each equal to one of them"
          + (": " + "; ".join(problems[:4]) if problems else ""))
    results.append(ok)


os.makedirs(WORK, exist_ok=True)
import_case("gqa", tie=False, kv_heads=2)
import_case("tied", tie=True, kv_heads=4)
export_case("gqa", tie=False)
export_case("tied", tie=True)
passed = sum(results)
print(f"{passed} passed, {len(results) - passed} failed")
sys.exit(0 if passed == len(results) else 1)
