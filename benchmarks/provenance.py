"""Where a benchmark's results file came from: when, which code, which machine, which command.

Every benchmark that writes a results JSON puts `provenance(command)` at its top under
"provenance", so a figure quoted from the file can be traced to a date, a commit and a machine:

- measured: when it was taken, at the start of the run (ISO 8601, UTC);
- commit: `git rev-parse HEAD` of this checkout; dirty: True when files under
  megatron_terapipe/, benchmarks/ or tests/harness/ (the code a benchmark runs) differ from it
  or are new (untracked, not ignored),
  with the paths in dirty_paths (benchmarks/results/ is data, not code: left out). The
  environment variable TERAPIPE_BENCH_COMMIT, when set, names the commit instead (a device
  machine's copy of the tree can carry git metadata older than the tree), the
  git view kept as git_commit; outside a git checkout without it the commit is null;
  commit_source says which;
- machine: CPU model, logical cores, the cores this process may run on, the load average when
  the run started, torch and Python versions, the platform, and the GPU's name under CUDA;
- command: the argv that wrote the file.

    python benchmarks/provenance.py --stamp FILE -- COMMAND...   # add it to a JSON written
                                                                 # by a command of the package
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What a benchmark runs: changes here make the checkout's commit not the code that ran.
CODE_PATHS = ("megatron_terapipe", "benchmarks", "tests/harness")
DATA_PATHS = ("benchmarks/results",)
COMMIT_VARIABLE = "TERAPIPE_BENCH_COMMIT"


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_state() -> dict[str, Any]:
    """The checkout's commit and whether the code a benchmark runs differs from it."""
    head = _git("rev-parse", "HEAD")
    given = os.environ.get(COMMIT_VARIABLE) or None
    if head is None:
        return {"commit": given, "commit_source": COMMIT_VARIABLE if given else "unknown (not a "
                f"git checkout; set {COMMIT_VARIABLE})", "dirty": None, "dirty_paths": None}
    pathspecs = [*CODE_PATHS, *(f":(exclude){p}" for p in DATA_PATHS)]
    changed = _git("diff", "--name-only", "HEAD", "--", *pathspecs) or ""
    # new files the commit does not have are code it did not run either (a new benchmark)
    new = _git("ls-files", "--others", "--exclude-standard", "--", *pathspecs) or ""
    paths = sorted({p for p in (changed + "\n" + new).splitlines() if p})
    if given and given != head:  # the caller's word for the tree; git's view kept beside it
        return {"commit": given, "commit_source": COMMIT_VARIABLE, "git_commit": head,
                "dirty": None, "dirty_paths": paths}
    return {"commit": head, "commit_source": "git", "dirty": bool(paths), "dirty_paths": paths}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict[str, Any]:
    import torch

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": _cpu_model(), "logical_cores": os.cpu_count(), "affinity": affinity,
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "gpu": gpu}


def provenance(command: list[str]) -> dict[str, Any]:
    """The "provenance" entry of a results file written by `command` (its argv)."""
    return {"measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **code_state(), "machine": machine(), "command": list(command)}


def describe(origin: dict[str, Any]) -> str:
    """One line for a benchmark's log: the machine and the code."""
    m = origin["machine"]
    code = (origin["commit"] or "unknown commit")[:12] + (" (modified)" if origin["dirty"] else "")
    return (f"{m['cpu']}, {m['logical_cores']} cores ({len(m['affinity'] or [])} usable), "
            f"load {m['load_average']}, torch {m['torch']}, Python {m['python']}"
            + (f", {m['gpu']}" if m["gpu"] else "") + f"; code at {code}")


def script_command(script: str, argv: Optional[list[str]] = None) -> list[str]:
    """The command line of a benchmark script: python, its path from the repository root, and
    its arguments (`argv`, else this process's)."""
    path = os.path.relpath(os.path.abspath(script), ROOT)
    return ["python", path, *(sys.argv[1:] if argv is None else argv)]


def rows_on_checkout(script: str, checkout: str, args: list[str]) -> Any:
    """What `script args` prints as JSON on its last line, run in a child process whose
    package is the one at `checkout` (another checkout's root, e.g. a `git worktree` of an
    older commit): a benchmark's --baseline side, in the same process tree as its own."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    out = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def stamp(path: str, command: list[str]) -> None:
    """Add the provenance of `command` to the JSON object in `path`, in place."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise SystemExit(f"--stamp {path}: the file holds a JSON {type(data).__name__}, not an "
                         "object: only an object can carry a provenance entry")
    with open(path, "w") as f:
        # first, so that a results file's first lines say where it came from
        json.dump({"provenance": provenance(command),
                   **{k: v for k, v in data.items() if k != "provenance"}}, f, indent=1)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stamp", metavar="FILE", help="add the provenance to this JSON file")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command that wrote it")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.stamp:
        if not command:
            p.error("--stamp FILE needs the command that wrote FILE after --")
        stamp(args.stamp, command)
    else:
        print(json.dumps(provenance(command), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
