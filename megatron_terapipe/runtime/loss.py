"""The last stage's losses, cell by cell, normalised as for whole microbatches.

`loss_func(output)` returns (loss sum, token count, report) as in pretrain_gpt, or the legacy
(mean loss, report). Every cell of a microbatch reports its own share; a cell's backward must
use the loss normalised by the whole microbatch (its token count, or for mean losses its
share of the microbatch's tokens), and the caller gets one merged report per microbatch.
The 1f1b schedule forwards a whole microbatch before its first backward, so the totals are
known by then. Token counts and weights stay tensors on the loss's device: reading one on the
host would wait for the device once per cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from ..schedule import Cell
from .batching import CellData, slice_tensor
from .memory.buffer_pool import BufferPool


@dataclass
class _CellLoss:
    loss: torch.Tensor
    per_token: bool  # (loss sum, tokens, report) form; else a mean over the cell's tokens
    # Mean losses: the cell's share of the microbatch's loss-masked tokens (a float64 tensor
    # when counted from a loss mask, else a float).
    weight: Union[float, torch.Tensor]


class LossBook:
    def __init__(self, data: CellData, num_microbatches: int, device: torch.device,
                 collect_non_loss_data: bool = False, keep_for_backward: bool = True,
                 pool: Optional[BufferPool] = None) -> None:
        self.data = data
        self.num_microbatches = num_microbatches
        self.collect_non_loss_data = collect_non_loss_data
        self.keep_for_backward = keep_for_backward
        self.cells: dict[Cell, _CellLoss] = {}
        self.tokens: dict[int, torch.Tensor] = {}  # per microbatch
        self.weights: dict[int, Union[float, torch.Tensor]] = {}  # per microbatch, mean losses
        self.reports: dict[int, list[tuple[Any, Any]]] = {}
        # Every cell adds into it: from the pool, it sits at the same address every iteration.
        self.total_num_tokens = (pool or BufferPool()).take((), torch.int, device, zeroed=True)
        self.results: list[Any] = []  # what the schedule returns: one entry per microbatch

    def record(self, cell: Cell, output: Any, loss_func: Optional[Callable],
               microbatch_done: bool) -> None:
        """Take the cell's output through loss_func and keep what its backward needs."""
        if loss_func is None:
            self.results.append(output)
            return
        if self.collect_non_loss_data:
            self.results.append(loss_func(output, non_loss_data=True))
            return
        m = cell.microbatch
        outputs = loss_func(output)
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            num_tokens = torch.as_tensor(num_tokens, device=self.total_num_tokens.device)
            self.tokens[m] = self.tokens.get(m, 0) + num_tokens
            self.total_num_tokens += num_tokens.to(self.total_num_tokens.dtype)
            entry = _CellLoss(loss, True, 1.0)
        elif len(outputs) == 2:
            # Legacy losses are means over the cell's tokens: weight each cell by its share of
            # the microbatch's (loss-masked) tokens so the result is the whole-microbatch mean.
            loss, report = outputs
            entry = _CellLoss(loss, False, self._token_weight(cell))
            self.weights[m] = self.weights.get(m, 0.0) + entry.weight
        else:
            raise ValueError(
                f"TeraPipe: loss_func returned {len(outputs)} values; expected "
                "(loss, num_tokens, report) or (loss, report)")
        if self.keep_for_backward:
            self.cells[cell] = entry
        self.reports.setdefault(m, []).append((report, entry.weight))
        if microbatch_done:
            self.results.append(self._merge_reports(m, entry.per_token))

    def backward_root(self, cell: Cell, per_token_loss: bool,
                      grad_scale_func: Optional[Callable]) -> torch.Tensor:
        """The cell's loss as its backward starts from it (Megatron's normalisation)."""
        entry = self.cells.pop(cell)
        m = cell.microbatch
        loss = entry.loss
        if entry.per_token:
            if not per_token_loss:
                loss = loss / torch.clamp(self.tokens[m], min=1) / self.num_microbatches
        else:
            loss = loss * _share(entry.weight, self.weights[m], loss) / self.num_microbatches
        return grad_scale_func(loss) if grad_scale_func is not None else loss

    def _token_weight(self, cell: Cell) -> Union[float, torch.Tensor]:
        batch = self.data.batch_if_read(cell.microbatch)
        if isinstance(batch, dict) and isinstance(batch.get("loss_mask"), torch.Tensor):
            mask = slice_tensor(batch["loss_mask"], cell, self.data.seq_length,
                                self.data.micro_batch_size)
            # float64, as the host's float the counts used to be read into: same sums, same shares
            return mask.float().sum().to(torch.float64)
        return float(cell.rows * cell.tokens)

    def _merge_reports(self, m: int, per_token: bool) -> Any:
        reports = self.reports.pop(m)
        total_weight = self.weights.get(m, 1.0) if not per_token else 1.0

        def combine(values: list[tuple[Any, Any]]):
            first = values[0][0]
            if isinstance(first, dict):
                return {k: combine([(v[k], w) for v, w in values]) for k in first}
            if isinstance(first, (torch.Tensor, int, float)):
                return sum(v if per_token else v * _share(w, total_weight, v) for v, w in values)
            return [v for v, _ in values]

        return combine(reports)


def _share(weight: Union[float, torch.Tensor], total: Union[float, torch.Tensor], like: Any) -> Any:
    """weight / total (at least 1e-30), in float64, then in `like`'s dtype when `like` is a
    tensor: the same rounding as the float the scale used to be on the host."""
    if not isinstance(weight, torch.Tensor) and not isinstance(total, torch.Tensor):
        return weight / max(total, 1e-30)
    total = total if isinstance(total, torch.Tensor) else torch.tensor(total, dtype=torch.float64)
    share = weight / torch.clamp(total, min=1e-30)
    return share.to(like.dtype) if isinstance(like, torch.Tensor) else share
