"""Attention over token slices.

slice_attention: the slice-aware core attention, a token slice attending to the cached K/V of
earlier slices; kv_cache: those K/V buffers and their gradients, per sequence and layer;
cpu_prefix: on CPU, a long slice's attention as two blocks without the masked triangle.

May import: schedule, runtime.context, runtime.memory, runtime.attention
"""
