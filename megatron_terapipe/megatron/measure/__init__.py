"""Measuring on the device what the planner's profiles are fitted to: one layer's times on
token slices, the pipeline's edges, and the bytes a stage keeps for backward
(`python -m megatron_terapipe.megatron.measure {layers,memory} ...`).

May import: plan, schedule, planner, runtime, megatron.platform, megatron.support, megatron.model, megatron.hooks, megatron.measure
"""
