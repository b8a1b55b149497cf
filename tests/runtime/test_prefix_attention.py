"""CPU prefix attention (runtime/attention/cpu_prefix.py): a slice's attention over its cached
prefix as two flash blocks merged by log-sum-exps equals SDPA with the bottom-right causal
mask, in output and in every input's gradient; the slice attention takes it on CPU for long
slices without dropout, the masked call otherwise."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import megatron_terapipe.runtime.attention.slice_attention as attention_module
import megatron_terapipe.runtime.attention.cpu_prefix as prefix_attention
from megatron_terapipe.runtime.attention.slice_attention import SliceAttention, _lower_right_mask
from megatron_terapipe.runtime.context import running_cell
from megatron_terapipe.runtime.attention.kv_cache import KVCache
from megatron_terapipe.runtime.attention.cpu_prefix import (prefix_attention_available,
                                                        prefix_causal_attention)
from megatron_terapipe.schedule import Cell

from harness import spawn

pytestmark = pytest.mark.skipif(not prefix_attention_available(),
                                reason="this torch has no CPU flash attention kernel")

# (dtype, atol on values of order 1): the masked SDPA call is the reference
TOLERANCES = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 3e-2}


def _inputs(queries: int, keys: int, dtype: torch.dtype, batch: int = 2, heads: int = 3,
            head_dim: int = 16):
    """q, k, v as the slice attention passes them: [s, b, h, d] tensors permuted to
    [b, h, s, d] (not contiguous), leaves that require grad."""
    gen = torch.Generator().manual_seed(queries * 1000 + keys)
    shapes = ((queries, batch, heads, head_dim), (keys, batch, heads, head_dim),
              (keys, batch, heads, head_dim))
    leaves = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
              for s in shapes]
    return leaves, [t.permute(1, 2, 0, 3) for t in leaves]


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("queries,keys", [(1, 2), (1, 9), (4, 8), (5, 17), (64, 256), (63, 64)])
def test_equals_sdpa_with_the_bottom_right_mask_in_output_and_gradients(dtype, queries, keys):
    leaves, (q, k, v) = _inputs(queries, keys, dtype)
    scale = 0.3
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64).to(dtype)
    ours = prefix_causal_attention(q, k, v, scale)
    our_grads = torch.autograd.grad(ours, leaves, grad)
    mask = _lower_right_mask(queries, keys, q)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    reference_grads = torch.autograd.grad(reference, leaves, grad)
    atol = TOLERANCES[dtype]
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, reference, rtol=0, atol=atol)
    for name, mine, theirs in zip("qkv", our_grads, reference_grads):
        assert theirs.abs().max() > 0.01, name  # every input gets a gradient worth comparing
        torch.testing.assert_close(mine, theirs, rtol=0, atol=atol * 4, msg=name)


def test_the_last_query_sees_every_key_and_the_first_none_of_the_slice_after_it():
    """A value put only on the slice's last key reaches its last query and no other."""
    leaves, (q, k, v) = _inputs(4, 12, torch.float64, batch=1, heads=1)
    with torch.no_grad():
        leaves[2].zero_()
        leaves[2][-1] = 1.0
    out = prefix_causal_attention(q, k, v, 0.25)
    assert (out[0, 0, :3] == 0).all() and (out[0, 0, 3] > 0).all()


def test_needs_more_keys_than_queries():
    _, (q, k, v) = _inputs(4, 4, torch.float32)
    with pytest.raises(ValueError, match="more keys .4. than queries .4."):
        prefix_causal_attention(q, k, v, 0.25)


def _second_slice_attention(dropout: float, monkeypatch) -> list[str]:
    """Run the second of two slices (4 tokens) through SliceAttention and say which attention
    it took."""
    taken = []
    original = attention_module.prefix_causal_attention
    monkeypatch.setattr(attention_module, "prefix_causal_attention",
                        lambda *a: taken.append("prefix") or original(*a))
    monkeypatch.setattr(attention_module, "_lower_right_mask",
                        lambda *a: taken.append("masked") or _lower_right_mask(*a))
    module = SliceAttention(SimpleNamespace(kv_channels=8, attention_dropout=dropout), 1)
    cache = KVCache()
    for cell in (Cell(0, 0, 0, 0, 1, 0, 8, 2), Cell(0, 0, 1, 0, 1, 8, 4, 2)):
        q, k, v = (torch.randn(cell.tokens, 1, 2, 8) for _ in range(3))
        with running_cell(cell, cache, "forward"):
            module(q, k, v, None)
    return taken


def test_slice_attention_splits_long_slices_on_cpu_and_keeps_the_mask_otherwise(monkeypatch):
    """Split above SPLIT_ABOVE_TOKENS (here lowered to 3 and 4 for a 4-token slice), masked at
    or below it and wherever there is dropout."""
    assert prefix_attention.prefix_split_pays(513) and not prefix_attention.prefix_split_pays(512)
    monkeypatch.setattr(prefix_attention, "SPLIT_ABOVE_TOKENS", 3)
    assert _second_slice_attention(0.0, monkeypatch) == ["prefix"]
    assert _second_slice_attention(0.1, monkeypatch) == ["masked"]
    monkeypatch.setattr(prefix_attention, "SPLIT_ABOVE_TOKENS", 4)
    assert _second_slice_attention(0.0, monkeypatch) == ["masked"]


def run_split_stage_and_megatron(rank: int, world_size: int, slice_counts: tuple) -> dict:
    """bench_stage's GPT (PP=1, seq 64): Megatron's no-pipelining on its local spec (its own
    DotProductAttention) against TeraPipe in `slice_counts` token slices with every later slice
    split (SPLIT_ABOVE_TOKENS lowered to 0), same weights and batch: losses, gradients, and how
    many split calls ran."""
    import bench_stage
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    import megatron_terapipe as mt
    from harness import release_model_parallel

    mt.enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    args = bench_stage.parse_args(["--num-layers", "2", "--hidden-size", "32", "--seq-length",
                                   "64", "--vocab-size", "64", "--megatron-local-spec"])
    models, batch = bench_stage.build_models(args), bench_stage.make_batch(args)
    calls = []
    original = attention_module.prefix_causal_attention
    attention_module.prefix_causal_attention = lambda *a: calls.append(1) or original(*a)
    prefix_attention.SPLIT_ABOVE_TOKENS = 0

    def run(schedule, model, **extra) -> dict:
        model.zero_grad(set_to_none=True)
        losses = schedule(forward_step_func=bench_stage.forward_step, data_iterator=iter([batch]),
                          model=[model], num_microbatches=1, seq_length=args.seq_length,
                          micro_batch_size=1, **extra)
        return {"loss": float(losses[0]["lm loss"][0]),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}

    out = {"megatron": run(forward_backward_no_pipelining, models["megatron_local"])}
    for k in slice_counts:
        out[k] = run(mt.forward_backward_terapipe, models["terapipe"],
                     plan=mt.TeraPipePlan.uniform(args.seq_length, k))
        out[k]["split_calls"] = len(calls)
        calls.clear()
    # Megatron's selective recomputation of core attention (recompute_modules "core_attn"), set
    # on the built layers: the split runs again inside each cell's backward.
    for layer in models["terapipe"].decoder.layers:
        layer.self_attention.checkpoint_core_attention = True
    out["recomputed"] = run(mt.forward_backward_terapipe, models["terapipe"],
                            plan=mt.TeraPipePlan.uniform(args.seq_length, 2))
    out["recomputed"]["split_calls"] = len(calls)
    release_model_parallel()
    return out


def test_split_slices_through_a_gpt_equal_megatrons_own_attention():
    """Every loss within rel 1e-6 and every parameter gradient within rtol 1e-4 / atol 1e-6 (the
    suite's fp32 tolerances) of Megatron's no-pipelining run on its own DotProductAttention,
    with 2 and 4 token slices whose later slices all take the split (2 layers: (K-1) x 2 calls
    in forward), and with 2 slices under Megatron's selective recomputation of core attention."""
    out = spawn(1, "test_prefix_attention:run_split_stage_and_megatron", (2, 4), timeout=300)[0]
    reference = out["megatron"]
    runs = (2, 4, "recomputed")
    # (K-1) x 2 layers in forward; recomputed core attention runs its 2 calls again in backward
    assert [out[k]["split_calls"] for k in runs] == [2, 6, 4]
    for k in runs:
        assert out[k]["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        assert out[k]["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(out[k]["grads"][name], grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{k} slices: {name}")
