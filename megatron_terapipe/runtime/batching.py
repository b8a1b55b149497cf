"""Cutting a microbatch down to one cell's rows and tokens, for an unmodified forward_step_func."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from ..schedule import Cell
from .memory.buffer_pool import BufferPool


def slice_tensor(x: Any, cell: Cell, seq_length: int, micro_batch_size: int) -> Any:
    """Restrict one batch entry to the cell.

    [b, s, ...] tensors (tokens, labels, loss_mask, position_ids) keep the cell's rows and tokens.
    A [b or 1, 1, s, s] attention mask keeps the cell's query rows and the key columns of every
    token up to the cell's end. Anything else (scalars, per-row tensors) passes unchanged.
    """
    if not isinstance(x, torch.Tensor):
        return x
    if x.dim() == 4 and x.shape[-1] == seq_length and x.shape[-2] == seq_length:
        rows = slice(cell.row_start, cell.row_end) if x.shape[0] == micro_batch_size else slice(None)
        return x[rows, :, cell.token_start:cell.token_end, :cell.token_end]
    if x.dim() >= 2 and x.shape[1] == seq_length:
        rows = slice(cell.row_start, cell.row_end) if x.shape[0] == micro_batch_size else slice(None)
        return x[rows, cell.token_start:cell.token_end]
    if x.dim() == 1 and x.shape[0] == seq_length and micro_batch_size != seq_length:
        return x[cell.token_start:cell.token_end]
    return x


def slice_batch(batch: Any, cell: Cell, seq_length: int, micro_batch_size: int) -> Any:
    if isinstance(batch, dict):
        return {k: slice_tensor(v, cell, seq_length, micro_batch_size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_tensor(v, cell, seq_length, micro_batch_size) for v in batch)
    return slice_tensor(batch, cell, seq_length, micro_batch_size)


def check_lengths(batch: Any, seq_length: int, micro_batch_size: int) -> None:
    """The plan's shapes come from seq_length: a batch of another length must not slip through."""
    if isinstance(batch, dict):
        if "cu_seqlens" in batch or "cu_seqlens_q" in batch:
            raise ValueError(
                "TeraPipe does not support packed (THD) sequences: the batch carries cu_seqlens; "
                "use padded [b, s] batches or Megatron's own schedule")
        tokens = batch.get("tokens", batch.get("input_ids"))
    elif isinstance(batch, (list, tuple)):
        tokens = next((v for v in batch if isinstance(v, torch.Tensor) and v.dim() == 2), None)
    else:
        tokens = batch if isinstance(batch, torch.Tensor) else None
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
        rows, length = tokens.shape
        if length != seq_length:
            raise ValueError(
                f"TeraPipe: the batch holds sequences of length {length} but the schedule was "
                f"called with seq_length={seq_length}: pass seq_length={length} and have a plan "
                f"for it (see PlanTable)")
        if rows != micro_batch_size:
            raise ValueError(
                f"TeraPipe: the batch has {rows} rows but the schedule was called with "
                f"micro_batch_size={micro_batch_size}")


_CAUSAL: dict[torch.device, torch.Tensor] = {}  # the largest causal mask built, per device
_PLAIN: dict[tuple[torch.device, int], torch.Tensor] = {}  # stand-ins for checked masks


def causal_mask(size: int, device: torch.device) -> torch.Tensor:
    """The causal mask [size, size] (True = masked: above the diagonal), a view of one kept per
    device and rebuilt only for a longer sequence: every microbatch of a run compares with it.
    The kept one's side is a multiple of 8, so its rows read as 8-byte words (`_words`)."""
    kept = _CAUSAL.get(device)
    if kept is None or kept.shape[0] < size:
        side = -(-size // 8) * 8
        kept = _CAUSAL[device] = torch.ones(side, side, dtype=torch.bool, device=device).triu(1)
    return kept[:size, :size]


def plain_causal_mask(size: int, device: torch.device) -> torch.Tensor:
    """A kept [size, size] causal mask that is never rebuilt: it stands in for a microbatch's
    mask found equal to it, so staged data needs no copy of that mask (4 MiB at 2048 tokens)
    and cells read it at one address every iteration. Nothing may write to it."""
    kept = _PLAIN.get((device, size))
    if kept is None:
        kept = _PLAIN[(device, size)] = causal_mask(size, device).clone()
    return kept


def _words(x: torch.Tensor) -> Optional[torch.Tensor]:
    """A bool tensor's bytes as int64 words, where its layout allows (last dim contiguous, a
    multiple of 8 long, other strides and offset multiples of 8), else None."""
    try:
        return x.view(torch.int64)
    except RuntimeError:
        return None


def is_plain_causal(mask: torch.Tensor, first_query: int = 0) -> bool:
    """Whether `mask` [..., queries, keys] (True = masked) is exactly the causal mask of queries
    first_query, first_query + 1, ... over keys 0, 1, ...: one comparison with the kept causal
    mask, no temporaries (on an H100 host, building them cost about 23 ms per 2048-token
    microbatch, more than its GPU time: docs/performance.md), 8 bytes at a time where both
    layouts allow (a 2048-token mask on one core of this project's CPU machine: 0.5 ms against
    3.4 ms a byte at a time)."""
    queries, keys = mask.shape[-2:]
    causal = causal_mask(max(first_query + queries, keys), mask.device)
    expected = causal[first_query:first_query + queries, :keys]
    mask = mask if mask.dtype == torch.bool else mask.bool()
    mask_words, expected_words = _words(mask), _words(expected)
    if mask_words is not None and expected_words is not None:
        return torch.equal(mask_words, expected_words.expand(mask_words.shape))
    return torch.equal(mask, expected.expand(mask.shape))


def check_causal_mask(batch: Any, seq_length: int) -> bool:
    """Token slicing is exact only if no token attends to a later one: reject other masks.
    Returns whether every mask in the batch is exactly the causal one (or there is none)."""
    masks = []
    if isinstance(batch, dict):
        masks = [batch.get("attention_mask")]
    elif isinstance(batch, (list, tuple)):
        masks = [v for v in batch if isinstance(v, torch.Tensor) and v.dim() == 4]
    plain = True
    for mask in masks:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            continue
        if mask.shape[-2:] != (seq_length, seq_length):
            raise ValueError(
                f"TeraPipe: attention_mask has shape {tuple(mask.shape)}, expected "
                f"[b or 1, 1, {seq_length}, {seq_length}] for seq_length {seq_length}")
        if is_plain_causal(mask):  # the usual mask: one pass over it
            continue
        plain = False
        if bool((~mask.bool() & causal_mask(seq_length, mask.device)).any()):
            raise ValueError(
                "TeraPipe: the attention_mask lets tokens attend to later tokens (not causal); "
                "token slicing needs causal attention. Use a causal mask (True = masked above "
                "the diagonal) or Megatron's own schedule for non-causal models")
    return plain


def _with_kept_mask(batch: Any) -> tuple[Any, Optional[str]]:
    """A dict batch whose bool attention_mask was found plain causal, with the kept causal mask
    in its place (same values, at a fixed address: staging need not copy it), and that key."""
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.dtype != torch.bool:
        return batch, None
    kept = plain_causal_mask(mask.shape[-1], mask.device).expand(mask.shape)
    return {**batch, "attention_mask": kept}, "attention_mask"


class CausalCut(dict):
    """A cell's dict batch whose attention_mask (if any) is the plain causal mask cut to the
    cell: CellData checked the whole microbatch's mask once, so per-cell readers need not."""


class CellData:
    """Reads each microbatch from the user's iterator at most once and hands out cell views.

    The read is lazy: it happens when forward_step_func first calls next() for a microbatch, so
    stages whose forward_step never reads (middle stages in pretrain_gpt) never consume data.
    With a `pool`, each batch's tensors are copied into pooled buffers (staged) as they are
    read, so cells read their data at the same addresses every iteration (what a CUDA graph
    replaying a cell needs; a mask found plain causal is not copied: the kept causal mask of
    `plain_causal_mask` stands in for it); `prefetch` reads and stages a microbatch before its
    first cell, outside it. Staged buffers go back to the pool with `release_staged`, after the last
    backward that may read them (a loss mask is saved for the loss's backward).
    """

    def __init__(self, data_iterator: Optional[Iterator], seq_length: int, micro_batch_size: int,
                 check_mask: bool = True, pool: Optional[BufferPool] = None) -> None:
        self.source = data_iterator
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.check_mask = check_mask
        self.pool = pool
        self.staged: list[torch.Tensor] = []
        self.read_any = False  # whether any microbatch was read on this stage
        self._batches: dict[int, Any] = {}
        self._next_microbatch = 0
        self._plain_causal: set[int] = set()  # microbatches whose mask is the plain causal one

    def _batch(self, microbatch: int) -> Any:
        if microbatch not in self._batches:
            # Forwards run microbatch by microbatch; earlier microbatches that were never read
            # were skipped by a forward_step that does not read on this stage.
            if microbatch < self._next_microbatch:
                raise RuntimeError(
                    f"TeraPipe: microbatch {microbatch} was read again after it was released")
            batch = next(self.source)  # type: ignore[arg-type]
            check_lengths(batch, self.seq_length, self.micro_batch_size)
            plain = self.check_mask and check_causal_mask(batch, self.seq_length)
            if plain:
                self._plain_causal.add(microbatch)
            if self.pool is not None:
                batch, kept = _with_kept_mask(batch) if plain else (batch, None)
                batch = self._staged(batch, unstaged=kept)
            self._batches[microbatch] = batch
            self._next_microbatch = microbatch + 1
            self.read_any = True
        return self._batches[microbatch]

    def prefetch(self, microbatch: int) -> None:
        """Read (and stage) a microbatch now, before its first cell; an exhausted source is
        left for the cell's own next() to report."""
        if self.source is None or microbatch in self._batches:
            return
        try:
            self._batch(microbatch)
        except StopIteration:
            pass

    def _staged(self, batch: Any, unstaged: Optional[str] = None) -> Any:
        if isinstance(batch, dict):
            return {k: v if k == unstaged else self._staged_tensor(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._staged_tensor(v) for v in batch)
        return self._staged_tensor(batch)

    def _staged_tensor(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.requires_grad:
            return x
        static = self.pool.take(tuple(x.shape), x.dtype, x.device)  # type: ignore[union-attr]
        static.copy_(x)
        self.staged.append(static)
        return static

    def release_staged(self) -> None:
        for tensor in self.staged:
            self.pool.give_back(tensor)  # type: ignore[union-attr]
        self.staged.clear()

    def release(self, microbatch: int) -> None:
        self._batches.pop(microbatch, None)
        self._plain_causal.discard(microbatch)

    def batch_if_read(self, microbatch: int) -> Any:
        """The whole microbatch if forward_step read it on this stage, else None."""
        return self._batches.get(microbatch)

    def iterator_for(self, cell: Cell) -> Optional[Iterator]:
        """The iterator forward_step_func gets for `cell`: it yields the cell's batch once,
        read from the source only when forward_step asks for it."""
        if self.source is None:
            return None
        return self._cell_batch(cell)

    def _cell_batch(self, cell: Cell) -> Iterator:
        try:
            batch = self._batch(cell.microbatch)
        except StopIteration:  # the source ran out: the caller's next() raises it too
            return
        cut = slice_batch(batch, cell, self.seq_length, self.micro_batch_size)
        plain = cell.microbatch in self._plain_causal and isinstance(cut, dict)
        yield CausalCut(cut) if plain else cut
