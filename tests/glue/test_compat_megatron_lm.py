"""The launcher and the patch against Megatron-LM's own argument parser and pretrain_gpt.py.

Megatron-LM's code is never part of this repository. The tests use, in this order:
- a Megatron-LM work tree named by MEGATRON_LM_PATH, when its release matches the installed
  megatron-core line (core_v0.16.1 for 0.16.x, core_v0.17.1 for 0.17.x, core_v0.18.2 for
  0.18.x, core_v0.19.0 for 0.19.x; noxfile.py passes MEGATRON_LM_0_16 / ..._0_17 / ..._0_18 /
  ..._0_19 on as MEGATRON_LM_PATH);
- else the megatron.training that megatron-core 0.17's to 0.19's wheels ship (arguments only:
  the wheel has no pretrain_gpt.py);
- else they skip.
Each check runs in a subprocess, so that Megatron-LM's modules and the hooks stay out of the
test process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from harness.paths import ROOT

CHECK = os.path.join(ROOT, "patches", "check_megatron_lm.py")
# 0.17's pretrain_gpt.py differs from 0.16's only outside the patch's hunks: one patch for both
PATCHES = {(0, 16): "pretrain_gpt_terapipe.patch", (0, 17): "pretrain_gpt_terapipe.patch",
           (0, 18): "pretrain_gpt_terapipe_0.18.patch", (0, 19): "pretrain_gpt_terapipe_0.19.patch"}


def _installed_line() -> tuple[int, int]:
    from megatron_terapipe.megatron.platform import compat

    return compat.megatron_core_version()[:2]


def _checkout_line(checkout: str) -> tuple[int, int]:
    text = open(os.path.join(checkout, "megatron", "core", "package_info.py")).read()
    major = re.search(r"^MAJOR = (\d+)", text, re.M)
    minor = re.search(r"^MINOR = (\d+)", text, re.M)
    return int(major.group(1)), int(minor.group(1))


def _checkout() -> str:
    """The MEGATRON_LM_PATH work tree for the installed line, or skip."""
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if not checkout:
        pytest.skip("MEGATRON_LM_PATH is not set (a Megatron-LM work tree of the release "
                    "matching the installed megatron-core)")
    if not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
        pytest.fail(f"MEGATRON_LM_PATH={checkout} is not a Megatron-LM work tree "
                    "(no pretrain_gpt.py)")
    if _checkout_line(checkout) != _installed_line():
        pytest.skip(f"MEGATRON_LM_PATH is Megatron-LM {_checkout_line(checkout)}, the "
                    f"installed megatron-core is {_installed_line()}")
    return checkout


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_launcher_hooks_on_the_megatron_lm_argument_parser():
    """Our flags join Megatron-LM's parser (argparse refuses colliding option strings), and
    validate_args, called as the release calls it, selects TeraPipe."""
    if os.environ.get("MEGATRON_LM_PATH"):
        extra = ["--megatron-lm", _checkout()]
    elif importlib.util.find_spec("megatron.training") is not None:
        extra = []  # megatron-core 0.17's to 0.19's wheels ship megatron.training
    else:
        pytest.skip("no megatron.training: set MEGATRON_LM_PATH to a Megatron-LM work tree")
    out = _run([CHECK, "--args-only", *extra])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "parse_args took the TeraPipe flags, validate_args selected TeraPipe" in out.stdout
    assert "> terapipe: pipeline schedule terapipe" in out.stdout


def test_patch_applies_to_the_matching_pretrain_gpt(tmp_path):
    checkout = _checkout()
    patch = os.path.join(ROOT, "patches", PATCHES[_installed_line()])
    shutil.copy(os.path.join(checkout, "pretrain_gpt.py"), tmp_path / "pretrain_gpt.py")
    out = subprocess.run(["git", "apply", patch], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    other = sorted({p for p in PATCHES.values() if p != PATCHES[_installed_line()]})
    for name in other:  # the other lines' patches must not apply by accident
        check = subprocess.run(["git", "apply", "--check", os.path.join(ROOT, "patches", name)],
                               cwd=checkout, capture_output=True, text=True)
        assert check.returncode != 0, f"{name} applies to {checkout}"


def test_patched_pretrain_gpt_parses_the_flags_and_selects_terapipe(tmp_path):
    """The patched script runs as __main__ up to pretrain() (stubbed): its own calls add the
    flags and select TeraPipe."""
    checkout = _checkout()
    patch = os.path.join(ROOT, "patches", PATCHES[_installed_line()])
    shutil.copy(os.path.join(checkout, "pretrain_gpt.py"), tmp_path / "pretrain_gpt.py")
    subprocess.run(["git", "apply", patch], cwd=tmp_path, check=True)
    out = _run([CHECK, "--megatron-lm", checkout,
                "--patched-script", str(tmp_path / "pretrain_gpt.py")])
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "TeraPipe flags parsed (--terapipe-slices [16, 24, 24]), TeraPipe selected" in out.stdout
