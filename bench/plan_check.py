#!/usr/bin/env python3
"""hp-train --plan against real runs of the same layouts on this machine.

    python3 bench/plan_check.py [build dir] [--sim SPEC] [--worlds 1,2,4] [--steps 10]
                                [--config FILE --set KEY=VALUE ... --only REGEX]

For each world size, asks `hp-train --plan --world N --json` for every layout's predicted
step time, then trains each feasible layout for real (scripts/mpirun.sh N hp-train, the
same config and --set values, HP_SIM_NET=SPEC when --sim is given) and takes the median
step time of the steps after the first two from metrics.jsonl, and the largest tensor
memory peak of any rank. Prints one line per layout with predicted / measured step time
and memory (the sharded state and activations against the peak), and the largest
deviation of the step time.

The default model is a small Llama (MODEL below, over configs/llama_tiny.yaml). With
--config another file is run as it is, with the --set values given (each also sent to
--plan); --only keeps the layouts whose name (as printed) matches REGEX. Each layout runs
with every setting the plan chose for it: the degrees, the pipeline schedule and its stages
per rank, the fully_shard strategy, the expert exchange's dispatcher and overlap chunks,
sequence parallelism, the context-parallel method and the reshard group).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The bench model: a small Llama whose blocks dominate (a 1-layer step is far from noise).
MODEL = [
    "model.dim=256", "model.layers=4", "model.heads=8", "model.kv_heads=4", "model.vocab=2048",
    "seq_length=128", "global_batch_size=16", "micro_batch_num=2",
]


def hp_train(build, n, args, env):
    cmd = [os.path.join(SRC, "scripts/mpirun.sh"), str(n), os.path.join(build, "hp-train")] + args
    if n == 1:
        cmd = cmd[2:]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"plan_check: {' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build", nargs="?", default=os.path.join(SRC, "build"))
    ap.add_argument("--sim", default="", help="HP_SIM_NET spec for the runs and the prediction")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--config", default="")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--only", default="", help="a regular expression on the layout names")
    a = ap.parse_args()
    model = a.set
    if not a.config:
        a.config = os.path.join(SRC, "configs/llama_tiny.yaml")
        given = {kv.split("=")[0] for kv in a.set}
        model = [kv for kv in MODEL if kv.split("=")[0] not in given] + a.set
    env = dict(os.environ)
    env.pop("HP_SIM_NET", None)
    if a.sim:
        env["HP_SIM_NET"] = a.sim
    sets = []
    model = [kv for kv in model if kv.split("=")[0] not in ("train_steps", "log_interval")]
    for kv in model + [f"train_steps={a.steps}", "log_interval=1"]:
        sets += ["--set", kv]
    worst = 0.0
    print(f"config {os.path.relpath(a.config, SRC)} with {' '.join(model)}; network: {a.sim or 'this machine'}")
    print(f"{'world':>5}  {'layout':<60} {'predicted':>10} {'measured':>10} {'ratio':>6}"
          f"   memory: predicted, peak, ratio")
    for n in [int(x) for x in a.worlds.split(",")]:
        plan = [json.loads(l) for l in hp_train(a.build, 1, ["--config", a.config] + sets +
                                                ["--plan", "--world", str(n), "--json"], env).splitlines() if l]
        for row in plan:
            if not row["feasible"]:
                continue
            layout = (f"data_parallel={row['dp_replicate']}", f"data_parallel_shard={row['dp_shard']}",
                      f"context_parallel={row['cp']}", f"expert_parallel={row['ep']}",
                      f"tensor_parallel={row['tp']}", f"pipeline_parallel={row['pp']}",
                      f"pipeline_parallel_interleave_num={row['interleave']}",
                      f"pipeline_schedule={row['schedule']}", f"data_parallel_shard_strategy={row['strategy']}",
                      f"moe_overlap_chunks={row['overlap_chunks']}",
                      f"sequence_parallel={str(row['sequence_parallel']).lower()}",
                      f"moe_dispatcher={row['dispatcher']}", f"context_parallel_method={row['cp_method']}",
                      f"reshard_after_forward_group_size={row['reshard_group']}",
                      "pipeline_stage_layers=[" + ", ".join(str(x) for x in row["stage_layers"]) + "]")
            name = " ".join(x for x in [
                f"dp_replicate={row['dp_replicate']} dp_shard={row['dp_shard']}",
                f"cp={row['cp']}" if row["cp"] > 1 else "", f"ep={row['ep']}" if row["ep"] > 1 else "",
                f"tp={row['tp']} pp={row['pp']}",
                f"({row['schedule']} x{row['interleave']})" if row["pp"] > 1 else "",
                row["strategy"] if row["strategy"] == "optim" else "",
                f"chunks={row['overlap_chunks']}" if row["overlap_chunks"] > 1 else ""] if x)
            if a.only and not re.search(a.only, name):
                continue
            with tempfile.TemporaryDirectory() as out:
                # The layout's settings in place of the same keys among the --set values.
                chosen = {kv.split("=")[0] for kv in layout}
                run = []
                for kv in [kv for kv in model if kv.split("=")[0] not in chosen] + [
                        f"train_steps={a.steps}", "log_interval=1"] + list(layout) + [f"output_dir={out}"]:
                    run += ["--set", kv]
                hp_train(a.build, n, ["--config", a.config] + run, env)
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    lines = [json.loads(l) for l in f if '"step_time_s"' in l]
            steps = [l["step_time_s"] for l in lines]
            peak = max(l["peak_bytes"] for l in lines)
            memory = row["memory_bytes"] + row["activation_bytes"]
            measured = statistics.median(steps[2:])
            ratio = row["step_s"] / measured
            worst = max(worst, abs(ratio - 1))
            print(f"{n:>5}  {name:<60} {row['step_s'] * 1e3:>8.1f}ms {measured * 1e3:>8.1f}ms {ratio:>6.2f}"
                  f"   {memory / 2**20:>6.1f} {peak / 2**20:>6.1f} MiB {memory / peak:>5.2f}", flush=True)
    print(f"largest |predicted / measured - 1|: {worst:.2f}")


if __name__ == "__main__":
    main()
