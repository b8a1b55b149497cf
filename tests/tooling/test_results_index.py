"""benchmarks/results/ holds the present, and the README and docs quote it as it is.

Each check is a function of a checkout's root that returns its problems (empty: none), run on
this checkout and, with a fault planted, on a small tree in tmp_path (so a check that cannot
fail would show). No torch: this runs in a moment.
- the INDEX is what results_index.py writes now; it lists every results file, and each file
  carries its provenance; at most MAX_FILES files;
- every `benchmarks/results/...` path README.md and docs/*.md cite exists;
- every results file README.md cites was measured on clean code (dirty false);
- docs/ holds no commit hash and no date outside results paths;
- each README figure in FIGURES is its results file's value, as formatted.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from typing import Any, Callable

import pytest

import results_index as index

ROOT = index.ROOT  # this checkout (found without the harness: no torch)

MAX_FILES = 40
CITED = re.compile(r"benchmarks/results/[\w./-]*[\w/]")
RESULTS_PATH = re.compile(r"(?:benchmarks/)?results/[\w./*<>-]+")
#: 7-40 hex characters with a digit and a letter, as a whole word (lowercase, as git prints)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def speedup(case: str, config: str) -> Callable[[dict], float]:
    """A bench_schedules row's median ratio to Megatron's 1F1B."""
    return lambda data: next(r["speedup_vs_megatron"] for r in data["speed"]
                             if r["case"] == case and r["config"] == config)


def newest_clean_run(data: dict) -> dict:
    """The newest run of a file of runs (oldest first), which must come from a clean tree."""
    run = data["runs"][-1] if "runs" in data else data
    assert run["provenance"]["dirty"] is False, "a quoted run must come from a clean tree"
    return run


def gpu_pipeline(case: str, config: str) -> Callable[[dict], float]:
    """A GPU pipeline row's ratio to Megatron 1F1B's faster row (eager or graphed)."""
    return lambda data: next(r["speedup_vs_fastest_megatron"]
                             for r in newest_clean_run(data)["rows"]
                             if r["case"] == case and r["config"] == config)


def virtual(config: str, baseline: str = "megatron_1f1b") -> Callable[[dict], float]:
    """A virtual-stage row's ratio to Megatron's 1F1B (or interleaved) schedule."""
    return lambda data: next(r[f"speedup_vs_{baseline}"] for r in newest_clean_run(data)["speed"]
                             if r["config"] == config)


def megatron_lm_v(row: str, baseline: str = "megatron_1f1b") -> Callable[[dict], float]:
    """A bench_megatron_lm_v row's median per-round ratio to a baseline row."""
    def ratio(data: dict) -> float:
        assert data["provenance"]["dirty"] is False, "a quoted run must come from a clean tree"
        rounds = {r["row"]: r["rounds_s"] for r in data["rows"]}
        return statistics.median(b / x for b, x in zip(rounds[baseline], rounds[row]))
    return ratio


def stage_ratio(slices: int) -> Callable[[dict], float]:
    """One graphed GPU stage's time with `slices` slices over its time with one."""
    return lambda data: next(r["ratio_to_1_slice"] for r in newest_clean_run(data)["rows"]
                             if r["graphed"] and r["slices"] == slices)


def megatron_lm_speed(data: dict) -> float:
    """TeraPipe's speed over `1f1b` in Megatron-LM's pretrain_gpt.py, from its logs' summary."""
    logs = data["logs"]
    assert logs["provenance"]["dirty"] is False, "a quoted summary must come from a clean tree"
    return logs["summary"]["terapipe_over_1f1b_speed"]


Figure = tuple[str, str, Callable[[Any], float], str]
#: (a fragment of the README row, its results file under benchmarks/results/, the figure from
#: the loaded file, its format as the README prints it)
FIGURES: list[Figure] = [
    ("CPU, 2 stages, 1 sequence of 2048", "cpu/schedules.json",
     speedup("seq2048_M1", "terapipe_dp"), "{:.2f}x"),
    ("CPU, 2 stages, 1 sequence of 2048", "cpu/schedules.json",
     speedup("seq2048_M1", "terapipe_uniform"), "best uniform {:.2f}x"),
    ("CPU, 2 stages, 4 microbatches", "cpu/schedules.json",
     speedup("seq2048_M4", "terapipe_dp"), "{:.2f}x"),
    ("CPU, 2 stages, 4 microbatches", "cpu/schedules.json",
     speedup("seq2048_M4", "terapipe_uniform"), "best uniform {:.2f}x"),
    ("2 chunks per stage in a V", "megatron_lm/v.json",
     megatron_lm_v("terapipe_v_planned_on_profile"), "| {:.2f}x, 7 slices"),
    ("2 chunks per stage in a V", "megatron_lm/v.json",
     megatron_lm_v("terapipe_v_planned_on_profile", "megatron_interleaved"),
     "{:.2f}x over interleaved"),
    ("H100, 2 stages x 1 sequence", "gpu/h100/pipeline.json",
     gpu_pipeline("pp2_seq2048_M1", "terapipe_dp+graphs"), "| {:.2f}x"),
    ("H100, 2 stages x 1 sequence", "gpu/h100/pipeline.json",
     gpu_pipeline("pp2_seq2048_M1", "terapipe_uniform+graphs"), "best uniform {:.2f}x"),
    ("H100, 4 stages x 1 sequence", "gpu/h100/pipeline.json",
     gpu_pipeline("pp4_seq2048_M1", "terapipe_dp+graphs"), "| {:.2f}x, 3 slices"),
    ("H100, 4 stages x 1 sequence", "gpu/h100/pipeline.json",
     gpu_pipeline("pp4_seq2048_M1", "terapipe_uniform+graphs"), "5 slices: {:.2f}x"),
    ("H100, one stage, graphed", "gpu/h100/stage_graphs.json", stage_ratio(8),
     "8 slices {:.2f}x"),
    ("H100, one stage, graphed", "gpu/h100/stage_graphs.json", stage_ratio(16),
     "16 slices {:.2f}x"),
    ("H100, 2 stages x 2 chunks", "gpu/h100/virtual.json", virtual("terapipe_v2"),
     "{:.2f}x and"),
    ("H100, 2 stages x 2 chunks", "gpu/h100/virtual.json", virtual("terapipe_v2_uniform"),
     "and {:.2f}x"),
    ("H100, Megatron-LM's `pretrain_gpt.py`", "gpu/h100/megatron_lm.json", megatron_lm_speed,
     "**loses**: {:.2f}x"),
]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def stale_index(root: str) -> list[str]:
    path = os.path.join(root, index.RESULTS, index.INDEX)
    if not os.path.exists(path):
        return [f"{index.RESULTS}/{index.INDEX} is missing"]
    if _read(path) != index.render(root):
        return [f"{index.RESULTS}/{index.INDEX} is out of date: run "
                "python benchmarks/results_index.py"]
    return []


def unindexed_files(root: str) -> list[str]:
    """Files the INDEX leaves out or lists but are gone, files without provenance, too many."""
    path = os.path.join(root, index.RESULTS, index.INDEX)
    listed = set(index.indexed_files(_read(path))) if os.path.exists(path) else set()
    files = index.result_files(root)
    problems = [f"{rel}: not in the index" for rel in files if rel not in listed]
    problems += [f"{rel}: in the index, not on disk" for rel in sorted(listed - set(files))]
    for rel in files:
        origin = index.read_provenance(os.path.join(root, index.RESULTS, rel))
        missing = [k for k in index.KEYS if k not in (origin or {})]
        if missing:
            problems.append(f"{rel}: its provenance lacks {', '.join(missing)}")
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} results files: at most {MAX_FILES}")
    return problems


def missing_citations(root: str) -> list[str]:
    problems = []
    for doc in index.doc_files(root):
        for found in CITED.finditer(_read(os.path.join(root, doc))):
            if not os.path.exists(os.path.join(root, found.group(0))):
                problems.append(f"{doc} cites {found.group(0)}, which does not exist")
    return problems


def dirty_quoted(root: str) -> list[str]:
    problems = []
    for rel, docs in index.cited_by(root).items():
        if "README.md" in docs:
            origin = index.read_provenance(os.path.join(root, index.RESULTS, rel)) or {}
            if origin.get("dirty") is not False:
                problems.append(f"README.md quotes {rel}, whose dirty is "
                                f"{origin.get('dirty')!r}, not false")
    return problems


def dated_docs(root: str) -> list[str]:
    """Commit hashes and dates in README.md and docs/ (results paths may hold them)."""
    pages = [os.path.join(root, "README.md")]
    for folder, _, names in os.walk(os.path.join(root, "docs")):
        pages += [os.path.join(folder, name) for name in sorted(names)]
    problems = []
    for path in pages:
        doc = os.path.relpath(path, root).replace(os.sep, "/")
        if not os.path.exists(path):
            continue
        for number, line in enumerate(_read(path).splitlines(), 1):
            prose = RESULTS_PATH.sub("", line)
            for found in [*COMMIT.findall(prose), *DATE.findall(prose)]:
                problems.append(f"{doc}:{number}: {found}")
    return problems


def wrong_figures(root: str, figures: list[Figure]) -> list[str]:
    lines = _read(os.path.join(root, "README.md")).splitlines()
    problems = []
    for fragment, rel, figure, form in figures:
        rows = [line for line in lines if fragment in line]
        with open(os.path.join(root, index.RESULTS, rel)) as f:
            value = form.format(figure(json.load(f)))
        if not rows:
            problems.append(f"README.md has no row with {fragment!r}")
        elif not any(value in row for row in rows):
            problems.append(f"README.md's row {fragment!r} does not say {value!r} ({rel})")
    return problems


def test_the_index_is_current():
    assert stale_index(ROOT) == []


def test_every_results_file_is_indexed_with_its_provenance():
    assert unindexed_files(ROOT) == []


def test_every_cited_results_file_exists():
    assert missing_citations(ROOT) == []


def test_the_files_the_readme_quotes_are_clean():
    assert dirty_quoted(ROOT) == []


def test_docs_hold_no_dates_or_commit_hashes():
    assert dated_docs(ROOT) == []


def test_readme_figures_equal_their_files():
    assert wrong_figures(ROOT, FIGURES) == []


# ----- the checks themselves, on a small tree with a fault planted ---------------------------

def _provenance(dirty: bool = False) -> dict:
    return {"measured": "2000-01-01T00:00:00+00:00", "commit": "0" * 40, "dirty": dirty,
            "machine": {"cpu": "Some CPU", "logical_cores": 2}, "command": ["python", "b.py"]}


def _write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _result(root, rel: str, data: dict) -> None:
    _write(root, f"benchmarks/results/{rel}", json.dumps(data))


TINY_FIGURES: list[Figure] = [("| CPU row", "cpu/speed.json", lambda d: d["ratio"], "{:.2f}x")]


@pytest.fixture
def tree(tmp_path):
    """A checkout whose results, index, README and docs agree."""
    _result(tmp_path, "cpu/speed.json", {"provenance": _provenance(), "ratio": 1.5684})
    log = "# provenance: " + json.dumps({**_provenance(), "machine": "2 cores"}) + "\nlog\n"
    _write(tmp_path, "benchmarks/results/exactness/errors.log", log)
    _write(tmp_path, "benchmarks/results/cpu/profile_cpu_h8_s16.json", "{}")  # a cache: skipped
    _write(tmp_path, "README.md",
           "| CPU row | **1.57x** | [f](benchmarks/results/cpu/speed.json) |\n")
    _write(tmp_path, "docs/usage.md", "See results/exactness/errors.log and "
           "benchmarks/results/cpu/speed_2001-02-03_abc1234.json's name.\n"
           "A 0123456-digit word, deadbeefcafe and 1234567 are not commits.\n")
    _result(tmp_path, "cpu/speed_2001-02-03_abc1234.json", {"provenance": _provenance(True)})
    assert index.main(["--root", str(tmp_path)]) == 0
    return tmp_path


def _all_problems(root) -> list[str]:
    root = str(root)
    return (stale_index(root) + unindexed_files(root) + missing_citations(root)
            + dirty_quoted(root) + dated_docs(root) + wrong_figures(root, TINY_FIGURES))


def test_the_checks_pass_on_a_tree_that_agrees(tree):
    assert _all_problems(tree) == []
    assert index.main(["--root", str(tree), "--check"]) == 0
    listed = index.indexed_files((tree / "benchmarks/results/INDEX.md").read_text())
    assert listed == ["cpu/speed.json", "cpu/speed_2001-02-03_abc1234.json",
                      "exactness/errors.log"]
    assert index.cited_by(str(tree))["exactness/errors.log"] == ["docs/usage.md"]


def test_a_stale_index_is_found(tree, capsys):
    _result(tree, "cpu/new.json", {"provenance": _provenance()})
    assert stale_index(str(tree))
    assert unindexed_files(str(tree)) == ["cpu/new.json: not in the index"]
    assert index.main(["--root", str(tree), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    _write(tree, "docs/api.md", "benchmarks/results/cpu/speed.json\n")  # a new citation
    index.main(["--root", str(tree)])
    _write(tree, "docs/api.md", "")
    assert stale_index(str(tree))


def test_a_file_without_provenance_and_too_many_files_are_found(tree):
    _write(tree, "benchmarks/results/cpu/bare.log", "no provenance line\n")
    for i in range(MAX_FILES):
        _result(tree, f"cpu/extra_{i}.json", {"provenance": _provenance()})
    index.main(["--root", str(tree)])
    problems = unindexed_files(str(tree))
    assert problems == ["cpu/bare.log: its provenance lacks measured, commit, dirty, machine, "
                        "command", f"{MAX_FILES + 4} results files: at most {MAX_FILES}"]


def test_a_missing_cited_file_is_found(tree):
    _write(tree, "docs/perf.md", "the figure (benchmarks/results/cpu/gone.json).\n")
    assert missing_citations(str(tree)) == [
        "docs/perf.md cites benchmarks/results/cpu/gone.json, which does not exist"]


def test_a_dirty_quoted_file_is_found(tree):
    _result(tree, "cpu/speed.json", {"provenance": _provenance(dirty=True), "ratio": 1.5684})
    assert dirty_quoted(str(tree)) == [
        "README.md quotes cpu/speed.json, whose dirty is True, not false"]
    # a dirty file that only docs/ cite is allowed (the docs say so)
    _write(tree, "docs/usage.md", "benchmarks/results/cpu/speed_2001-02-03_abc1234.json\n")
    _result(tree, "cpu/speed.json", {"provenance": _provenance(), "ratio": 1.5684})
    assert dirty_quoted(str(tree)) == []


@pytest.mark.parametrize("line, found", [
    ("Measured on 2026-11-29.", "2026-11-29"),
    ("as at 84636db", "84636db"),
    ("commit 011b7a61cfeb9593c16bdeafe55e0e68243b1e7d", "011b7a61cfeb9593c16bdeafe55e0e68243b1e7d"),
])
def test_a_date_or_hash_in_a_doc_is_found(tree, line, found):
    _write(tree, "docs/design/notes.md", f"intro\n{line}\n")
    assert dated_docs(str(tree)) == [f"docs/design/notes.md:2: {found}"]


def test_a_wrong_or_missing_figure_is_found(tree):
    _result(tree, "cpu/speed.json", {"provenance": _provenance(), "ratio": 1.5784})
    assert wrong_figures(str(tree), TINY_FIGURES) == [
        "README.md's row '| CPU row' does not say '1.58x' (cpu/speed.json)"]
    _write(tree, "README.md", "| GPU row | 1.58x |\n")
    assert wrong_figures(str(tree), TINY_FIGURES) == ["README.md has no row with '| CPU row'"]


def test_the_figures_table_names_files_that_exist():
    for fragment, rel, figure, form in FIGURES:
        with open(os.path.join(ROOT, index.RESULTS, rel)) as f:
            assert form.format(figure(json.load(f))), fragment


# ----- the layout of a results file (benchmarks/results_layout.py) ---------------------------

def test_files_of_several_runs_keep_them_oldest_first_under_the_newest_provenance():
    import results_layout as layout

    merged = 0
    for rel in index.result_files(ROOT):
        path = os.path.join(ROOT, index.RESULTS, rel)
        if not rel.endswith(".json"):
            continue
        with open(path) as f:
            data = json.load(f)
        if layout.is_merged(data):
            merged += 1
            measured = [run["provenance"]["measured"] for run in data["runs"]]
            assert measured == sorted(measured), rel
            assert data["provenance"] == data["runs"][-1]["provenance"], rel
    assert merged >= 1


def test_a_rerun_replaces_the_file_and_append_adds_its_run(tmp_path):
    import results_layout as layout

    path = str(tmp_path / "gpu" / "h100" / "pipeline.json")
    cache = tmp_path / "gpu" / "h100" / "profile_cuda_pp2_h8_s16.json"
    first, second = ({"provenance": {"measured": m}, "rows": []} for m in ("1", "2"))
    layout.write_runs(path, layout.earlier_runs(path, append=False) + [first])
    cache.write_text(json.dumps({"format": "profile"}))
    run = layout.with_profiles(second, [str(cache), str(tmp_path / "profile_absent.json")])
    layout.write_runs(path, layout.earlier_runs(path, append=True) + [run])
    with open(path) as f:
        data = json.load(f)
    assert layout.is_merged(data) and data["provenance"] == {"measured": "2"}
    assert [r["provenance"]["measured"] for r in layout.load_runs(path)] == ["1", "2"]
    assert layout.latest_run(path)["profiles"] == {cache.name: {"format": "profile"}}
    written = layout.unpack_profiles(layout.latest_run(path), str(tmp_path / "unpacked"))
    assert [os.path.basename(p) for p in written] == [cache.name]
    layout.write_runs(path, layout.earlier_runs(path, append=False) + [first])
    assert layout.load_runs(path) == [first]  # a rerun without --append: the file is the run


def test_output_paths_and_card_names():
    import results_layout as layout

    assert layout.output_paths("a/b.json", "results.json") == ("a/b.json", "a")
    assert layout.output_paths("/tmp/lease/x", "results.json") == (
        "/tmp/lease/x/results.json", "/tmp/lease/x")
    assert layout.card_name("NVIDIA H100 80GB HBM3") == "h100"
    assert layout.card_name("NVIDIA H200") == "h200"
    assert layout.card_name("NVIDIA A100-SXM4-40GB") == "a100"
    assert layout.default_out("virtual.json", "cpu") == os.path.join(layout.RESULTS, "cpu",
                                                                      "virtual.json")
    assert layout.default_out("x.json", "cpu", scratch=True).startswith(layout.SCRATCH)
