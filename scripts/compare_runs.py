#!/usr/bin/env python3
"""Draws the loss curves of several hp-train runs in one SVG (standard library only).

Usage: scripts/compare_runs.py OUT.svg LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--title TEXT] [--smooth N]

Each RUN_DIR holds an hp-train run's metrics.jsonl. Its training loss is drawn as a line (the
mean of the last N steps with --smooth N, default 1: as logged), its validation losses as
dots on a line of the same colour. Prints each run's last training loss (smoothed) and
last validation loss; where the metrics have them, its median step time, optimizer step
time (and its share of the rest of the step) and bytes sent per step, each over the steps
after the first; and for every run after the first, the step at which its validation loss
first reaches the first run's last one (linear between validations), as a fraction of the
first run's steps: the share of its tokens needed for that loss at the same batch. Lines
that are not JSON objects with a "step" or "eval" record are skipped; a run without any
step is an error naming its file.
"""
import json
import math
import os
import sys

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


FIGURES = ("step_time_s", "optimizer_time_s", "comm_bytes", "optimizer_comm_bytes")


def read_run(path):
    steps, evals = [], []
    figures = {k: [] for k in FIGURES}
    name = os.path.join(path, "metrics.jsonl")
    try:
        with open(name) as f:
            for line in f:
                try:
                    j = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(j, dict):
                    continue
                if "step" in j and isinstance(j.get("loss"), (int, float)):
                    steps.append((int(j["step"]), float(j["loss"])))
                    for k in FIGURES:
                        if isinstance(j.get(k), (int, float)) and int(j["step"]) > 1:
                            figures[k].append(float(j[k]))
                elif isinstance(j.get("eval"), dict) and isinstance(j["eval"].get("loss"), (int, float)):
                    evals.append((int(j["eval"]["step"]), float(j["eval"]["loss"])))
    except OSError as e:
        sys.exit("compare_runs.py: cannot read %s: %s" % (name, e.strerror))
    if not steps:
        sys.exit("compare_runs.py: %s holds no training step" % name)
    return steps, evals, figures


def median(v):
    v = sorted(v)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def describe_figures(f):
    """The step's time, the optimizer's and the bytes, or "" where the metrics lack them."""
    out = []
    if f["step_time_s"]:
        out.append("median step %.1f ms" % (1e3 * median(f["step_time_s"])))
    if f["optimizer_time_s"] and len(f["optimizer_time_s"]) == len(f["step_time_s"]):
        share = [o / (t - o) for o, t in zip(f["optimizer_time_s"], f["step_time_s"]) if t > o]
        out.append("optimizer step %.1f ms (%.1f%% of the rest)" % (1e3 * median(f["optimizer_time_s"]),
                                                                   100 * median(share) if share else float("nan")))
    if f["comm_bytes"]:
        out.append("sent %.3f MiB/step (optimizer %.3f)" % (sum(f["comm_bytes"]) / len(f["comm_bytes"]) / 2**20,
                                                            sum(f["optimizer_comm_bytes"]) / max(1, len(f["optimizer_comm_bytes"])) / 2**20))
    return ", ".join(out)


def first_reaching(evals, target):
    """The step, linear between validations, at which `evals` first reaches `target`; None if never."""
    prev = None
    for k, v in evals:
        if v <= target:
            if prev is None or prev[1] == v:
                return float(k)
            return prev[0] + (k - prev[0]) * (prev[1] - target) / (prev[1] - v)
        prev = (k, v)
    return None


def smooth(points, n):
    out = []
    for i in range(len(points)):
        window = points[max(0, i - n + 1):i + 1]
        out.append((points[i][0], sum(v for _, v in window) / len(window)))
    return out


def main(argv):
    title, n, out, runs = "training loss", 1, None, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--title", "--smooth"):
            if i + 1 >= len(argv):
                sys.exit("compare_runs.py: %s needs a value" % a)
            if a == "--title":
                title = argv[i + 1]
            else:
                try:
                    n = int(argv[i + 1])
                except ValueError:
                    n = 0
                if n < 1:
                    sys.exit("compare_runs.py: --smooth '%s': expected a whole number >= 1" % argv[i + 1])
            i += 2
            continue
        if out is None:
            out = a
        elif "=" in a:
            label, path = a.split("=", 1)
            runs.append((label, path))
        else:
            sys.exit("compare_runs.py: '%s': expected LABEL=RUN_DIR" % a)
        i += 1
    if out is None or not runs:
        sys.exit(__doc__)
    data = []
    for label, path in runs:
        steps, evals, figures = read_run(path)
        data.append((label, smooth(steps, n), evals))
        text = describe_figures(figures)
        if text:
            print("%s: %s" % (label, text))
    base_label, _, base_evals = data[0]
    for label, s, e in data[1:]:
        if not base_evals or not e:
            continue
        target, steps_done = base_evals[-1][1], base_evals[-1][0]
        k = first_reaching(e, target)
        if k is None:
            print("%s: never reaches %s's last validation loss %.4f" % (label, base_label, target))
        else:
            print("%s: reaches %s's last validation loss %.4f at step %.0f of its %d: %.2f of the tokens" %
                  (label, base_label, target, k, steps_done, k / steps_done))
    values = [v for _, s, e in data for _, v in s + e if math.isfinite(v)]
    steps = [k for _, s, e in data for k, _ in s + e]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        hi = lo + 1
    first, last = min(steps), max(steps)
    if last == first:
        last = first + 1
    W, H, L, R, T, B = 720.0, 420.0, 70.0, 20.0, 40.0, 50.0

    def X(k):
        return L + (W - L - R) * (k - first) / (last - first)

    def Y(v):
        return T + (H - T - B) * (hi - v) / (hi - lo)

    def esc(s):
        return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%g" height="%g" font-family="sans-serif" font-size="12">' % (W, H),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%g" y="22" text-anchor="middle" font-size="14">%s</text>' % (W / 2, esc(title))]
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        svg.append('<line x1="%g" y1="%.1f" x2="%g" y2="%.1f" stroke="#ddd"/>' % (L, Y(v), W - R, Y(v)))
        svg.append('<text x="%g" y="%.1f" text-anchor="end">%.3g</text>' % (L - 6, Y(v) + 4, v))
        s = first + (last - first) * k // 4
        svg.append('<text x="%.1f" y="%g" text-anchor="middle">%d</text>' % (X(s), H - B + 18, s))
    svg.append('<text x="%g" y="%g" text-anchor="middle">step</text>' % ((L + W - R) / 2, H - 12))
    svg.append('<rect x="%g" y="%g" width="%g" height="%g" fill="none" stroke="#444"/>' % (L, T, W - L - R, H - T - B))
    for i, (label, s, e) in enumerate(data):
        c = COLOURS[i % len(COLOURS)]
        pts = " ".join("%.1f,%.1f" % (X(k), Y(v)) for k, v in s if math.isfinite(v))
        svg.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>' % (c, pts))
        if e:
            pts = " ".join("%.1f,%.1f" % (X(k), Y(v)) for k, v in e if math.isfinite(v))
            svg.append('<polyline fill="none" stroke="%s" stroke-width="1" stroke-dasharray="4 3" points="%s"/>' % (c, pts))
            for k, v in e:
                if math.isfinite(v):
                    svg.append('<circle cx="%.1f" cy="%.1f" r="3.5" fill="%s"/>' % (X(k), Y(v), c))
        svg.append('<text x="%g" y="%g" text-anchor="end" fill="%s">%s%s</text>' %
                   (W - R - 8, T + 16 * (i + 1), c, esc(label), " (dots: validation)" if e else ""))
        print("%s: last training loss %.4f%s%s" % (label, s[-1][1], " (mean of %d steps)" % n if n > 1 else "",
                                                  ", last validation loss %.4f at step %d" % (e[-1][1], e[-1][0]) if e else ""))
    svg.append("</svg>")
    with open(out + ".partial", "w") as f:
        f.write("\n".join(svg) + "\n")
    os.replace(out + ".partial", out)


if __name__ == "__main__":
    main(sys.argv[1:])
