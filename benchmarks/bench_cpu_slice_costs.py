"""What cutting a sequence into token slices, and deferring weight gradients, cost on this CPU:
the per-cell costs behind the CPU virtual-stage plans (docs/performance.md).

    python benchmarks/bench_cpu_slice_costs.py                 # bench_virtual_cpu's model
    python benchmarks/bench_cpu_slice_costs.py --repeats 9 --out /tmp/slice_costs.json

One torch thread (as each pipeline stage runs in the CPU benchmarks), hidden 512, 8 heads,
seq 2048 unless told otherwise. Two parts, medians over `--repeats` after one warm-up:
1. Attention of one sequence cut into K equal token slices, forward and backward summed over
   the slices, the first slice with SDPA's causal flag and every later one over its whole
   prefix in two ways: `masked`, SDPA with the additive bottom-right mask (CPU SDPA has no
   bottom-right causal flag, so a masked call computes every block of the query x key
   rectangle, the masked triangle included; the slice attention's CPU path where there is
   dropout), and `prefix`, the prefix and the slice's own causal
   block merged by log-sum-exps (runtime/attention/cpu_prefix.py: what it computes on CPU now).
2. One slice over its prefix (twice or three times its length), forward + backward, masked
   against split, by the slice's length: where the split pays (attention/cpu_prefix.py,
   SPLIT_ABOVE_TOKENS).
3. One GPT layer (Megatron's, with the slice-aware spec) on the whole sequence: its backward
   with the weight gradients inside, against the backward without them plus the W action that
   computes them (measure/layers.py, as the planner's profile measures them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from provenance import describe, provenance, script_command  # noqa: E402


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_ms(seq: int, hidden: int, heads: int, slices: int, repeats: int,
                 method: str) -> dict:
    """Forward and backward ms of one sequence's attention in `slices` equal slices, the later
    slices `masked` or `prefix` (module docstring)."""
    import torch
    import torch.nn.functional as F

    from megatron_terapipe.runtime.attention.slice_attention import _lower_right_mask
    from megatron_terapipe.runtime.attention.cpu_prefix import prefix_causal_attention

    d, sq = hidden // heads, seq // slices
    k, v = (torch.randn(1, heads, seq, d) for _ in range(2))
    q = [torch.randn(1, heads, sq, d, requires_grad=True) for _ in range(slices)]
    grad = torch.randn(1, heads, sq, d)
    masks = [None] + [_lower_right_mask(sq, (i + 1) * sq, k) for i in range(1, slices)]

    def one_slice(i: int):
        end = (i + 1) * sq
        if i == 0:
            return F.scaled_dot_product_attention(q[0], k[:, :, :sq], v[:, :, :sq], is_causal=True)
        if method == "prefix":
            return prefix_causal_attention(q[i], k[:, :, :end], v[:, :, :end], d ** -0.5)
        return F.scaled_dot_product_attention(q[i], k[:, :, :end], v[:, :, :end],
                                              attn_mask=masks[i])

    def forward():
        with torch.no_grad():
            for i in range(slices):
                one_slice(i)

    def forward_backward():
        for i in range(slices):
            one_slice(i).backward(grad)

    fwd = _median_seconds(forward, repeats)
    both = _median_seconds(forward_backward, repeats)
    return {"slices": slices, "method": method, "forward_ms": 1e3 * fwd,
            "backward_ms": 1e3 * (both - fwd)}


def split_against_mask(heads: int, head_dim: int, repeats: int) -> list[dict]:
    """Forward + backward ms of one slice over a prefix of 1 or 2 slices before it, masked and
    split, for slice lengths around the CPU kernel's 512-key blocks."""
    import torch
    import torch.nn.functional as F

    from megatron_terapipe.runtime.attention.slice_attention import _lower_right_mask
    from megatron_terapipe.runtime.attention.cpu_prefix import prefix_causal_attention

    rows = []
    for queries in (128, 256, 384, 512, 640, 768, 1024):
        for keys in (2 * queries, 3 * queries):
            q = torch.randn(1, heads, queries, head_dim, requires_grad=True)
            k, v = (torch.randn(1, heads, keys, head_dim, requires_grad=True) for _ in range(2))
            grad = torch.randn(1, heads, queries, head_dim)
            mask = _lower_right_mask(queries, keys, q)
            masked = _median_seconds(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask).backward(grad), repeats)
            split = _median_seconds(lambda: prefix_causal_attention(
                q, k, v, head_dim ** -0.5).backward(grad), repeats)
            rows.append({"queries": queries, "keys": keys, "masked_ms": 1e3 * masked,
                         "split_ms": 1e3 * split, "split_over_masked": split / masked})
    return rows


def deferral_ms(seq: int, hidden: int, heads: int, repeats: int) -> dict:
    """One layer on the whole sequence: forward, backward, and backward without weight
    gradients + the W action, in ms (medians)."""
    import megatron_terapipe as mt
    from megatron_terapipe.megatron.measure.layers import measure_layer_times
    from megatron_terapipe.planner.cost.dims import ModelDims

    mt.enable_cpu_mode()
    dims = ModelDims(num_layers=1, hidden_size=hidden, num_attention_heads=heads)
    m = measure_layer_times(dims, cells=[(1, seq, 0)], dtype="float32", device="cpu",
                            repeats=repeats, statistic="median", edges=False, progress=False)
    return {"forward_ms": 1e3 * float(m.forward[0]), "backward_ms": 1e3 * float(m.backward[0]),
            "backward_without_wgrad_ms": 1e3 * float(m.deferred_backward[0]),
            "w_action_ms": 1e3 * float(m.wgrad[0])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cpu", "slice_costs.json"),
                        help="write the results here (JSON; default: the current results file)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    origin = provenance(script_command(__file__, argv))
    print(describe(origin))
    shape = (args.seq_length, args.hidden_size, args.num_attention_heads)
    rows = [attention_ms(*shape, 1, args.repeats, "whole")]
    rows += [attention_ms(*shape, K, args.repeats, method)
             for K in (2, 4, 8) for method in ("masked", "prefix")]
    whole = rows[0]["forward_ms"] + rows[0]["backward_ms"]
    print(f"attention of one sequence of {args.seq_length} tokens (hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads), one thread, medians of {args.repeats}:")
    for row in rows:
        total = row["forward_ms"] + row["backward_ms"]
        print(f"  {row['slices']} slice(s), {row['method']:6s}: forward {row['forward_ms']:6.1f} "
              f"ms, backward {row['backward_ms']:6.1f} ms, {total / whole:.2f}x the whole "
              "sequence's")
    split_rows = split_against_mask(args.num_attention_heads,
                                    args.hidden_size // args.num_attention_heads, args.repeats)
    print("one slice over its prefix, forward + backward, split against masked:")
    for row in split_rows:
        print(f"  {row['queries']:5d} tokens over {row['keys']:5d} keys: masked "
              f"{row['masked_ms']:6.1f} ms, split {row['split_ms']:6.1f} ms, "
              f"{row['split_over_masked']:.2f}x")
    layer = deferral_ms(*shape, args.repeats)
    split = layer["backward_without_wgrad_ms"] + layer["w_action_ms"]
    print(f"one layer, whole sequence: forward {layer['forward_ms']:.1f} ms, backward "
          f"{layer['backward_ms']:.1f} ms; deferred: {layer['backward_without_wgrad_ms']:.1f} ms "
          f"+ W {layer['w_action_ms']:.1f} ms = {split / layer['backward_ms']:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": origin, "setup": vars(args), "attention": rows,
                       "split_against_mask": split_rows, "layer": layer}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
