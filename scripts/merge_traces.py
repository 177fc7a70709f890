#!/usr/bin/env python3
"""Merge per-rank Chrome trace-event files into one file.

hyperparallel writes one file per rank (HP_TRACE=dir gives dir/trace_rank<R>.json), each
an object {"traceEvents": [...]} whose events carry the rank as their pid. This script
concatenates the events of all inputs, unchanged, so every rank stays its own process
track in the merged view. A bare JSON list of events is accepted as input too. Other
top-level keys (such as displayTimeUnit) are taken from the first input that has them.

Usage:
  python3 scripts/merge_traces.py traces/trace_rank*.json -o merged.json

Open the result in https://ui.perfetto.dev or chrome://tracing.
"""

import argparse
import json
import sys


def load_events(path):
    """Returns (events, other top-level keys) of one trace file."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, {}
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        rest = {k: v for k, v in data.items() if k != "traceEvents"}
        return data["traceEvents"], rest
    raise ValueError(f"{path}: not a Chrome trace (expected a list of events or an object "
                     f"with a 'traceEvents' list)")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Merge Chrome trace-event JSON files (one per rank) into one file.")
    parser.add_argument("inputs", nargs="+", help="trace files, e.g. dir/trace_rank*.json")
    parser.add_argument("-o", "--output", required=True, help="merged trace file to write")
    args = parser.parse_args(argv)

    merged = {}
    events = []
    owner_of_pid = {}  # pid -> first input that had it, to warn about clashes
    for path in args.inputs:
        try:
            file_events, rest = load_events(path)
        except (OSError, ValueError) as e:
            print(f"merge_traces.py: {e}", file=sys.stderr)
            return 1
        for key, value in rest.items():
            merged.setdefault(key, value)
        pids = {e.get("pid") for e in file_events if isinstance(e, dict) and "pid" in e}
        for pid in sorted(pids, key=str):
            first = owner_of_pid.setdefault(pid, path)
            if first != path:
                print(f"merge_traces.py: warning: pid {pid} appears in both {first} and "
                      f"{path}; their events will share one process track", file=sys.stderr)
        events.extend(file_events)

    merged["traceEvents"] = events
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(merged, f)
        f.write("\n")
    print(f"merge_traces.py: wrote {len(events)} events from {len(args.inputs)} file(s) "
          f"to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
