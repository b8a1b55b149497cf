"""Test sessions, one per supported megatron-core line, each in its own environment (.nox/).

    nox -s tests-0.16          # every test on megatron-core 0.16.x, Python 3.11, CPU torch
    nox -s slow-0.16           # only the `slow` tests (.ci/run adds these to the default run)
    nox -s tests-0.19          # every test on 0.19.x, Python 3.12 (likewise tests-0.18, -0.17)
    nox -s equivalence-0.19    # EQUIVALENCE_TESTS only (likewise equivalence-0.18, -0.17)
    nox -s equivalence-3.12    # what .ci/run runs: the 3.12 lines in one environment
    nox -s tests-0.19 -- -k launch   # arguments after -- go to pytest

Each session installs torch==2.13.0 first (the CPU wheel on 3.11; on 3.12 the CUDA build, which
runs without a GPU), then the plugin and its line, and prints what the compatibility check finds.
A Python installed with pyenv but not on PATH is found there. MEGATRON_LM_0_16 ... _0_19 may name
a Megatron-LM work tree of the matching release, to check the launcher and patch against it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import nox

nox.options.sessions = ["tests-0.16"]
nox.options.download_python = "never"
nox.options.error_on_missing_interpreters = True

#: megatron-core line -> (Python, pip requirement)
LINES = {
    "0.16": ("3.11", "megatron-core~=0.16.0"),
    "0.17": ("3.12", "megatron-core~=0.17.0"),
    "0.18": ("3.12", "megatron-core~=0.18.0"),
    "0.19": ("3.12", "megatron-core~=0.19.0"),
}
#: What a line's megatron.training imports beyond megatron-core's own requirements (0.17's
#: initialize and 0.18's config container import yaml when megatron.training is imported; the
#: wheels do not require it).
LINE_EXTRAS = {"0.17": ("pyyaml",), "0.18": ("pyyaml",)}
#: The field and interface checks: the config, schedule and router fields each line has, the
#: launcher and patch on Megatron-LM's argument parser, the compatibility checks. Every line.
FIELD_TESTS = ("tests/glue/test_launch.py", "tests/glue/platform/test_compat.py",
               "tests/glue/platform/test_attention_features.py",
               "tests/glue/platform/test_schedule_fields.py",
               "tests/glue/platform/test_moe_router_fields.py",
               "tests/glue/platform/test_gpt_model_fields.py",
               "tests/glue/test_compat_megatron_lm.py")
#: Plus equivalence against Megatron's own schedules, its MoE losses and attention.
INTERFACE_TESTS = FIELD_TESTS + ("tests/equivalence/test_equivalence.py",
                                 "tests/equivalence/test_moe_losses.py",
                                 "tests/runtime/test_prefix_attention.py")
#: Plus the runs built on them (virtual stages, the V, uneven splits, edge slicing, the
#: distributed optimizer).
EQUIVALENCE_TESTS = INTERFACE_TESTS + (
    "tests/equivalence/test_virtual_runs.py", "tests/equivalence/test_random_virtual_runs.py",
    "tests/glue/test_stage_layers.py", "tests/plan/test_edge_slices.py",
    "tests/equivalence/test_stage_split_runs.py",
    "tests/equivalence/test_distributed_optimizer.py")


def interpreter(version: str) -> str:
    """`version` when `python<version>` runs, else pyenv's newest `<version>.x` (pyenv's shim
    for a version that is installed but not selected fails), else `version` (nox reports it)."""
    command = f"python{version}"
    if shutil.which(command) and subprocess.run([command, "--version"],
                                                capture_output=True).returncode == 0:
        return version
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", command))
    found.sort(key=lambda p: [int(x) for x in p.split(os.sep)[-3].split(".") if x.isdigit()])
    return found[-1] if found else version


def install(session: nox.Session, line: str, plugin: bool = True) -> None:
    """torch, the plugin (unless `plugin` is False: already there) and megatron-core `line`,
    then a check that `line` is what imports (`nox -R` skips the installs)."""
    if plugin:
        session.install("torch==2.13.0")
        session.install("-e", ".[test]", LINES[line][1], *LINE_EXTRAS.get(line, ()))
    else:
        session.install(LINES[line][1], *LINE_EXTRAS.get(line, ()))
    session.run("python", "-c", "import sys, torch, megatron.core as m; "
                "print('torch', torch.__version__, '| megatron-core', m.__version__); "
                f"sys.exit(0 if m.__version__.startswith('{line}.') else 'megatron-core ' "
                f"+ m.__version__ + ' is installed, not {line}.x: run this session without -R "
                "(it installs its line)')")
    session.run("python", "-W", "ignore", "-m", "megatron_terapipe.megatron.platform.version_report")


#: pytest's default run leaves out `slow` (pyproject.toml); an empty -m selects every test.
EVERY_TEST = ("-m", "")
ONLY_SLOW = ("-m", "slow")


def run_tests(session: nox.Session, line: str, pytest_args: tuple[str, ...] = ()) -> None:
    env = {}
    checkout = os.environ.get("MEGATRON_LM_" + line.replace(".", "_"))
    if checkout:
        env["MEGATRON_LM_PATH"] = checkout
    session.run("python", "-m", "pytest", "-q", *pytest_args, *session.posargs, env=env)


@nox.session(name="tests-0.16", python=interpreter(LINES["0.16"][0]))
def tests_016(session: nox.Session) -> None:
    """The whole suite on megatron-core 0.16.x (Python 3.11, CPU torch)."""
    install(session, "0.16")
    run_tests(session, "0.16", EVERY_TEST)


@nox.session(name="slow-0.16", python=interpreter(LINES["0.16"][0]))
def slow_016(session: nox.Session) -> None:
    """Only the `slow` tests on megatron-core 0.16.x."""
    install(session, "0.16")
    run_tests(session, "0.16", ONLY_SLOW)


def _python312_line_sessions(line: str) -> None:
    """`tests-<line>` (the whole suite) and `equivalence-<line>` (EQUIVALENCE_TESTS) for a
    megatron-core line on Python 3.12; written once, as the lines differ only in the pin."""

    def tests(session: nox.Session) -> None:
        install(session, line)
        run_tests(session, line, EVERY_TEST)

    def equivalence(session: nox.Session) -> None:
        install(session, line)
        run_tests(session, line, EQUIVALENCE_TESTS)

    tests.__doc__ = f"The whole suite on megatron-core {line}.x (Python 3.12)."
    equivalence.__doc__ = (f"The equivalence, launcher and compatibility tests on megatron-core "
                           f"{line}.x.")
    for name, session in (("tests", tests), ("equivalence", equivalence)):
        nox.session(name=f"{name}-{line}", python=interpreter(LINES[line][0]))(session)


#: The lines on Python 3.12, newest first.
PYTHON312_LINES = tuple(sorted((line for line, (python, _) in LINES.items() if python == "3.12"),
                               key=lambda line: tuple(map(int, line.split("."))), reverse=True))
for _line in PYTHON312_LINES:
    _python312_line_sessions(_line)


#: What equivalence-3.12 (CI) runs per line: everything on the newest, as 0.16 does in the
#: default run, so both ends of the supported range run every test; the interface tests on the
#: oldest 3.12 line; the field checks on the lines between, within CI's time.
CI_TESTS = {PYTHON312_LINES[0]: EQUIVALENCE_TESTS, PYTHON312_LINES[-1]: INTERFACE_TESTS}


@nox.session(name="equivalence-3.12", python=interpreter("3.12"))
def equivalence_python312(session: nox.Session) -> None:
    """CI_TESTS on every Python 3.12 line, newest first, in one environment: torch's large
    build installed once, megatron-core swapped between the lines (pip downgrades it in place).
    What .ci/run runs."""
    for line in PYTHON312_LINES:
        install(session, line, plugin=line == PYTHON312_LINES[0])
        run_tests(session, line, CI_TESTS.get(line, FIELD_TESTS))
