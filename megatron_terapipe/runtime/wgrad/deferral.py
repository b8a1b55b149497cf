"""What the deferring layers share: whether a call defers, and where its backward's piece goes.

A layer defers a parameter's gradient when it runs inside a TeraPipe cell whose schedule has W
actions (the running cell has a WeightGradStore), with grad mode on, and the parameter is a leaf
that requires grad and is not Megatron-FSDP's. The deferring autograd functions take the
parameter detached, so that autograd never runs the parameter's accumulate-grad hooks (DDP's
"gradient ready") before the W action delivers the real gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..context import active_cell
from .store import DeferredPiece, WeightGradStore, deliver

_ANCHORS: dict[torch.device, torch.Tensor] = {}
_DETACHED = WeakIdKeyDictionary()  # parameter -> its detached alias (tensors compare by value)


def deferrable(param: Optional[torch.Tensor]) -> bool:
    return (param is not None and param.requires_grad and param.grad_fn is None
            and not hasattr(param, "__fsdp_param__"))


def deferring_store(*params: Optional[torch.Tensor]) -> Optional[WeightGradStore]:
    """The running cell's store if these parameters (None entries ignored, at least one given)
    defer their gradients in this call; else None."""
    active = active_cell()
    if active is None or active.wgrad is None or not torch.is_grad_enabled():
        return None
    given = [p for p in params if p is not None]
    if not given or not all(deferrable(p) for p in given):
        return None
    return active.wgrad


def anchor(device: torch.device) -> torch.Tensor:
    """An empty leaf that requires grad, for deferring functions whose other inputs need none
    (an embedding's ids and detached table, a detached bias): as an input it makes their output
    require grad, so that backward reaches them. It never receives a gradient."""
    tensor = _ANCHORS.get(device)
    if tensor is None:
        tensor = _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return tensor


def hand_over(param: torch.Tensor, piece: DeferredPiece) -> None:
    """From a deferring backward: the piece goes to the running cell's store, tagged with the
    cell's first token; a backward outside the executor's cells delivers it at once."""
    active = active_cell()
    if active is not None and active.wgrad is not None:
        piece.position = active.cell.token_start
        active.wgrad.add(active.cell.sequence_key, param, piece)
        return
    with torch.no_grad():
        results = type(piece).gradients(param, [piece])
    deliver(results)


def detached(param: torch.Tensor) -> torch.Tensor:
    """`param.detach()`, kept per parameter while it still views the same memory the same way
    (a new `param.data` makes a new one): every deferring call of every cell needs one, and
    each detach is one more op for the host to dispatch."""
    if torch.is_inference_mode_enabled():
        return param.detach()  # an inference-mode alias cannot be saved for a later backward
    alias = _DETACHED.get(param)
    if (alias is None or alias.data_ptr() != param.data_ptr() or alias.dtype != param.dtype
            or alias.shape != param.shape or alias.stride() != param.stride()):
        alias = _DETACHED[param] = param.detach()
    return alias
