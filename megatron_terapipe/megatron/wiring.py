"""`setup_from_args(args)`: wire the TeraPipe flags into a Megatron-LM run. It parses and
checks the flags once (RunSettings), then one Wiring per --pipeline-schedule (Megatron's own,
terapipe, auto) selects the schedule behind `get_forward_backward_func` and installs the hooks;
the launcher (`python -m megatron_terapipe.megatron.launch`) calls it for Megatron-LM
scripts."""

from __future__ import annotations

import os
from typing import Callable, Optional

from .args.checks import check_settings
from .args.plan_provider import ArgsPlanProvider
from .args.settings import RunSettings, TeraPipeSettings, apply_choice, apply_layout


def _log_rank0(message: str) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:  # before torch.distributed starts: the launcher's RANK (Megatron-LM's args.rank)
        rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        print(message, flush=True)


def setup_from_args(args, *, measure: Optional[Callable] = None) -> Optional[ArgsPlanProvider]:
    """Parse and check the flags, then wire the schedule they select into Megatron-LM:
    --pipeline-schedule auto (AutoWiring), terapipe (TeraPipeWiring), or Megatron's own
    (MegatronWiring). Returns TeraPipe's plan provider, or None under Megatron's schedule."""
    run = RunSettings.from_args(args)
    check_settings(run, args)
    if run.terapipe.auto:
        auto = AutoWiring()
        return auto.wire(args, run, measure)
    if run.terapipe.selected:
        terapipe = TeraPipeWiring()
        return terapipe.wire(args, run, measure)
    megatron = MegatronWiring()
    return megatron.wire(args, run, measure)


class Wiring:
    """One way to run Megatron-LM's schedule calls: `wire` installs it for the run `run`
    (parsed from `args`) and returns TeraPipe's plan provider, or None."""

    def wire(self, args, run: RunSettings,
             measure: Optional[Callable]) -> Optional[ArgsPlanProvider]:
        raise NotImplementedError


class MegatronWiring(Wiring):
    """Megatron's own schedule stays in charge (the hooks are still installed, harmless), on
    models with slice-aware attention under --terapipe-slice-aware-model."""

    def wire(self, args, run, measure):
        from .hooks import install, selection

        selection.deselect()
        selection.set_schedule_wrapper(None)
        install.use_slice_attention_in_gpt_models(run.terapipe.slice_aware_model)
        install.install()
        if run.terapipe.slice_aware_model:
            _log_rank0("> terapipe: Megatron's own schedule, on GPT models built with TeraPipe's "
                       "slice-aware attention (--terapipe-slice-aware-model)")
        return None


class TeraPipeWiring(Wiring):
    """--pipeline-schedule terapipe: an ArgsPlanProvider (it plans at the first iteration of
    each shape), GPT models with slice-aware attention, Megatron-LM's forward_step run per cell
    with the cell's shape in the global args; under auto, the MeasuredChoice that times the
    candidates within the chosen layout."""

    def __init__(self, measured=None):
        self.measured = measured

    def wire(self, args, run, measure):
        from .hooks import install, lm_cells, selection

        _place_chunks(run)
        provider = ArgsPlanProvider(run, measure=measure)
        selection.select(provider, cuda_graphs=run.terapipe.cuda_graphs,
                         scatter_gather=run.terapipe.scatter_gather)
        install.use_slice_attention_in_gpt_models(True)
        selection.set_schedule_wrapper(lm_cells.MegatronLMCells(
            trace=run.terapipe.trace, tensor_parallel=run.shape.tensor_parallel))
        selection.set_measured_choice(self.measured)
        install.install()
        if self.measured is None:
            _log_rank0(f"> terapipe: pipeline schedule terapipe (order {run.terapipe.order}; "
                       f"slices: {_slices_text(run.terapipe)})")
        if run.terapipe.scatter_gather and run.shape.tensor_parallel > 1:
            _log_rank0(f"> terapipe: stage-to-stage messages in {run.shape.tensor_parallel} TP "
                       "parts, all-gathered by the receiving stage (--terapipe-scatter-gather-p2p)")
        return provider


class AutoWiring(Wiring):
    """--pipeline-schedule auto: with --terapipe-auto-trials 0 the predicted pick, written into
    `args` and wired as the flags would; else the predicted layout written into `args` and a
    MeasuredChoice that times the shortlist within it (auto_trials.py)."""

    def wire(self, args, run, measure):
        from .args.auto_schedule import offers_v, predicted_choice

        predicted = predicted_choice(run, log=_log_rank0,  # logs why
                                     offer_v=offers_v(run, args))
        if run.terapipe.auto_trials == 0:
            apply_choice(args, predicted.choice)
            chosen = RunSettings.from_args(args)
            wiring = TeraPipeWiring() if chosen.terapipe.selected else MegatronWiring()
            return wiring.wire(args, chosen, measure)
        from .args.auto_trials import measured_choice

        measured, layout = measured_choice(run, predicted.inputs, predicted.table,
                                           predicted.choice.chosen, _log_rank0)
        apply_layout(args, layout.chunks, layout.order, layout.placement)
        if layout.chunks > 1 and run.support.virtual_stages <= 1:
            where = (" in a V (--terapipe-virtual-placement v)" if layout.placement == "v"
                     else ", as Megatron's interleaved schedule builds it")
            _log_rank0(f"> terapipe auto: the model is built in {layout.chunks} chunks per stage "
                       f"(virtual pipeline stages){where}: from scratch, it starts from other "
                       "initial weights than the same flags under --pipeline-schedule 1f1b; a "
                       "checkpoint loads and resumes as usual")
        return TeraPipeWiring(measured).wire(args, RunSettings.from_args(args), measure)


def _place_chunks(run: RunSettings) -> None:
    """--terapipe-virtual-placement v: Megatron-LM builds and feeds the chunks in a V."""
    from .model import v_layout

    in_v = run.terapipe.virtual_placement == "v"
    if in_v or v_layout.v_layout_on():
        v_layout.use_v_layout(in_v)
    if in_v:
        split = run.support.stage_layers
        chunks = split.v_chunk_layers if split else ()
        sizes = (f"; a stage's {sum(chunks)} layers in chunks of {chunks[0]} (down) and "
                 f"{chunks[1]} (back)" if chunks else "")
        _log_rank0("> terapipe: model chunks in a V (--terapipe-virtual-placement v): rank k holds "
                   "virtual stages k and 2K - 1 - k, the embedding and the loss on rank 0" + sizes)


def _slices_text(flags: TeraPipeSettings) -> str:
    if flags.slices:
        return f"--terapipe-slices {' '.join(map(str, flags.slices))}"
    if flags.num_slices is not None:
        return f"--terapipe-num-slices {flags.num_slices}"
    if flags.edge_slices is not None:
        return f"--terapipe-edge-slices {' '.join(map(str, flags.edge_slices))}"
    return f"DP slicer on the {flags.cost_model} cost model at the first iteration"
