"""Megatron-LM's flags without Megatron-LM: TeraPipe's parser on a Megatron-LM-like namespace,
and the plan and report one process makes from them (megatron/args)."""

from __future__ import annotations

import argparse

from megatron_terapipe.megatron.args import plans_from_flags as planning
from megatron_terapipe.megatron.args.flags import add_terapipe_args
from megatron_terapipe.megatron.args.settings import RunSettings

# A Megatron-LM-like namespace (names as in megatron/training/arguments.py, core_v0.16.1).
MEGATRON = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=None,
                group_query_attention=False, num_query_groups=1, swiglu=False, seq_length=64,
                micro_batch_size=2, global_batch_size=8, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=2, context_parallel_size=1,
                num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                virtual_pipeline_model_parallel_size=None, num_experts=None, mtp_num_layers=None,
                sequence_parallel=False, use_legacy_models=False, decoder_seq_length=None,
                reset_attention_mask=False, bf16=False, fp16=False, world_size=2)


def parse(argv: list[str], **megatron) -> argparse.Namespace:
    parser = add_terapipe_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(argv)
    for k, v in {**MEGATRON, **megatron}.items():
        setattr(args, k, v)
    return args


def run_settings(args: argparse.Namespace, seq_length: int, micro_batch_size: int) -> RunSettings:
    """The flags parsed once, for one (seq_length, micro_batch_size) the schedule runs."""
    return RunSettings.from_args(args).for_batch(seq_length, micro_batch_size)


def plan_and_report(args: argparse.Namespace, seq_length: int, micro_batch_size: int):
    """The plan the flags select for this batch and its report, as one process makes them."""
    planned = planning.plan_run(run_settings(args, seq_length, micro_batch_size))
    return planned.plan, planned.report


#: Megatron-LM's router-loss flags (tests/equivalence/test_moe_losses.py: refused on other lines).
MOE_LOSSES = [dict(moe_aux_loss_coeff=[0.01]), dict(moe_z_loss_coeff=1e-3),
              dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                   moe_aux_loss_coeff=[0.01, 0.01, 0.01], moe_z_loss_coeff=1e-3)]

# --pipeline-schedule auto: a GPT with 8 layers on 2 stages, vocabulary known, on the analytic
# model of an A100.
AUTO = ["--pipeline-schedule", "auto", "--terapipe-hardware", "a100"]
SHAPE = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048,
             micro_batch_size=1, global_batch_size=8, vocab_size=50304, bf16=True)


def gpt3_13b_auto_args(monkeypatch):
    """gpt3-13b on 8 stages x TP 8 (8 GPUs a node) with --sequence-parallel, 32 sequences of
    8192 tokens, auto within 20 GiB on the analytic H100 model."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    return parse(["--pipeline-schedule", "auto", "--terapipe-hardware", "h100",
                  "--terapipe-memory-budget", "20GiB"],
                 num_layers=40, hidden_size=5120, num_attention_heads=40, vocab_size=50257,
                 seq_length=8192, micro_batch_size=1, global_batch_size=32, bf16=True,
                 pipeline_model_parallel_size=8, tensor_model_parallel_size=8, world_size=64,
                 sequence_parallel=True)
