"""Where benchmarks/results/ keeps each benchmark's current file, and how to read one.

One file per benchmark and device, named for the benchmark: cpu/<name>.json for this project's
CPU machine, planner/<name>.json for what is only simulated, gpu/<card>/<name>.json for a GPU
("h100", "h200"). A rerun with a benchmark's default --out replaces its file. A file that keeps
several runs of one benchmark is {"provenance": <the newest run's>, "runs": [<run>, ...]}, oldest
first, each run whole (its own provenance inside); `--append`, where a benchmark offers it, adds
its run so. The layer profiles a GPU run planned on, which re-simulation needs, are inside the
run under "profiles" ({file name: profile}); their cached copies beside the file are ignored
by git (profile_*.json). A smoke run on a machine without the benchmark's device writes to a
scratch folder, never here. Text logs carry their provenance on a first line
`# provenance: {...}`. INDEX.md lists every file (results_index.py writes it).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
#: where smoke runs and runs of a GPU benchmark on CPU go by default: not results
SCRATCH = os.path.join(tempfile.gettempdir(), "megatron_terapipe_bench")
PROFILE_PATTERN = re.compile(r"profile_.*\.json")


def card_name(gpu_name: str) -> str:
    """A GPU's short name for its folder: "NVIDIA H100 80GB HBM3" -> "h100"."""
    found = re.search(r"\b[A-Z]\d{2,4}[A-Z]?\b", gpu_name)
    word = found.group(0) if found else gpu_name.split()[-1]
    return re.sub(r"[^a-z0-9]+", "_", word.lower()).strip("_") or "gpu"


def device_folder(device: str) -> str:
    """The results folder of this machine's `device` ("cpu", or "cuda": the card's folder)."""
    if device == "cpu":
        return os.path.join(RESULTS, "cpu")
    import torch

    return os.path.join(RESULTS, "gpu", card_name(torch.cuda.get_device_name(0)))


def default_out(name: str, device: str, scratch: bool = False) -> str:
    """A benchmark's default results file `name` for `device`; in SCRATCH for a smoke run."""
    return os.path.join(SCRATCH if scratch else device_folder(device), name)


def output_paths(out: str, folder_file: str) -> tuple[str, str]:
    """(the JSON to write, the folder for caches and charts) for an --out that is a JSON file
    or, as a device session passes it, a folder (the JSON then named `folder_file` in it)."""
    if out.endswith(".json"):
        return out, os.path.dirname(out) or "."
    return os.path.join(out, folder_file), out


def is_merged(data: Any) -> bool:
    """Whether `data` is a file of several runs (each with its own provenance)."""
    return (isinstance(data, dict) and set(data) == {"provenance", "runs"}
            and isinstance(data["runs"], list)
            and all(isinstance(r, dict) and "provenance" in r for r in data["runs"]))


def load_runs(path: str) -> list[dict]:
    """The runs a results JSON holds, oldest first (one for a single-run file)."""
    with open(path) as f:
        data = json.load(f)
    return list(data["runs"]) if is_merged(data) else [data]


def latest_run(path: str) -> dict:
    return load_runs(path)[-1]


def write_runs(path: str, runs: list[dict]) -> None:
    """Write `runs` (oldest first) as one results file: the run itself when there is one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = runs[0] if len(runs) == 1 else {"provenance": runs[-1]["provenance"], "runs": runs}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def earlier_runs(path: str, append: bool) -> list[dict]:
    """The runs a new run joins: the file's, with --append; none when it replaces the file."""
    return load_runs(path) if append and os.path.exists(path) else []


def with_profiles(run: dict, paths: list[str]) -> dict:
    """`run` with the layer profiles at `paths` (those that exist) inside, by file name."""
    profiles = {}
    for path in sorted(set(paths)):
        if os.path.exists(path):
            with open(path) as f:
                profiles[os.path.basename(path)] = json.load(f)
    return {**run, "profiles": profiles} if profiles else run


def unpack_profiles(run: dict, folder: str) -> list[str]:
    """Write the profiles inside `run` as files in `folder` (where a reader expects its cache)."""
    os.makedirs(folder, exist_ok=True)
    written = []
    for name, profile in sorted(run.get("profiles", {}).items()):
        if not PROFILE_PATTERN.fullmatch(name):
            raise ValueError(f"{name}: not a profile file name")
        written.append(os.path.join(folder, name))
        with open(written[-1], "w") as f:
            json.dump(profile, f, indent=1)
    return written


def profile_file(spec: str, folder: Optional[str] = None) -> str:
    """A layer profile's path from `spec`: a file under RESULTS, or "FILE#NAME" for the profile
    NAME inside FILE's newest run (written to `folder`, a scratch folder by default)."""
    if "#" not in spec:
        return os.path.join(RESULTS, spec)
    path, name = spec.split("#", 1)
    run = latest_run(os.path.join(RESULTS, path))
    if name not in run.get("profiles", {}):
        raise KeyError(f"{path}: its newest run holds no profile {name}")
    folder = folder or os.path.join(SCRATCH, "profiles", os.path.dirname(path))
    unpack_profiles({"profiles": {name: run["profiles"][name]}}, folder)
    return os.path.join(folder, name)
