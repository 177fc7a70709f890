#!/usr/bin/env python3
"""Checks that the README's tables and feature list say what the tree holds.

Fails (exit 1, one line per finding) when:
  - a folder under include/hp/ is missing from the README's Layout table row for headers;
  - a bench program (an add_executable of bench/*.cpp in CMakeLists.txt) or a bench script
    is not named in the README;
  - a docs/*.md file is not linked from the README;
  - a README sentence that calls something planned or not done names a feature a test
    exercises (the features and the tests that exercise them are listed below).
  - an environment variable read anywhere (a knob declared in src/core/env.cpp, a getenv of
    an HP_ name in src/, apps/, tests/ or bench/, an HP_ variable a script reads) is not
    named in docs/env.md;
  - a folder under src/ is not named in docs/architecture.md's layer table;
  - a config key hp-train --list-keys prints (given HP_TRAIN_BIN as a second argument) is not
    named in docs/train.md.
Usage: docs_check.py SOURCE_DIR [HP_TRAIN_BIN]
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


def files_under(root, folders, exts):
    for folder in folders:
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for n in names:
                if n.endswith(exts):
                    yield os.path.join(dirpath, n)


def env_findings(root):
    """Every HP_ environment variable read anywhere must be named in docs/env.md."""
    read = {}
    env_cpp = open(os.path.join(root, "src", "core", "env.cpp"), encoding="utf-8").read()
    for name in re.findall(r'\{"(HP_[A-Z0-9_]+)",', env_cpp):
        read[name] = "src/core/env.cpp"
    for path in files_under(root, ["src", "apps", "tests", "bench", "include"], (".cpp", ".h", ".cc")):
        text = open(path, encoding="utf-8", errors="replace").read()
        for name in re.findall(r'getenv\("(HP_[A-Z0-9_]+)"', text):
            read.setdefault(name, os.path.relpath(path, root))
    for path in files_under(root, ["scripts", "bench", "tests"], (".sh",)):
        text = open(path, encoding="utf-8", errors="replace").read()
        for name in re.findall(r"\$\{?(HP_[A-Z0-9_]+)", text):
            read.setdefault(name, os.path.relpath(path, root))
    env_md = open(os.path.join(root, "docs", "env.md"), encoding="utf-8").read()
    found = [f"docs/env.md: {name} (read by {where}) is not named" for name, where in sorted(read.items())
             if f"`{name}`" not in env_md]
    # The README says every variable the library reads is declared in src/core/env.cpp: one
    # the library reads past it must be named there as the exception.
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    declared = set(re.findall(r'\{"(HP_[A-Z0-9_]+)",', env_cpp))
    for path in files_under(root, ["src", "apps", "include"], (".cpp", ".h")):
        text = open(path, encoding="utf-8", errors="replace").read()
        for name in sorted(set(re.findall(r'getenv\("(HP_[A-Z0-9_]+)"', text)) - declared):
            if f"`{name}`" not in readme:
                found.append(f"README: {name}, read by {os.path.relpath(path, root)} outside src/core/env.cpp, "
                             "is not named as an exception to 'declared once'")
    return found


def layer_findings(root):
    """docs/architecture.md names every folder under src/, every public header, every flag of
    include/hp/config.h.in and every bench program."""
    arch = open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8").read()
    found = [f"docs/architecture.md: src/{d}/ is not named" for d in sorted(os.listdir(os.path.join(root, "src")))
             if os.path.isdir(os.path.join(root, "src", d)) and f"`src/{d}/`" not in arch]
    for path in sorted(files_under(root, ["include/hp"], (".h",))):
        name = os.path.basename(path)
        if f"`{name}`" not in arch and f"`{os.path.relpath(path, os.path.join(root, 'include'))}`" not in arch:
            found.append(f"docs/architecture.md: the public header {os.path.relpath(path, root)} is not named")
    config_in = open(os.path.join(root, "include", "hp", "config.h.in"), encoding="utf-8").read()
    for flag in re.findall(r"#define (HP_[A-Z0-9_]+)", config_in):
        if f"`{flag}`" not in arch:
            found.append(f"docs/architecture.md: config.h's {flag} is not named")
    cmake = open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8").read()
    for name in re.findall(r"add_executable\((\w+) bench/", cmake):
        if f"`{name}`" not in arch:
            found.append(f"docs/architecture.md: the bench program {name} is not named")
    return found


def key_findings(root, hp_train):
    """Every key hp-train --list-keys prints must be named in docs/train.md."""
    import subprocess
    out = subprocess.run([hp_train, "--list-keys"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return [f"docs_check: {hp_train} --list-keys failed: {out.stderr.strip()[:200]}"]
    keys = [line.split()[0] for line in out.stdout.splitlines() if line and not line[0].isspace()]
    train_md = open(os.path.join(root, "docs", "train.md"), encoding="utf-8").read()
    return [f"docs/train.md: the config key {k} is not named" for k in keys if f"`{k}`" not in train_md]


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

    errors += env_findings(root)
    errors += layer_findings(root)
    if len(sys.argv) > 2:
        errors += key_findings(root, sys.argv[2])

    for e in errors:
        print(e)
    print(f"docs_check: {len(errors)} finding(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
