"""Megatron's gradient-sync protocol on a stage's lowered list, for one or several model chunks.

Megatron DDP's `no_sync` makes its gradient hooks skip the "gradient ready" bookkeeping that
starts a bucket's reduction (with overlap_grad_reduce); exiting it marks the next gradients as
the last microbatch's. Megatron's schedules keep every chunk in no_sync except around the
backward of a chunk's last microbatch (the first stage of 1F1B; every rank of the interleaved
schedule), or until the end of the run, which then calls `grad_sync_func` (non-first stages of
1F1B with a grad_sync_func). `config.no_sync_func` and `config.grad_sync_func` are one
callable, or one per model chunk as Megatron-LM sets them for virtual stages.

Here a parameter receives its gradient in the backward (B) actions, or, deferred, in its
sequence's W actions. A chunk's "last gradient" actions are its last B and, with deferred
weight gradients, its last W: each parameter gets exactly one gradient in them (B delivers
what cannot defer, W what did), so they run with sync enabled and everything else without:
each bucket then becomes ready exactly once per iteration (Megatron DDP asserts that no
parameter is marked ready twice).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Sequence, Union

import torch

from ...schedule import Action

SyncFunc = Union[None, Callable, Sequence[Callable]]


def _combined(no_sync_func: SyncFunc) -> Callable[[], ContextManager]:
    """One context for every chunk's no_sync (Megatron's interleaved `multi_no_sync`)."""
    if no_sync_func is None:
        return contextlib.nullcontext
    if callable(no_sync_func):
        return no_sync_func
    funcs = list(no_sync_func)

    def multi_no_sync() -> ContextManager:
        stack = contextlib.ExitStack()
        for func in funcs:
            stack.enter_context(func())
        return stack

    return multi_no_sync


def last_gradient_actions(actions: Sequence[Action], defer_wgrad: bool) -> set[int]:
    """ids of each chunk's last B and, with deferred weight gradients, its last W."""
    last: dict[tuple[str, int], Action] = {}
    for action in actions:
        if action.kind == "B" or (action.kind == "W" and defer_wgrad):
            last[(action.kind, getattr(action.cell, "chunk", 0))] = action
    return {id(action) for action in last.values()}


class GradSync:
    """No sync for the whole run but around each chunk's last-gradient actions (on the first
    stage, or without a grad_sync_func); else no sync until the end, which then calls
    grad_sync_func on every chunk's parameters."""

    def __init__(self, no_sync_func: SyncFunc, grad_sync_func: SyncFunc,
                 actions: Sequence[Action], defer_wgrad: bool, first_stage: bool) -> None:
        self.no_sync = _combined(no_sync_func)
        self.grad_sync_func = grad_sync_func
        self.at_last = first_stage or grad_sync_func is None
        self.sync_points = last_gradient_actions(actions, defer_wgrad) if self.at_last else set()
        self.context: Optional[ContextManager] = None

    def pause(self) -> None:
        if self.context is None:
            self.context = self.no_sync()
            self.context.__enter__()

    def resume(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def before(self, action: Action) -> bool:
        """Enable sync when `action` is one of its chunk's last-gradient actions; returns
        whether it did (the caller pauses again after the action)."""
        if id(action) in self.sync_points:
            self.resume()
            return True
        return False

    def at_end(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Enable sync; where it waited for the end, grad_sync_func per chunk (one callable
        serves every chunk, as in Megatron's interleaved schedule)."""
        self.resume()
        if not self.at_last and self.grad_sync_func is not None:
            funcs = (self.grad_sync_func if not callable(self.grad_sync_func)
                     else [self.grad_sync_func] * len(chunks))
            for func, chunk in zip(funcs, chunks):
                func(chunk.parameters())
