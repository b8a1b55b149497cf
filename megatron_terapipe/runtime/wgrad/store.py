"""Deferred weight gradients: a token slice's backward computes only what the previous stage waits for.

A linear layer's backward is two GEMMs: the input gradient (dgrad), which the previous stage is
waiting for, and the weight gradient (wgrad), which nothing needs before the optimizer step.
With token slices, the per-slice wgrad GEMM is thin (its inner dimension is the slice's tokens),
and it sits on the pipeline's critical path; and every parameter's gradient, computed per slice,
is one more accumulation per slice. So, inside a TeraPipe backward cell, every parameter of the
stage that can defer hands what its gradient needs (a "piece") to a `WeightGradStore`:

- the local linear layers (`ColumnParallelLinear`, `RowParallelLinear`, the output layer
  included): their input and output gradient; a bias added inside the layer takes its gradient
  from the same output gradients (linear.py);
- a bias a layer hands out to be added elsewhere: its per-slice gradient (linear.py);
- torch LayerNorm / RMSNorm: their input, statistics and output gradient (norm.py);
- embedding tables: the looked-up ids and the output gradient (embedding.py).

The schedule's W action for a sequence then computes one gradient per parameter over all its
slices and delivers it through autograd, so gradient hooks (Megatron DDP's grad-ready hooks and
main_grad accumulation) run exactly as they would have, once per sequence however many token
slices it has. Where the fp32 `main_grad` of Megatron DDP exists, a linear weight's gradient
accumulates inside its GEMMs (`addmm_` into main_grad, or Megatron's fused wgrad kernel for
16-bit inputs with gradient_accumulation_fusion) and autograd only carries a marker, as
Megatron's own gradient-accumulation fusion does.

Outside a TeraPipe cell, and for frozen parameters, parameters that are not leaves, Megatron-FSDP
parameters and the output layer's own `defer_embedding_wgrad_compute` buffer, the layers run
their original code unchanged (megatron/model/param_deferral.py makes that choice and patches them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist

#: What a piece's gradient is when it already went into the parameter's main_grad.
IN_MAIN_GRAD: Any = object()

Gradient = tuple[torch.Tensor, Any]  # (parameter, its gradient: a tensor, IN_MAIN_GRAD or None)


class DeferredPiece:
    """One backward's share of some parameters' gradients, waiting for the sequence's W action.

    Subclasses hold `input` and `grad_output` (the tensors kept until the W action; the memory
    meter counts them), `position` (the slice's first token: the W puts pieces in token order)
    and compute the gradients of a list of pieces of one parameter in `gradients`."""

    params_per_piece: ClassVar[int] = 1
    input: torch.Tensor
    grad_output: torch.Tensor
    position: int

    def group(self, param: torch.Tensor) -> tuple:
        """Pieces with the same group are computed together."""
        return (type(self), id(param))

    @property
    def param_count(self) -> int:
        """Parameter gradients this piece carries (RunRecord.deferred_wgrads counts them)."""
        return self.params_per_piece

    @staticmethod
    def gradients(param: torch.Tensor, pieces: list) -> list[Gradient]:
        raise NotImplementedError


@dataclass
class WeightGradPiece(DeferredPiece):
    """A linear layer's backward: its weight gradient is grad_output^T @ input."""

    input: torch.Tensor  # this rank's input rows (sequence parallel: gathered at flush)
    grad_output: torch.Tensor
    sequence_parallel: bool
    tp_group: Optional[dist.ProcessGroup]
    accumulate_in_main_grad: bool  # Megatron's gradient_accumulation_fusion
    bias: Optional[torch.Tensor] = None  # a bias added inside the layer: grad_output's column sums
    # Megatron's fused kernel (input, grad_output, main_grad) accumulating 16-bit GEMMs in fp32.
    fused_accumulate: Optional[Callable] = None
    position: int = 0

    def group(self, param: torch.Tensor) -> tuple:
        return (type(self), id(param), id(self.bias))

    @property
    def param_count(self) -> int:
        return 1 + (self.bias is not None)

    @staticmethod
    def gradients(param: torch.Tensor, pieces: list["WeightGradPiece"]) -> list[Gradient]:
        gos = [_rows(p.grad_output) for p in pieces]
        out: list[Gradient] = [(param, _linear_weight_grad(param, pieces, gos))]
        bias = pieces[0].bias
        if bias is not None:
            out.append((bias, summed(gos, bias.dtype)))
        return out


@dataclass
class WeightGradStore:
    """Deferred gradient pieces per sequence (microbatch, batch slice), grouped per parameter."""

    pending: dict[tuple[int, int], dict[tuple, tuple[torch.Tensor, list[DeferredPiece]]]] = field(
        default_factory=dict)
    deferred: int = 0  # parameter gradients received so far (each one a backward did not compute)

    def add(self, sequence_key: tuple[int, int], weight: torch.Tensor, piece: DeferredPiece) -> None:
        self.deferred += piece.param_count
        groups = self.pending.setdefault(sequence_key, {})
        groups.setdefault(piece.group(weight), (weight, []))[1].append(piece)

    def __len__(self) -> int:
        return len(self.pending)

    def flush(self, sequence_key: tuple[int, int]) -> None:
        """Compute and deliver every deferred gradient of one sequence."""
        groups = self.pending.pop(sequence_key, None)
        if not groups:
            return
        results: list[Gradient] = []
        with torch.no_grad():  # plain GEMMs, reductions (and gathers): no graph to build
            for param, pieces in groups.values():
                pieces = sorted(pieces, key=lambda p: p.position)  # token order, as unsliced
                results += type(pieces[0]).gradients(param, pieces)
        # A gradient a piece holds as it is (one slice's bias gradient) reaches autograd with
        # no other reference only once the pieces are gone: then .grad takes it, not a copy.
        groups.clear()
        del pieces
        deliver(results)


def deliver(results: list[Gradient]) -> None:
    """Hand gradients to autograd on the parameters themselves: accumulates into .grad and runs
    their hooks (Megatron DDP's main_grad accumulation and grad-ready hooks). A parameter with
    several gradients (a tied embedding: lookup and output layer) gets their sum. One whose
    gradient already went into main_grad gets a marker with `grad_added_to_main_grad` set while
    it is delivered, so that DDP's hook only marks it ready; the flag is restored after, so a
    gradient arriving later the usual way is still added. `results` is emptied: the gradients
    reach autograd from `_Delivery`'s backward with no other reference, so a parameter without
    a gradient takes the tensor itself instead of a copy."""
    params, holder, markers = _merged(results)
    if not params:
        return
    flags = [p.grad_added_to_main_grad for p in markers]
    for p in markers:
        p.grad_added_to_main_grad = True
    try:
        with torch.enable_grad():  # also from inside a backward (a piece delivered at once)
            root = _Delivery.apply(holder, *params)
        torch.autograd.backward(root, root.new_empty(0))
    finally:
        for p, flag in zip(markers, flags):
            p.grad_added_to_main_grad = flag


def _merged(results: list[Gradient]) -> tuple[list[torch.Tensor], list, list[torch.Tensor]]:
    """(parameters, [their gradients], parameters of those that are markers), emptying results."""
    grads: dict[int, list] = {}
    in_main: dict[int, torch.Tensor] = {}
    while results:
        param, grad = results.pop()
        if grad is None:
            continue
        if grad is IN_MAIN_GRAD:
            in_main[id(param)] = param
        elif id(param) in grads:
            grads[id(param)][1] = grads[id(param)][1] + grad
        else:
            grads[id(param)] = [param, grad]
    markers = [p for key, p in in_main.items()
               if key not in grads and hasattr(p, "grad_added_to_main_grad")]
    params = [p for p, _ in grads.values()] + markers
    return params, [[g for _, g in grads.values()] + [_marker(p) for p in markers]], markers


class _Delivery(torch.autograd.Function):
    """A root whose backward gives each parameter its gradient."""

    @staticmethod
    def forward(ctx, holder, *params):
        ctx.holder = holder
        return params[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.holder.pop())


def _marker(param: torch.Tensor) -> torch.Tensor:
    # As Megatron's dummy wgrad: DDP's hook does not read it unless zero_out_wgrad (a tied
    # embedding on one stage) says it adds param.grad, which must then be zeros.
    if getattr(param, "zero_out_wgrad", False):
        return torch.zeros_like(param)
    return torch.empty_like(param)


def summed(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Column sums of 2-D parts, over all parts, in float32 or wider and rounded once to dtype
    (16-bit partial sums rounded per slice would lose what the unsliced sum keeps)."""
    acc = accumulation_dtype(parts[0].dtype)
    total = parts[0].sum(dim=0, dtype=acc)
    for part in parts[1:]:
        total += part.sum(dim=0, dtype=acc)
    return total.to(dtype)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # a plain rule: torch.promote_types would be one more dispatched op per call
    return torch.float64 if dtype == torch.float64 else torch.float32


def _linear_weight_grad(weight: torch.Tensor, pieces: list[WeightGradPiece],
                        gos: list[torch.Tensor]) -> Any:
    """In float32 and float64, each piece's GEMM accumulates into one output (`addmm_`): as
    fast as one GEMM over rows that are already contiguous, without the copies of concatenating
    them (measured on CPU, hidden 512, 8 or 16 slices: 1-4% faster per weight). Into Megatron
    DDP's main_grad of the same dtype, the GEMMs accumulate there directly. In 16-bit types the
    pieces are concatenated for one GEMM, which accumulates in float32 and rounds once, as the
    unsliced weight gradient does; adding rounded 16-bit partial sums would lose precision.
    With gradient_accumulation_fusion, Megatron's fused kernel accumulates them in main_grad."""
    inputs = [_gathered(p) for p in pieces]
    # autocast: the forward's GEMM ran in the output's dtype
    inputs = [x if x.dtype == go.dtype else x.to(go.dtype) for x, go in zip(inputs, gos)]
    main_grad = getattr(weight, "main_grad", None)
    fusion = pieces[0].accumulate_in_main_grad
    if main_grad is not None and (fusion or hasattr(weight, "grad_added_to_main_grad")):
        if main_grad.dtype == gos[0].dtype:
            for go, x in zip(gos, inputs):
                main_grad.addmm_(go.t(), x)
            return IN_MAIN_GRAD
        if fusion and pieces[0].fused_accumulate is not None:
            for go, x in zip(gos, inputs):
                pieces[0].fused_accumulate(x, go, main_grad)
            return IN_MAIN_GRAD
    if gos[0].dtype not in (torch.float32, torch.float64) and len(pieces) > 1:
        gos, inputs = [torch.cat(gos)], [torch.cat(inputs)]
    wgrad = gos[0].t().matmul(inputs[0])
    for go, x in zip(gos[1:], inputs[1:]):
        wgrad.addmm_(go.t(), x)
    if fusion and main_grad is not None:  # Megatron keeps this gradient in main_grad only
        main_grad.add_(wgrad)
        return IN_MAIN_GRAD
    return wgrad.to(weight.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.size(-1))


def _gathered(piece: WeightGradPiece) -> torch.Tensor:
    x = piece.input
    return _rows(all_gathered(x, piece.tp_group) if piece.sequence_parallel else x)


def all_gathered(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` from every rank of `group`, along dim 0 (the token dim under sequence parallelism)."""
    total = torch.empty((x.size(0) * group.size(),) + tuple(x.shape[1:]), dtype=x.dtype,
                        device=x.device)
    dist.all_gather_into_tensor(total, x.contiguous(), group=group)
    return total
