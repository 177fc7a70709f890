#!/usr/bin/env python3
"""Draws the loss curves of several hp-train runs in one SVG (standard library only).

Usage: scripts/compare_runs.py OUT.svg LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--title TEXT] [--smooth N]

Each RUN_DIR holds an hp-train run's metrics.jsonl. Its training loss is drawn as a line (the
mean of the last N steps with --smooth N, default 1: as logged), its validation losses as
dots on a line of the same colour. Prints each run's last training loss (smoothed) and
last validation loss. Lines that are not JSON objects with a "step" or "eval" record are
skipped; a run without any step is an error naming its file.
"""
import json
import math
import os
import sys

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def read_run(path):
    steps, evals = [], []
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
                elif isinstance(j.get("eval"), dict) and isinstance(j["eval"].get("loss"), (int, float)):
                    evals.append((int(j["eval"]["step"]), float(j["eval"]["loss"])))
    except OSError as e:
        sys.exit("compare_runs.py: cannot read %s: %s" % (name, e.strerror))
    if not steps:
        sys.exit("compare_runs.py: %s holds no training step" % name)
    return steps, evals


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
        steps, evals = read_run(path)
        data.append((label, smooth(steps, n), evals))
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
