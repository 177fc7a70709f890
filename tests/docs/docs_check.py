#!/usr/bin/env python3
"""Checks that the README's tables and feature list say what the tree holds.

Fails (exit 1, one line per finding) when:
  - a folder under include/hp/ is missing from the README's Layout table row for headers;
  - a bench program (an add_executable of bench/*.cpp in CMakeLists.txt) or a bench script
    is not named in the README;
  - a docs/*.md file is not linked from the README;
  - a README sentence that calls something planned or not done names a feature a test
    exercises (the features and the tests that exercise them are listed below).
Usage: docs_check.py SOURCE_DIR
"""
import os
import re
import sys

# A feature, the words a README sentence would use for it, and a test file exercising it.
BUILT = [
    ("Hugging Face interchange", ["hugging face"], "tests/ckpt/hf_interop.sh"),
    ("the simulated network", ["simulated network"], "tests/comm/simulated_network_test.cpp"),
    ("tensor parallelism", ["tensor parallel"], "tests/tp/tensor_parallel_test.cpp"),
    ("expert parallelism", ["expert parallel"], "tests/ep/dispatch_test.cpp"),
    ("pipeline parallelism", ["pipeline parallel", "pipeline schedule"], "tests/pp/pipeline_test.cpp"),
    ("distributed checkpoints", ["distributed checkpoint"], "tests/ckpt/checkpoint_test.cpp"),
    ("activation recomputation", ["recompute", "activation checkpointing"], "tests/hooks/recompute_test.cpp"),
    ("the layout planner", ["planner", "--plan"], "tests/train/plan_test.cpp"),
    ("model families", ["model family", "model-family"], "tests/train/toy_family.h"),
]
PLANNED = re.compile(r"\b(planned|not done yet|not yet built|to do)\b", re.IGNORECASE)


def sentences(text):
    out = []
    for para in re.split(r"\n\s*\n", text):
        out += re.split(r"(?<=[.;])\s", re.sub(r"\s+", " ", para))
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    errors = []

    header_row = next((l for l in readme.splitlines() if l.startswith("| `include/hp/<layer>/`")), "")
    if not header_row:
        errors.append("README: the Layout table has no `include/hp/<layer>/` row")
    for d in sorted(os.listdir(os.path.join(root, "include", "hp"))):
        if os.path.isdir(os.path.join(root, "include", "hp", d)) and f"`{d}`" not in header_row:
            errors.append(f"README: include/hp/{d}/ is missing from the Layout table's header row")

    cmake = open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8").read()
    for name in re.findall(r"add_executable\((\w+) bench/", cmake):
        if f"`{name}`" not in readme:
            errors.append(f"README: the bench program {name} is not named")
    for f in sorted(os.listdir(os.path.join(root, "bench"))):
        if f.endswith(".sh") and f"`{f}`" not in readme:
            errors.append(f"README: the bench script {f} is not named")

    for f in sorted(os.listdir(os.path.join(root, "docs"))):
        if f.endswith(".md") and f"docs/{f}" not in readme:
            errors.append(f"README: docs/{f} is not linked")

    for s in sentences(readme):
        if not PLANNED.search(s):
            continue
        low = s.lower()
        for feature, words, test in BUILT:
            if not os.path.exists(os.path.join(root, test)):
                errors.append(f"docs_check: {test} (which exercises {feature}) does not exist; update BUILT")
                continue
            if any(w in low for w in words):
                errors.append(f"README calls {feature} planned or not done, but {test} exercises it: \"{s.strip()}\"")

    for e in errors:
        print(e)
    print(f"docs_check: {len(errors)} finding(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
