"""Megatron-LM's forward_step / get_batch / loss_func, unchanged, on token slices: while a cell
runs, Megatron-LM's global args carry the cell's shape, and its batch is cut to the cell."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

from ..model import v_layout
from ..platform import compat


def megatron_lm_args() -> Optional[Any]:
    """Megatron-LM's global args (megatron.training.get_args()), or None outside Megatron-LM."""
    return compat.megatron_lm_global_args()


@contextlib.contextmanager
def megatron_lm_cell_args(args, cell, drop_mask: bool) -> Iterator[None]:
    """The global args as one cell sees them: seq_length and micro_batch_size are the cell's.

    Megatron-LM's get_batch_on_this_tp_rank allocates the tensors that tensor-parallel ranks
    other than 0 receive with shape (args.micro_batch_size, args.seq_length); rank 0 sends the
    cell's cut batch. With drop_mask, no attention mask is allocated either (rank 0 sends none:
    see CellBatches), because a cut causal mask [rows, 1, tokens, end] is not square.
    """
    saved = {k: getattr(args, k, None)
             for k in ("seq_length", "micro_batch_size", "create_attention_mask_in_dataloader")}
    args.seq_length = cell.tokens
    args.micro_batch_size = cell.rows
    if drop_mask:
        args.create_attention_mask_in_dataloader = False
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(args, k, v)


def is_causal_cut(mask, cell) -> bool:
    """Whether `mask` ([b or 1, 1, tokens, end], True = masked) is the plain causal mask cut to
    the cell, i.e. what slice-aware attention applies anyway without a mask."""
    import torch

    from ...runtime.batching import is_plain_causal

    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return False
    if tuple(mask.shape[-2:]) != (cell.tokens, cell.token_end):
        return False
    return is_plain_causal(mask, cell.token_start)


class CellBatches:
    """The cell iterator as Megatron-LM's get_batch needs it: contiguous tensors (they are
    broadcast over the tensor-parallel group), and a plain causal mask left out (slice-aware
    attention applies it itself; with TP > 1 it must go, see megatron_lm_cell_args)."""

    def __init__(self, inner: Iterator, cell, must_drop_mask: bool) -> None:
        self.inner = inner
        self.cell = cell
        self.must_drop_mask = must_drop_mask

    def __iter__(self):
        return self

    def __next__(self):
        import torch

        from ...runtime.batching import CausalCut

        batch = next(self.inner)
        if isinstance(batch, dict):
            # The mask is looked at before the copies: a plain causal one is dropped uncopied
            # (CausalCut: CellData already checked the microbatch's whole mask).
            plain = isinstance(batch, CausalCut)
            batch = dict(batch)
            if "attention_mask" in batch:
                mask = batch["attention_mask"]
                if mask is None or plain or is_causal_cut(mask, self.cell):
                    del batch["attention_mask"]
                elif self.must_drop_mask:
                    raise ValueError(
                        "TeraPipe with --tensor-model-parallel-size > 1 supports only the plain "
                        "causal attention mask, but the data has another one (e.g. from "
                        "--reset-attention-mask): drop it, or use --tensor-model-parallel-size 1")
            batch = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v)
                     for k, v in batch.items()}
        elif isinstance(batch, (list, tuple)):
            batch = type(batch)(v.contiguous() if isinstance(v, torch.Tensor) else v for v in batch)
        return batch


class MegatronLMCells:
    """Schedule wrapper for Megatron-LM scripts (see set_schedule_wrapper).

    Runs the script's forward_step for each cell with the cell's shape in Megatron-LM's global
    args (megatron_lm_cell_args) and its batch through CellBatches, so that stock pretrain_gpt
    forward_step, get_batch and loss_func work unchanged, also with tensor parallelism. With a
    trace path, the measured timeline of the first two training iterations is written there
    (the second overwrites the first: it has no warm-up effects). tensor_parallel: the run's
    TP size (with TP > 1, rank 0 sends no attention mask: see megatron_lm_cell_args).
    """

    def __init__(self, trace: Optional[str] = None, tensor_parallel: int = 1) -> None:
        self.trace = trace
        self.tensor_parallel = tensor_parallel
        self.training_runs = 0

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        from ...runtime.context import active_cell

        if getattr(forward_step_func, "_terapipe_cells", False):
            return forward_step_func

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator, model, *args, **kwargs):
            active = active_cell()
            megatron_args = megatron_lm_args()
            if active is None or megatron_args is None:
                return forward_step_func(data_iterator, model, *args, **kwargs)
            cell, drop_mask = active.cell, self.tensor_parallel > 1
            if data_iterator is not None:
                data_iterator = CellBatches(data_iterator, cell, must_drop_mask=drop_mask)
            with megatron_lm_cell_args(megatron_args, cell, drop_mask=drop_mask), \
                    v_layout.cell_chunk(model):
                return forward_step_func(data_iterator, model, *args, **kwargs)

        forward_step._terapipe_cells = True  # type: ignore[attr-defined]
        return forward_step

    def __call__(self, schedule: Callable) -> Callable:
        @functools.wraps(schedule)
        def forward_backward_terapipe(**kwargs):
            if kwargs.get("forward_step_func") is not None:
                kwargs["forward_step_func"] = self.wrap_forward_step(kwargs["forward_step_func"])
            if not (self.trace and not kwargs.get("forward_only", False) and self.training_runs < 2):
                return self._losses_where_megatron_reads_them(schedule(**kwargs), kwargs)
            self.training_runs += 1
            runs: list = []
            callers_on_run = kwargs.pop("on_run", None) or (lambda record: None)
            result = schedule(**kwargs, on_run=lambda record: (runs.append(record),
                                                                callers_on_run(record)))
            from ...runtime.trace import gather_trace

            gather_trace(runs[-1], self.trace)  # every rank calls the schedule
            return self._losses_where_megatron_reads_them(result, kwargs)

        return forward_backward_terapipe

    @staticmethod
    def _losses_where_megatron_reads_them(losses: list, kwargs: dict) -> list:
        """In a V the losses are on rank 0; Megatron-LM reads them on the last rank."""
        if not v_layout.v_layout_on():
            return losses
        model = kwargs.get("model")
        first = model[0] if isinstance(model, (list, tuple)) else model
        device = next(first.parameters()).device
        return v_layout.losses_to_last_rank(losses, device)
