"""What the Hugging Face interchange tests share: hyperparallel's logits for a model folder
(hf_logits), the comparison of logits, a training run of hp-train exported with --export-hf,
and the check of its checkpoint by hp_checkpoint.py, the independent reader."""
import os
import shutil
import subprocess

import torch
from safetensors.torch import load_file, save_file

from hp_checkpoint import Checkpoint, read_safetensors

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "..", "..", "configs")


class Interop:
    def __init__(self, hf_logits, hp_train, work, mpirun, bound):
        self.hf_logits, self.hp_train, self.work, self.mpirun, self.bound = hf_logits, hp_train, work, mpirun, bound
        self.results = []
        os.makedirs(work, exist_ok=True)

    def check(self, name, ok, detail):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        self.results.append(bool(ok))

    def tokens_file(self, vocab, shape=(2, 12)):
        torch.manual_seed(7)
        tokens = torch.randint(0, vocab, shape, dtype=torch.int64)
        path = os.path.join(self.work, "tokens.safetensors")
        save_file({"tokens": tokens}, path)
        return tokens, path

    def ours(self, model_dir, tokens_path):
        out = os.path.join(self.work, "ours.safetensors")
        subprocess.run([self.hf_logits, model_dir, tokens_path, out], check=True)
        return load_file(out)["logits"]

    def compare(self, name, theirs, mine):
        rel = ((theirs - mine).abs().max() / theirs.abs().max()).item()
        self.check(name, theirs.shape == mine.shape and rel <= self.bound,
                   f"logits {tuple(mine.shape)}, max difference {rel:.2e} of the largest (bound {self.bound:.0e})")

    def yarn_case(self, name, model, folder, unscaled_too):
        """`model`'s logits over 80 tokens against hyperparallel's of `folder`; with
        `unscaled_too`, the folder's config.json then says plain rotary, and its logits must
        differ (so that the case tests the scaling)."""
        import json
        tokens, tpath = self.tokens_file(256, shape=(2, 80))
        with torch.no_grad():
            theirs = model(tokens).logits
        self.compare("import " + name, theirs, self.ours(folder, tpath))
        if not unscaled_too:
            return
        path = os.path.join(folder, "config.json")
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
        c["rope_parameters"] = {"rope_theta": c.get("rope_parameters", {}).get("rope_theta", 10000.0), "rope_type": "default"}
        c.pop("rope_scaling", None)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(c, f)
        rel = ((theirs - self.ours(folder, tpath)).abs().max() / theirs.abs().max()).item()
        self.check("yarn changes the logits", rel > 1e-3, f"read as unscaled: {rel:.2e} of the largest")

    def perturbed(self, model, name, **save_args):
        """`model` with every parameter moved by 0.05 N(0, 1) (so that a swapped norm,
        projection or bias shows), saved by save_pretrained to a new folder; returns it."""
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        folder = self.folder("hf_" + name)
        model.save_pretrained(folder, **save_args)
        return folder

    def folder(self, name):
        path = os.path.join(self.work, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def launch(self, cmd, ranks):
        if self.mpirun and ranks > 1:
            cmd = [self.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none"] + cmd
        return cmd

    def train_and_export(self, name, config, sets, ranks):
        """Trains with hp-train (`sets` on top of configs/`config`) over `ranks` ranks (one
        without mpirun), saves at the end and exports the checkpoint in 60 KB files. Returns
        the export folder and the checkpoint's folder."""
        out = self.folder("run_" + name)
        cmd = [self.hp_train, "--config", os.path.join(CONFIGS, config)]
        for s in sets + ["output_dir=" + out]:
            cmd += ["--set", s]
        subprocess.run(self.launch(cmd, ranks), check=True, stdout=subprocess.DEVNULL)
        folder = self.folder("exported_" + name)
        saves = os.path.join(out, "checkpoints")
        export = [self.hp_train, "--export-hf", saves, folder, "--max-shard-size", "60KB"]
        subprocess.run(self.launch(export, ranks), check=True)
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        print(f"exported {name}: {', '.join(files)}")
        if len(files) < 2:
            self.check("export " + name, False, "one file, expected several at 60KB each")
        with open(os.path.join(saves, "latest"), encoding="utf-8") as f:
            return folder, os.path.join(saves, f.read().strip())

    def checkpoint_case(self, name, ckpt_dir, exported, split_expected):
        """The checkpoint read by the independent reader against the export's tensors: every
        exported tensor equals, byte for byte, exactly one tensor of the checkpoint."""
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
        self.check("checkpoint " + name, not problems and matched > 0 and (split > 0 or not split_expected),
                   f"{len(ckpt.tensors)} tensors ({split} split in chunks), {ckpt.blocks_checked} checksummed blocks, "
                   f"{matched} exported tensors each equal to one of them" + (": " + "; ".join(problems[:4]) if problems else ""))

    def finish(self):
        passed = sum(self.results)
        print(f"{passed} passed, {len(self.results) - passed} failed")
        return 0 if passed == len(self.results) else 1
