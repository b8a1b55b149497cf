"""benchmarks/results/INDEX.md: every results file, from the provenance it carries.

    python benchmarks/results_index.py            # write INDEX.md
    python benchmarks/results_index.py --check    # exit 1 if INDEX.md is not what it would write

One row per file under benchmarks/results/ (sorted; the layer-profile caches git ignores,
profile_*.json, left out): the benchmark and command that wrote it, the commit of the code that
ran, when, on which machine, whether that code differed from the commit (dirty), and which of
README.md and docs/*.md cite it (as `benchmarks/results/<file>` or `results/<file>`). A JSON
file's provenance is its "provenance" entry (a file of several runs: the newest run's); a text
log's is its first line, `# provenance: {...}` (results_layout.py). Reads no torch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("benchmarks", "results")
INDEX = "INDEX.md"
IGNORED = re.compile(r"profile_.*\.json")  # caches, as .gitignore has them
TEXT_PROVENANCE = "# provenance: "
KEYS = ("measured", "commit", "dirty", "machine", "command")
HEADER = """# Benchmark results

One current file per benchmark and device: `cpu/` this project's 2-core CPU machine, `planner/`
simulated only, `exactness/` measured gradient errors, `megatron_lm/` Megatron-LM's
`pretrain_gpt.py` matrix per megatron-core line, `gpu/<card>/` a GPU's runs (a file of several
runs keeps them oldest first; its provenance is the newest's). Generated from each file's
provenance by `python benchmarks/results_index.py`: do not edit by hand. `dirty`: the code that
ran differed from its commit; a figure quoted in the README needs `false`.

| file | benchmark | command | commit | measured (UTC) | machine | dirty | cited by |
|---|---|---|---|---|---|---|---|
"""
ROW = re.compile(r"^\| \[([^\]]+)\]\(")


def result_files(root: str = ROOT) -> list[str]:
    """The results files under `root`'s benchmarks/results/, relative to it, sorted."""
    base = os.path.join(root, RESULTS)
    found = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), base).replace(os.sep, "/")
            if rel != INDEX and not IGNORED.fullmatch(name):
                found.append(rel)
    return sorted(found)


def read_provenance(path: str) -> Optional[dict]:
    """A results file's provenance (None where it has none)."""
    if path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        return data.get("provenance") if isinstance(data, dict) else None
    with open(path, errors="replace") as f:
        first = f.readline()
    if not first.startswith(TEXT_PROVENANCE):
        return None
    return json.loads(first[len(TEXT_PROVENANCE):])


def run_count(path: str) -> int:
    """How many runs a JSON file keeps (1 but for a file of several runs)."""
    if not path.endswith(".json"):
        return 1
    with open(path) as f:
        data = json.load(f)
    merged = isinstance(data, dict) and set(data) == {"provenance", "runs"}
    return len(data["runs"]) if merged else 1


def doc_files(root: str = ROOT) -> list[str]:
    """README.md and docs/*.md, relative to `root`."""
    docs = sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    named = (["README.md"] if os.path.exists(os.path.join(root, "README.md")) else [])
    return named + [os.path.relpath(d, root).replace(os.sep, "/") for d in docs]


def cites(text: str, rel: str) -> bool:
    """Whether `text` names results file `rel` (benchmarks/results/REL or results/REL)."""
    prefix = r"(?:(?<![\w.-])benchmarks/results/|(?<![\w./-])results/)"
    return re.search(prefix + re.escape(rel) + r"(?![\w/-])", text) is not None


def cited_by(root: str = ROOT) -> dict[str, list[str]]:
    """For each results file, the docs that cite it."""
    texts = {}
    for doc in doc_files(root):
        with open(os.path.join(root, doc), errors="replace") as f:
            texts[doc] = f.read()
    return {rel: [doc for doc, text in texts.items() if cites(text, rel)]
            for rel in result_files(root)}


def benchmark(command: Any) -> str:
    """What wrote a file, from its command: the script, the module, or pytest's test files."""
    tokens = command.split() if isinstance(command, str) else [str(t) for t in command or []]
    if "pytest" in tokens:
        tests = [os.path.basename(t) for t in tokens if t.startswith("tests/")]
        return " ".join(["pytest", *tests])
    scripts = [t for t in tokens if t.endswith(".py")]
    if scripts:
        return os.path.basename(scripts[0])
    if "-m" in tokens[:-1]:
        after = tokens[tokens.index("-m") + 1:]
        return " ".join(after[:2] if len(after) > 1 and not after[1].startswith("-") else after[:1])
    return tokens[0] if tokens else "-"


def machine_text(machine: Any) -> str:
    """A short machine name: the GPU's, else the CPU's and its cores."""
    if isinstance(machine, dict):
        if machine.get("gpu"):
            return str(machine["gpu"])
        cpu = re.sub(r"\((?:R|TM)\)| Processor\b", "", str(machine.get("cpu", "?")))
        return f"{' '.join(cpu.split())}, {machine.get('logical_cores', '?')} cores"
    return str(machine) if machine is not None else "-"


def cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def row(root: str, rel: str, docs: list[str]) -> str:
    path = os.path.join(root, RESULTS, rel)
    origin = read_provenance(path) or {}
    command = origin.get("command")
    runs = run_count(path)
    name = benchmark(command) + (f" ({runs} runs)" if runs > 1 else "")
    text = " ".join(command) if isinstance(command, list) else command or "-"
    measured = (origin.get("measured") or "-").replace("T", " ")[:16]
    dirty = {True: "true", False: "false"}.get(origin.get("dirty"), "unknown")
    commit = (origin.get("commit") or "-")[:7]
    cells = [f"[{rel}]({rel})", name, f"`{text}`", commit, measured,
             machine_text(origin.get("machine")), dirty, ", ".join(docs) or "-"]
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def render(root: str = ROOT) -> str:
    """INDEX.md as it should be."""
    citing = cited_by(root)
    return HEADER + "".join(row(root, rel, citing[rel]) + "\n" for rel in result_files(root))


def indexed_files(index_text: str) -> list[str]:
    """The files an INDEX.md lists."""
    return [m.group(1) for line in index_text.splitlines() if (m := ROW.match(line))]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if INDEX.md is out of date")
    p.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)  # a checkout's root (tests)
    args = p.parse_args(argv)
    path = os.path.join(args.root, RESULTS, INDEX)
    wanted = render(args.root)
    if args.check:
        current = open(path).read() if os.path.exists(path) else None
        if current != wanted:
            print(f"{os.path.relpath(path, args.root)} is out of date: run "
                  "python benchmarks/results_index.py", file=sys.stderr)
            return 1
        return 0
    with open(path, "w") as f:
        f.write(wanted)
    print(f"wrote {os.path.relpath(path, args.root)} ({len(result_files(args.root))} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
