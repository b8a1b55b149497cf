"""`setup_from_args(args)`: wire the TeraPipe flags into a Megatron-LM run. It validates, selects
TeraPipe for `get_forward_backward_func` and installs the hooks; the launcher
(`python -m megatron_terapipe.megatron.launch`) calls it for Megatron-LM scripts."""

from __future__ import annotations

import os
from typing import Callable, Optional

from .args.flags import auto_selected, terapipe_selected
from .args.plan_provider import ArgsPlanProvider
from .args.checks import validate_terapipe_args


def _log_rank0(args, message: str) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(getattr(args, "rank", 0) or os.environ.get("RANK", 0))
    if rank == 0:
        print(message, flush=True)


def setup_from_args(args, *, measure: Optional[Callable] = None) -> Optional[ArgsPlanProvider]:
    """Validate the flags, then route `get_forward_backward_func` accordingly and install hooks.

    --pipeline-schedule auto: first choose the schedule (auto_schedule.py), then as below.
    --pipeline-schedule terapipe: select an ArgsPlanProvider (plans at the first iteration of
    each shape), build GPT models with slice-aware attention, run Megatron-LM's forward_step
    per cell with the cell's shape in the global args, and install(). Otherwise Megatron's own
    schedule stays in charge (install() is still harmless). Returns the provider, or None.
    """
    from .hooks import install, lm_cells, selection

    validate_terapipe_args(args)
    if auto_selected(args):  # writes the chosen schedule into args, and logs why
        from .args.auto_schedule import resolve_auto_schedule

        resolve_auto_schedule(args, log=lambda line: _log_rank0(args, line))
    if not terapipe_selected(args):
        selection.deselect()
        selection.set_schedule_wrapper(None)
        install.use_slice_attention_in_gpt_models(False)
        install.install()
        return None
    provider = ArgsPlanProvider(args, measure=measure)
    selection.select(provider, cuda_graphs=bool(getattr(args, "terapipe_cuda_graphs", False)))
    install.use_slice_attention_in_gpt_models(True)
    selection.set_schedule_wrapper(
        lm_cells.MegatronLMCells(trace=getattr(args, "terapipe_trace", None)))
    install.install()
    if getattr(args, "terapipe_slices", None):
        how = f"--terapipe-slices {' '.join(map(str, args.terapipe_slices))}"
    elif getattr(args, "terapipe_num_slices", None) is not None:
        how = f"--terapipe-num-slices {args.terapipe_num_slices}"
    else:
        how = f"DP slicer on the {args.terapipe_cost_model} cost model at the first iteration"
    _log_rank0(args, f"> terapipe: pipeline schedule terapipe (order {args.terapipe_order}; "
                     f"slices: {how})")
    return provider
