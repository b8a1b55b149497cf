"""One microbatch's MoE router losses on one layer, summed over its token slices.

Megatron-Core's router adds, per forward pass, the switch load-balancing loss
E * sum_i f_i * P_i * coeff / (topk * T^2) (f_i: tokens routed to expert i, P_i: router scores
summed per expert, T: tokens, each over the pass) and the z-loss (a mean of squared logsumexp
over the pass's tokens). Only P_i and the z-loss's logits carry a gradient, and that gradient
depends on the whole microbatch's counts. A TeraPipe cell sees only its slice, so each cell
adds its counts and sums here in its forward, and its backward takes the gradient from the
microbatch's totals: every order runs all of a microbatch's forwards on a stage before the
first of its backwards there (moe_router_losses.check_forwards_first). The autograd functions hold a
reference to their term, not a saved tensor: the term keeps growing after them.

Under sequence parallelism Megatron's TP rank r routes the r-th chunk of the whole sequence,
while a TeraPipe rank routes its chunk of each slice. Counts reduced over TP are the same
either way; what Megatron keeps per rank (the z-loss it logs, the token count that scales
per-token and z-loss gradients) is binned here by the rank that owns each token in Megatron's
layout (`token_owners`) and summed over TP when the microbatch is complete.

Formulas, scaling and logging follow megatron-core's router.py and moe_utils.py
(`switch_load_balancing_loss_func`, `attach_and_log_load_balancing_loss`, `apply_z_loss`); where
0.16 and 0.19 scale per-token losses differently, LossShape carries the line's convention
(platform/router_versions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

Number = Union[int, float, torch.Tensor]

#: The load-balancing types and the names Megatron's tracker logs them under.
SWITCH_LOSS_NAMES = {"aux_loss": "load_balancing_loss",
                     "seq_aux_loss": "seq_load_balancing_loss",
                     "global_aux_loss": "global_load_balancing_loss"}


@dataclass
class LossShape:
    """What every term of one router needs to know about the run (fixed per iteration)."""

    num_experts: int
    topk: int
    micro_batch_size: int  # rows of a whole microbatch (seq_aux_loss divides by them)
    seq_length: int
    per_token_loss: bool  # config.calculate_per_token_loss: scaled by the token count
    loss_scale: Callable[[], torch.Tensor]  # Megatron's MoEAuxLossAutoScaler scale, at backward
    tp_size: int = 1  # the router's TP x CP group (sequence-parallel chunks)
    tp_rank: int = 0
    per_token_factor: int = 1  # per-token losses x this beyond the token count (0.19: TP x CP)
    seq_aux_tokens_per_sequence: bool = True  # seq_aux_loss's per-token count per row (0.16)


def token_owners(shape: LossShape, token_start: int, local_tokens: int) -> torch.Tensor:
    """For each of a cell's local token positions, the TP rank that routes it in Megatron's
    unsliced run (sequence parallelism: rank r holds the r-th chunk of the sequence)."""
    positions = token_start + shape.tp_rank * local_tokens + torch.arange(local_tokens)
    return positions // (shape.seq_length // shape.tp_size)


def require_complete(term) -> None:
    if not term.complete:
        raise RuntimeError(
            "TeraPipe: a cell's backward needs its MoE router losses over the whole "
            "microbatch, but not all of the microbatch's token slices ran their forward on "
            "this stage first: the schedule's order must forward a whole microbatch before "
            "its first backward (both built-in orders, 1f1b and gpipe, do)")


@dataclass
class SwitchTerm:
    """One load-balancing loss (aux_loss, seq_aux_loss or global_aux_loss) of a microbatch.

    counts: tokens per expert reduced over the loss's group ([E]; seq_aux_loss: [rows, E]);
    total_tokens: Megatron's reduced token count (seq_aux_loss: per row, summed over the rows);
    scores: the router scores summed per expert (detached, for the logged value)."""

    kind: str
    coeff: float
    shape: LossShape
    counts: Optional[torch.Tensor] = None
    total_tokens: Number = 0
    scores: Optional[torch.Tensor] = None
    counts_for_loss: Optional[torch.Tensor] = None  # counts, or global_aux_loss's running mean
    local_tokens: Optional[torch.Tensor] = None  # per Megatron TP rank (per-token scaling)
    padded: bool = False  # the router got a padding mask (see finish)
    complete: bool = False

    def add(self, routing_map: torch.Tensor, scores: torch.Tensor, rows: slice, seq: int,
            counter: Callable[..., tuple], padded: bool = False) -> None:
        """Add one cell's tokens ([seq x rows, E], flattened as the router does). `counter` is
        Megatron's get_tokens_per_expert_and_token_count bound to this loss's group and
        padding (`padded`); `rows`: the cell's rows in the microbatch."""
        self.padded = self.padded or padded
        if self.kind != "seq_aux_loss":
            counts, _, total = counter(routing_map, topk=self.shape.topk)
            self._add(counts, scores.sum(dim=0), total, None)
            return
        bsz = rows.stop - rows.start  # Megatron's view: [s, b * E], experts per row
        counts, _, total = counter(routing_map.reshape(seq, -1), topk=self.shape.topk * bsz)
        summed = scores.reshape(seq, -1).sum(dim=0)
        self._add(counts.view(bsz, -1), summed.view(bsz, -1), total * bsz, rows)

    def _add(self, counts, scores, total, rows: Optional[slice]) -> None:
        if self.counts is None:
            size = (self.shape.micro_batch_size,) if rows is not None else ()
            self.counts = counts.new_zeros(size + counts.shape[-1:])
            self.scores = scores.new_zeros(size + scores.shape[-1:])
        where = rows if rows is not None else Ellipsis
        self.counts[where] += counts
        self.scores[where] += scores
        self.total_tokens = self.total_tokens + total

    def finish(self, router, owner_tokens: torch.Tensor) -> None:
        """The microbatch's last cell ran: per-row totals become Megatron's per-sequence ones,
        global_aux_loss adds the counts to the router's running mean (as its forward would).
        With a padding mask Megatron's per-token count is the loss group's total, not the
        rank's: get_tokens_per_expert_and_token_count all-reduces the rank's counts in place
        (mappings._reduce on a contiguous tensor) before it sums them for the local count."""
        if self.padded:
            owner_tokens = torch.zeros_like(owner_tokens) + self.total_tokens
        self.local_tokens = owner_tokens
        if self.kind == "seq_aux_loss":
            self.total_tokens = self.total_tokens / self.shape.micro_batch_size
            if self.shape.seq_aux_tokens_per_sequence:
                self.local_tokens = owner_tokens / self.shape.micro_batch_size
        self.counts_for_loss = self.counts
        if self.kind == "global_aux_loss":
            router.global_tokens_per_expert += self.counts
            router.ga_steps += 1
            self.counts_for_loss = router.global_tokens_per_expert / router.ga_steps
        self.complete = True

    def _factor(self) -> Number:
        shape, total = self.shape, self.total_tokens
        return shape.num_experts * self.coeff / (shape.topk * total * total)

    def value(self) -> torch.Tensor:
        """The microbatch's loss, as switch_load_balancing_loss_func computes it."""
        loss = torch.sum(self.scores * self.counts_for_loss) * self._factor()
        return loss / self.shape.micro_batch_size if self.kind == "seq_aux_loss" else loss

    def score_grad(self, scores_shape: torch.Size, rows: slice, owners: torch.Tensor) -> torch.Tensor:
        """d loss / d scores of one cell ([seq x rows, E]): the microbatch's counts, scaled as
        Megatron scales the loss it attaches (the autoscaler's scale, 1 / rows for
        seq_aux_loss, and per token the token count of the rank that routes it, x the line's
        per-token factor)."""
        require_complete(self)
        grad = self.shape.loss_scale()
        if self.kind == "seq_aux_loss":
            grad = grad / self.shape.micro_batch_size
        per_expert = grad * self._factor() * self.counts_for_loss
        seq, bsz = owners.shape[0], rows.stop - rows.start
        if self.kind == "seq_aux_loss":
            per_expert = per_expert[rows].unsqueeze(0)  # [1, rows, E]
        grad = per_expert.expand(seq, bsz, -1)
        if self.shape.per_token_loss:
            tokens = self.local_tokens[owners] * self.shape.per_token_factor
            grad = grad * tokens.view(seq, 1, 1).to(grad.dtype)
        return grad.reshape(scores_shape)


@dataclass
class ZTerm:
    """The router z-loss of a microbatch: squared logsumexp of the logits summed over the valid
    tokens, per Megatron TP rank; coeff is Megatron's (moe_z_loss_coeff / TP x CP size)."""

    coeff: float
    shape: LossShape
    sums: Optional[torch.Tensor] = None  # [TP]
    tokens: Optional[torch.Tensor] = None  # valid tokens per Megatron TP rank, when complete
    complete: bool = False

    def add(self, values: torch.Tensor, owners: torch.Tensor) -> None:
        """values: [seq, rows] squared logsumexp (0 on padding)."""
        if self.sums is None:
            self.sums = values.new_zeros(self.shape.tp_size)
        self.sums.index_add_(0, owners, values.sum(dim=1))

    def value(self) -> torch.Tensor:
        """What z_loss_func returns on this rank in Megatron's run (its tokens' mean x coeff)."""
        rank = self.shape.tp_rank
        return self.sums[rank] / torch.clamp(self.tokens[rank], min=1.0) * self.coeff

    def values_grad(self, values_shape: torch.Size, owners: torch.Tensor) -> torch.Tensor:
        """d loss / d (a cell's per-token squared logsumexp, [seq x rows])."""
        require_complete(self)
        grad = self.shape.loss_scale() * self.coeff  # per-token loss: each token's own term
        seq = owners.shape[0]
        per_position = grad.expand(seq)
        if self.shape.per_token_loss:
            per_position = per_position * self.shape.per_token_factor
        else:
            per_position = per_position / torch.clamp(self.tokens[owners], min=1.0)
        return per_position.view(seq, 1).expand(seq, values_shape[0] // seq).reshape(values_shape)


@dataclass
class MicrobatchLosses:
    """Every loss term of one router for one microbatch. `tokens`: rows x tokens of the cells
    added so far (complete at micro_batch_size x seq_length); `owner_tokens`: valid tokens per
    Megatron TP rank."""

    switch: dict[str, SwitchTerm] = field(default_factory=dict)
    z: Optional[ZTerm] = None
    tokens: int = 0
    owner_tokens: Optional[torch.Tensor] = None
    complete: bool = False

    def add_tokens(self, valid: torch.Tensor, owners: torch.Tensor, tp_size: int) -> None:
        """valid: [seq, rows], 1 for tokens that count."""
        if self.owner_tokens is None:
            self.owner_tokens = valid.new_zeros(tp_size, dtype=torch.float32)
        self.owner_tokens.index_add_(0, owners, valid.sum(dim=1).float())


class SwitchLossGrad(torch.autograd.Function):
    """Attached to the router's probs like Megatron's MoEAuxLossAutoScaler: in backward it
    passes the probs' gradient on and gives the scores the microbatch's loss gradient."""

    @staticmethod
    def forward(ctx, probs, scores, term: SwitchTerm, rows: slice, owners: torch.Tensor):
        ctx.term, ctx.rows, ctx.owners, ctx.scores_shape = term, rows, owners, scores.shape
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        return grad_probs, ctx.term.score_grad(ctx.scores_shape, ctx.rows, ctx.owners), None, None, None


class ZLossGrad(torch.autograd.Function):
    """Attached to the router's logits: the cell's per-token squared logsumexp gets the
    gradient of the microbatch's z-loss."""

    @staticmethod
    def forward(ctx, logits, values, term: ZTerm, owners: torch.Tensor):
        ctx.term, ctx.owners, ctx.values_shape = term, owners, values.shape
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        return grad_logits, ctx.term.values_grad(ctx.values_shape, ctx.owners), None, None


def squared_logsumexp(logits: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """z_loss_func's per-token values, 0 on padding (Megatron's mask there is True for padding)."""
    values = torch.square(torch.logsumexp(logits, dim=-1))
    return values if padding_mask is None else values * ~padding_mask
