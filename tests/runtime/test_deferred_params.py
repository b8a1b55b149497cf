"""Deferred gradients of every parameter kind, on torch modules alone (no Megatron): a sequence
cut into token slices, each slice's forward and backward run in its cell, then the sequence's W
action. The W must give the unsliced gradient: bit for bit where it runs the unsliced kernel on
the slices put back in token order (LayerNorm, embeddings), and where Megatron DDP's fp32
main_grad exists, accumulate linear weights inside their GEMMs and fire DDP's hook once."""

import pytest
import torch

from megatron_terapipe.runtime.context import running_cell
from megatron_terapipe.runtime.wgrad.deferral import detached, hand_over
from megatron_terapipe.runtime.wgrad.embedding import defer_embedding
from megatron_terapipe.runtime.wgrad.linear import BiasGradPiece, deferred_bias
from megatron_terapipe.runtime.wgrad.norm import NormPiece, defer_norm
from megatron_terapipe.runtime.attention.kv_cache import KVCache
from megatron_terapipe.runtime.wgrad.store import WeightGradPiece, WeightGradStore, deliver
from megatron_terapipe.schedule import Cell

SLICES = (3, 5, 2, 6)


def _cells(slices=SLICES):
    starts = [sum(slices[:i]) for i in range(len(slices))]
    return [Cell(0, 0, i, 0, 2, start, n, len(slices)) for i, (start, n) in enumerate(zip(starts, slices))]


def _sliced(run, grad, slices=SLICES, token_dim=0):
    """Forward each slice in its cell, backward them in reverse in theirs, then the W action.
    `run(cell)` returns the slice's output; `grad` the whole sequence's output gradient."""
    store, cache = WeightGradStore(), KVCache(seq_length=sum(slices))
    outputs = []
    for cell in _cells(slices):
        with running_cell(cell, cache, "forward", wgrad=store):
            outputs.append(run(cell))
    for cell, out in reversed(list(zip(_cells(slices), outputs))):
        with running_cell(cell, cache, "backward", wgrad=store):
            out.backward(grad.narrow(token_dim, cell.token_start, cell.tokens))
    assert len(store) == 1 and store.deferred > 0
    store.flush((0, 0))
    return store


def _unsliced_grads(module, run, grad):
    module.zero_grad(set_to_none=True)
    run().backward(grad)
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_w_is_the_unsliced_gradient(dtype):
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8).to(dtype)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(16, 2, 8, dtype=dtype)  # [s, b, h], Megatron's layout
    grad = torch.randn(16, 2, 8, dtype=dtype)
    xs = x.clone().requires_grad_()
    expected = _unsliced_grads(norm, lambda: norm(xs), grad)
    defer_norm(norm)
    norm.zero_grad(set_to_none=True)
    sliced_x = x.clone().requires_grad_()
    store = _sliced(lambda c: norm(sliced_x[c.token_start:c.token_end]), grad)
    assert store.deferred == 2 * len(SLICES)  # weight and bias per slice
    for name, p in norm.named_parameters():
        assert torch.equal(p.grad, expected[name]), name
    torch.testing.assert_close(sliced_x.grad, xs.grad, rtol=0, atol=0)


def test_rms_norm_w_matches_the_unsliced_gradient():
    torch.manual_seed(1)
    norm = torch.nn.RMSNorm(8, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x, grad = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    xs = x.clone().requires_grad_()
    expected = _unsliced_grads(norm, lambda: norm(xs), grad)
    defer_norm(norm)
    norm.zero_grad(set_to_none=True)
    sliced_x = x.clone().requires_grad_()
    _sliced(lambda c: norm(sliced_x[c.token_start:c.token_end]), grad)
    # torch's RMSNorm is composite on CPU; the deferring one runs the fused forward kernel
    torch.testing.assert_close(norm.weight.grad, expected["weight"], rtol=1e-6, atol=1e-6)
    # the W's own gradient has the weight's shape (autograd would quietly sum a [b, h] one)
    piece = NormPiece(x, grad, None, torch.ones(16, 2, 1), (8,), None)
    (_, dw), = NormPiece.gradients(norm.weight, [piece, piece])
    assert dw.shape == norm.weight.shape
    torch.testing.assert_close(sliced_x.grad, xs.grad, rtol=1e-6, atol=1e-6)


def test_embedding_w_is_one_dense_gradient_equal_to_the_unsliced_one():
    torch.manual_seed(2)
    table = torch.nn.Embedding(11, 4)
    ids = torch.randint(0, 11, (2, 16))  # [b, s]
    grad = torch.randn(2, 16, 4)
    expected = _unsliced_grads(table, lambda: table(ids), grad)
    defer_embedding(table)
    table.zero_grad(set_to_none=True)
    accumulations = []
    table.weight.register_post_accumulate_grad_hook(lambda p: accumulations.append(1))
    _sliced(lambda c: table(ids[:, c.token_start:c.token_end]), grad, token_dim=1)
    assert len(accumulations) == 1  # one dense gradient for the sequence, not one per slice
    assert torch.equal(table.weight.grad, expected["weight"])


def test_a_deferred_bias_sums_its_slices_and_rounds_16_bit_once():
    torch.manual_seed(3)
    bias = torch.nn.Parameter(torch.zeros(4))
    x, grad = torch.randn(16, 2, 4, requires_grad=True), torch.randn(16, 2, 4)
    _sliced(lambda c: x[c.token_start:c.token_end] + deferred_bias(bias), grad)
    torch.testing.assert_close(bias.grad, grad.sum(dim=(0, 1)), rtol=1e-6, atol=1e-6)
    # bf16 partial sums are added in float32 and rounded once
    parts = [torch.tensor([v], dtype=torch.bfloat16) for v in (1.0, 2 ** -8, 2 ** -8)]
    b16 = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    (_, total), = BiasGradPiece.gradients(b16, [BiasGradPiece(p) for p in parts])
    assert total.item() == 1 + 2 ** -7  # bf16 adds in order would round 1 + 2^-8 to 1 twice


def test_outside_cells_a_deferring_backward_delivers_at_once():
    bias = torch.nn.Parameter(torch.zeros(3))
    (torch.ones(3) + deferred_bias(bias)).sum().backward()
    assert torch.equal(bias.grad, torch.ones(3))


class _DDPLike:
    """What Megatron DDP gives a parameter: an fp32 main_grad, grad_added_to_main_grad, and a
    hook on its accumulate-grad node that adds param.grad unless that flag says it is in."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param, self.hook_calls, self.adds = param, 0, 0
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
        param.grad_added_to_main_grad = False
        # kept, as DDP keeps it: a parameter holds its accumulate-grad node only weakly
        self.grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]
        self.grad_acc.register_hook(self.hook)

    def hook(self, *unused):
        self.hook_calls += 1
        p = self.param
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad.float())
            self.adds += 1
        p.grad = None


def _linear_pieces(dtype, fused=None, fusion=False):
    torch.manual_seed(4)
    xs = [torch.randn(n, 2, 5) for n in SLICES]
    gs = [torch.randn(n, 2, 6) for n in SLICES]
    pieces = [WeightGradPiece(x.to(dtype), g.to(dtype), False, None, fusion, fused_accumulate=fused,
                              position=sum(SLICES[:i])) for i, (x, g) in enumerate(zip(xs, gs))]
    exact = torch.cat(gs).reshape(-1, 6).t() @ torch.cat(xs).reshape(-1, 5)
    return pieces, exact


def test_fp32_main_grad_accumulates_inside_the_gemms_and_the_hook_fires_once():
    weight = torch.nn.Parameter(torch.zeros(6, 5))
    ddp = _DDPLike(weight)
    store = WeightGradStore()
    pieces, exact = _linear_pieces(torch.float32)
    for piece in reversed(pieces):
        store.add((0, 0), weight, piece)
    seen = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if args and isinstance(args[0], torch.Tensor) and args[0] is weight.main_grad:
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        store.flush((0, 0))
    assert seen == ["addmm_"] * len(SLICES)  # no GEMM result added separately
    assert ddp.hook_calls == 1 and ddp.adds == 0
    assert weight.grad_added_to_main_grad is False  # restored: later gradients still add
    torch.testing.assert_close(weight.main_grad, exact, rtol=1e-5, atol=1e-5)


def test_16_bit_main_grad_uses_the_fused_kernel_with_fusion_and_one_rounding_without():
    calls = []

    def kernel(x, go, main_grad):  # stands for apex's wgrad_gemm_accum_fp32
        calls.append(x.dtype)
        main_grad.addmm_(go.t().float(), x.float())

    for fusion in (True, False):
        weight = torch.nn.Parameter(torch.zeros(6, 5, dtype=torch.bfloat16))
        ddp = _DDPLike(weight)
        pieces, exact = _linear_pieces(torch.bfloat16, kernel, fusion)
        deliver(WeightGradPiece.gradients(weight, pieces))
        assert ddp.hook_calls == 1 and ddp.adds == (0 if fusion else 1)
        torch.testing.assert_close(weight.main_grad, exact, rtol=2e-2, atol=5e-2)
    assert calls == [torch.bfloat16] * len(SLICES)  # with fusion only


def test_a_tied_parameter_gets_the_sum_of_its_kinds():
    """A tied embedding on one stage: the output layer's GEMMs go into main_grad, the lookup's
    dense gradient through the hook, and DDP adds only that."""
    weight = torch.nn.Parameter(torch.zeros(6, 5))
    ddp = _DDPLike(weight)
    pieces, exact = _linear_pieces(torch.float32)
    dense = torch.randn(6, 5)
    results = WeightGradPiece.gradients(weight, pieces) + [(weight, dense)]
    deliver(results)
    assert ddp.hook_calls == 1 and ddp.adds == 1
    torch.testing.assert_close(weight.main_grad, exact + dense, rtol=1e-5, atol=1e-5)


def test_hand_over_tags_pieces_with_their_slice():
    store, cache = WeightGradStore(), KVCache(seq_length=16)
    bias = torch.nn.Parameter(torch.zeros(1))
    for cell in reversed(_cells()):
        with running_cell(cell, cache, "backward", wgrad=store):
            hand_over(bias, BiasGradPiece(torch.ones(1)))
    (_, pieces), = store.pending[(0, 0)].values()
    assert sorted(p.position for p in pieces) == [0, 3, 8, 10]


def test_a_parameter_given_new_data_gets_a_new_detached_alias():
    param = torch.nn.Parameter(torch.zeros(3))
    alias = detached(param)
    assert detached(param) is alias and not alias.requires_grad
    assert alias.data_ptr() == param.data_ptr()
    param.data = torch.ones(3)  # e.g. Megatron DDP moving parameters into its buffer
    again = detached(param)
    assert again is not alias and torch.equal(again, torch.ones(3))
    param.data = torch.arange(6.0)[::2]  # same size, other strides
    assert torch.equal(detached(param), torch.tensor([0.0, 2.0, 4.0]))
