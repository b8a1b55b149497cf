"""Zero-edit launcher: run an unmodified Megatron-LM training script with TeraPipe available.

    torchrun --nproc-per-node 8 -m megatron_terapipe.megatron.launch pretrain_gpt.py \\
        <Megatron-LM arguments> --pipeline-schedule {terapipe,auto} [--terapipe-* flags]

The launcher puts the script's directory first on sys.path (as `python pretrain_gpt.py` does),
installs the hooks (`install_hooks`) and runs the script with runpy as __main__. The hooks:

- every `megatron.training.arguments.parse_args` call adds the TeraPipe flags to the script's
  own `extra_args_provider` (the script's parser accepts --pipeline-schedule etc.), whether
  `initialize_megatron` (0.16, 0.17) or `parse_and_validate_args` (0.18, 0.19) makes it;
- right after Megatron-LM's `validate_args` or `validate_yaml` (before torch.distributed
  starts), the TeraPipe flags
  are validated and, with --pipeline-schedule terapipe, TeraPipe is selected
  (`wiring.setup_from_args`): GPT models get slice-aware attention, the plan is chosen at the
  first iteration, and forward_step runs per cell with the cell's shape in the global args;
- `get_forward_backward_func`, in megatron.core and in megatron.training.training, returns the
  TeraPipe schedule when it is selected and Megatron's own otherwise.

Scripts you edit yourself can call `install_hooks()` before `pretrain(...)` instead
(see patches/pretrain_gpt_terapipe.patch).
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import time
from typing import Callable, Optional, Sequence

USAGE = """\
usage: python -m megatron_terapipe.megatron.launch SCRIPT [script arguments ...]
       python -m megatron_terapipe.megatron.launch -m MODULE [module arguments ...]

Runs a Megatron-LM training script (e.g. pretrain_gpt.py) unmodified, with TeraPipe's flags
(--pipeline-schedule {1f1b,terapipe,auto}, --terapipe-*) added to its arguments. Use it under
torchrun: torchrun --nproc-per-node N -m megatron_terapipe.megatron.launch pretrain_gpt.py ...
"""


class LauncherError(RuntimeError):
    pass


def _wrap_parse_args(original: Callable) -> Callable:
    if getattr(original, "_terapipe_wrapped", False):
        return original
    from .args.flags import add_terapipe_args, combine_extra_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *args, **kwargs):
        return original(combine_extra_args(extra_args_provider, add_terapipe_args), *args, **kwargs)

    parse_args._terapipe_wrapped = True  # type: ignore[attr-defined]
    return parse_args


def _wrap_validate(original: Callable) -> Callable:
    if getattr(original, "_terapipe_wrapped", False):
        return original

    @functools.wraps(original)
    def validate(args, *rest, **kwargs):
        from .args.settings import TeraPipeSettings

        if TeraPipeSettings.from_args(args).cpu:
            _apply_cpu_settings(args)
        result = original(args, *rest, **kwargs)
        from .wiring import setup_from_args

        setup_from_args(result if result is not None and hasattr(result, "__dict__") else args)
        return result

    validate._terapipe_wrapped = True  # type: ignore[attr-defined]
    return validate


def _apply_cpu_settings(args) -> None:
    from .platform.lm_cpu import apply_cpu_settings

    try:
        lines = apply_cpu_settings(args)
    except ValueError as exc:
        raise LauncherError(str(exc)) from None
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(line, flush=True)


def _enable_cpu_if_asked(args: Sequence[str]) -> None:
    """--terapipe-cpu must act before the script's initialize_megatron asserts CUDA."""
    if "--terapipe-cpu" in args:
        from .platform.lm_cpu import enable_megatron_lm_cpu_mode

        enable_megatron_lm_cpu_mode()


def _run_script(args: Sequence[str], script: Callable[[], object]) -> None:
    """The script, then on CPU the release of its process groups: after it returns, and after
    a clean sys.exit (Megatron-LM stops that way at --exit-interval, --exit-duration-in-mins
    and on --exit-signal-handler's signal)."""
    try:
        script()
    except SystemExit as stop:
        if stop.code in (0, None):
            _release_if_cpu(args)
        raise
    _release_if_cpu(args)


def _release_if_cpu(args: Sequence[str]) -> None:
    """On CPU, the process groups go before interpreter exit (lm_cpu.release_process_groups).
    Training has finished by then: a failure here is reported, not raised."""
    if "--terapipe-cpu" not in args:
        return
    from .platform.lm_cpu import release_process_groups

    try:
        release_process_groups()
    except Exception as exc:  # noqa: BLE001 - the run itself succeeded
        sys.stderr.write(f"> terapipe cpu: process groups left to interpreter exit ({exc!r})\n")


#: pip's name for a module Megatron-LM's training code imports, where the two differ.
_PIP_NAMES = {"yaml": "pyyaml"}


def _megatron_training_missing(exc: ImportError) -> LauncherError:
    """The error for a megatron.training that does not import: no Megatron-LM on the path, or
    a package its code imports that is not installed (0.17's and 0.18's import yaml, which
    megatron-core's wheel does not require)."""
    top = (getattr(exc, "name", None) or "").split(".")[0]
    if top and top != "megatron":
        return LauncherError(
            f"Megatron-LM's megatron.training imports {exc.name!r}, which is not installed "
            f"({exc}): pip install {_PIP_NAMES.get(top, top)}")
    return LauncherError(
        f"megatron_terapipe.megatron.launch needs Megatron-LM's megatron.training ({exc}): run it "
        "on a script in a Megatron-LM checkout (its directory goes first on sys.path) or put the "
        "checkout on PYTHONPATH")


def install_hooks() -> None:
    """Hook Megatron-LM's argument parsing, argument validation and schedule choice.

    Needs Megatron-LM's `megatron.training` importable (a Megatron-LM checkout on sys.path, or
    the copy megatron-core 0.17's to 0.19's wheels ship). The functions it wraps, which differ
    between 0.16/0.17 and 0.18/0.19, are listed in compat.MEGATRON_LM_ARGUMENT_HOOKS. Calling it
    again is harmless.
    """
    from .platform import compat
    from .hooks import install

    # Patch megatron.core first: megatron.training.training binds get_forward_backward_func
    # when it is imported (possibly by the imports just below), and then gets the patched one.
    install.install()
    try:
        hooks = compat.megatron_lm_argument_hooks()
    except ImportError as exc:
        raise _megatron_training_missing(exc) from exc
    wraps = {"parse": _wrap_parse_args, "validate": _wrap_validate}
    for module, name, kind in hooks:
        setattr(module, name, wraps[kind](getattr(module, name)))
    install.install()  # names imported by megatron.training.* before this point


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.stderr.write(USAGE)
            return 2
        module, rest = argv[1], argv[2:]
        sys.argv = [module] + rest
        return _run(rest, lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        sys.stderr.write(f"megatron_terapipe.megatron.launch: no such script: {script}\n\n{USAGE}")
        return 2
    # What `python SCRIPT` does: the script's directory first on sys.path (Megatron-LM's
    # pretrain_gpt.py imports gpt_builders, model_provider and megatron.training from there).
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    sys.argv = [script] + rest
    return _run(rest, lambda: runpy.run_path(script, run_name="__main__"))


#: How long the other ranks wait, after a flag error, before exiting (rank 0 prints it).
REPORT_GRACE_S = 3.0


def _run(args: Sequence[str], script: Callable[[], object]) -> int:
    """Run the script with the hooks; a TeraPipe flag error (raised before torch.distributed
    starts) is printed once, by rank 0, as argparse prints its own, and every rank exits with 2."""
    from .args.checks import TeraPipeArgumentError

    try:
        install_hooks()
        _enable_cpu_if_asked(args)
        _run_script(args, script)
    except (TeraPipeArgumentError, LauncherError) as exc:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"megatron_terapipe.megatron.launch: error: {exc}\n")
            sys.stderr.flush()
        else:  # torchrun stops every rank once one exits: give rank 0 time to say why
            time.sleep(REPORT_GRACE_S)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
