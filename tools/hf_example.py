#!/usr/bin/env python3
"""The two Python steps of scripts/llama_example.sh and scripts/moe_example.sh, run in
their virtual environments (transformers, tokenizers, safetensors over PyTorch).

    hf_example.py [--name NAME] model --family llama|qwen3_moe --out DIR CORPUS...
        Trains a byte-level BPE tokenizer on the corpus (tokenizers' trainer) and saves it
        with a small random model of the family (transformers' LlamaForCausalLM, or
        Qwen3MoeForCausalLM: 8 experts, 2 a token) as a Hugging Face model folder, DIR:
        config.json, model.safetensors, tokenizer files.

    hf_example.py [--name NAME] check --run DIR --export DIR --valid FILE --config FILE [--set K=V]...
        After training: the validation losses hp-train wrote to DIR/metrics.jsonl must
        fall; transformers loads the exported folder, computes the loss of the last
        evaluation's validation samples itself (it must equal hp-train's within fp32's
        precision) and generates text from a prompt.

Both print what they did, each line starting with NAME (default llama_example); an error is
one line naming the file or value, exit 1.
"""

import argparse
import json
import math
import os
import sys

# The example models: small enough for 200 steps on 4 ranks of a 2-core machine in a minute
# or two, shaped like Llama 3 (grouped-query attention, untied head) and Qwen3-30B-A3B
# (per-head q/k norms, every block a MoE of softmax-routed experts, 2 of 8 a token,
# normalized). Their vocabulary is the tokenizer's; 2048 divides by any tensor_parallel
# degree up to 2048.
VOCAB = 2048
COMMON = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(COMMON, intermediate_size=384, rope_theta=10000.0, rms_norm_eps=1e-5)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, head_dim=32, intermediate_size=384, moe_intermediate_size=96, num_experts=8,
                       num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
EOD = "<|endoftext|>"
PROMPT = "The pipeline schedule"


class ExampleError(Exception):
    """Printed as one line, exit 1."""


def corpus_files(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                files.extend(os.path.join(root, n) for n in sorted(names) if not n.startswith("."))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ExampleError(f"corpus input '{p}' is neither a file nor a directory")
    if not files:
        raise ExampleError(f"the corpus inputs {paths} hold no files")
    return files


def make_model(a):
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if os.path.exists(a.out):
        raise ExampleError(f"'{a.out}' exists (nothing is overwritten: remove it or choose another folder)")
    files = corpus_files(a.corpus)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    if tok.get_vocab_size() > VOCAB:
        raise ExampleError(f"the trained tokenizer has {tok.get_vocab_size()} tokens, more than {VOCAB}")
    eod = tok.token_to_id(EOD)
    tmp = a.out + ".partial"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD, bos_token=EOD,
                                                model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(tmp)
    config_class, model_class, sizes = FAMILIES[a.family]
    config = getattr(transformers, config_class)(vocab_size=VOCAB, bos_token_id=eod, eos_token_id=eod, **sizes)
    torch.manual_seed(a.seed)
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, a.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{a.name}: a BPE tokenizer of {tok.get_vocab_size()} tokens trained on {len(files)} files, "
          f"and a random {model_class} of {params:,} parameters (transformers {transformers.__version__}) in {a.out}")
    return 0


def read_metrics(path):
    steps, evals = [], []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                obj = json.loads(line)
                if "eval" in obj:
                    evals.append(obj["eval"])
                elif "step" in obj:
                    steps.append(obj)
    except (OSError, ValueError) as e:
        raise ExampleError(f"{path}: cannot be read as hp-train's metrics: {e}") from None
    return steps, evals


def setting(a, key):
    """A top-level integer key of the hp-train config, after the --set overrides given to
    hp-train (the last one wins, as there)."""
    import yaml  # transformers' own dependency

    value = None
    try:
        with open(a.config, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        if isinstance(config, dict):
            value = config.get(key)
    except (OSError, yaml.YAMLError) as e:
        raise ExampleError(f"{a.config}: cannot be read: {e}") from None
    for s in a.set or []:
        k, _, v = s.partition("=")
        if k == key:
            value = v
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ExampleError(f"{a.config}: {key} is {value!r}, not an integer") from None


def check(a):
    import numpy as np
    import torch
    import transformers

    _steps, evals = read_metrics(os.path.join(a.run, "metrics.jsonl"))
    if len(evals) < 2:
        raise ExampleError(f"{a.run}/metrics.jsonl holds {len(evals)} evaluations; eval_interval should give several")
    for e in evals:
        print(f"{a.name}: validation loss after step {e['step']}: {e['loss']:.4f}")
    first, last = evals[0], evals[-1]
    if not last["loss"] < first["loss"]:
        raise ExampleError(f"the validation loss did not fall: {first['loss']:.4f} at step {first['step']}, "
                           f"{last['loss']:.4f} at step {last['step']}")

    # The last evaluation's samples, as hp-train takes them: sample i is tokens
    # [i * seq, i * seq + seq] of the validation file, the first eval_steps x
    # global_batch_size samples in order; the loss is the mean over every predicted token.
    seq, batch, eval_steps = (setting(a, k) for k in ("seq_length", "global_batch_size", "eval_steps"))
    ids = np.fromfile(a.valid, dtype=np.uint16).astype(np.int64)
    count = eval_steps * batch
    if len(ids) < count * seq + 1:
        raise ExampleError(f"{a.valid}: {len(ids)} tokens, fewer than the {count} samples of {seq + 1} evaluated")
    samples = torch.tensor(np.stack([ids[i * seq:i * seq + seq + 1] for i in range(count)]))

    # transformers 5 names the dtype argument dtype, 4.40 torch_dtype.
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(a.export, **{dtype_key: torch.float32})
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for chunk in samples.split(batch):
            logits = model(chunk[:, :-1]).logits.double()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1),
                                                      reduction="sum").item()
            tokens += chunk[:, 1:].numel()
    theirs = total / tokens
    diff = abs(theirs - last["loss"])
    print(f"{a.name}: transformers' loss of the exported model on those {count} samples: {theirs:.6f} "
          f"(hp-train's {last['loss']:.6f}, relative difference {diff / theirs:.1e})")
    # fp32 throughout on both sides; sums of a few thousand terms of 7-digit numbers:
    # agreement to about 1e-6, so 1e-5 relative leaves room without hiding a wrong weight
    # (a wrong or missing tensor changes the loss by far more; see docs/train.md).
    if not diff <= 1e-5 * theirs:
        raise ExampleError(f"transformers' validation loss {theirs:.6f} differs from hp-train's {last['loss']:.6f} "
                           f"by {diff:.2e} (more than 1e-5 relative)")

    tok = transformers.AutoTokenizer.from_pretrained(a.export)
    prompt = tok(PROMPT, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=48,
                             do_sample=True, top_k=40, temperature=0.7, pad_token_id=tok.eos_token_id)
    new = out[0, prompt["input_ids"].shape[1]:]
    if new.numel() == 0:
        raise ExampleError("transformers generated no tokens from the exported model")
    text = tok.decode(out[0], skip_special_tokens=True)
    print(f"{a.name}: transformers generates ({new.numel()} tokens, sampled: top-k 40, temperature 0.7, seed 0):")
    print("  " + text.replace("\n", "\n  "))
    print(f"{a.name}: perplexity {math.exp(first['loss']):.1f} -> {math.exp(last['loss']):.1f}")
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(prog="hf_example")
    p.add_argument("--name", default="llama_example", help="the example's name, starting each line printed")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="train the tokenizer and save a random model with it")
    m.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("corpus", nargs="+")
    c = sub.add_parser("check", help="after training: validation fell; transformers agrees and generates")
    c.add_argument("--run", required=True, help="hp-train's output_dir")
    c.add_argument("--export", required=True, help="the exported Hugging Face folder")
    c.add_argument("--valid", required=True, help="the validation tokens (uint16)")
    c.add_argument("--config", required=True, help="the hp-train config (seq_length, global_batch_size, eval_steps)")
    c.add_argument("--set", action="append", help="an override given to hp-train, key=value")
    return p.parse_args(argv)


def main(argv):
    a = parse_args(argv)
    try:
        return make_model(a) if a.command == "model" else check(a)
    except ExampleError as e:
        print(f"{a.name}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
