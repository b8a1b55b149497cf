"""Megatron-LM's argument handling, reduced to the flags the tests use (stand-in).

Flag names, destinations and defaults follow megatron/training/arguments.py at core_v0.16.1.
"""

import argparse
import os


def add_megatron_arguments(parser):
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--use-legacy-models", action="store_true")
    g.add_argument("--transformer-impl", default="transformer_engine",
                   choices=["local", "transformer_engine", "inference_optimized"])
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--mtp-num-layers", type=int, default=None)
    g = parser.add_argument_group(title="data and training")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--decoder-seq-length", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Parse all arguments (the script's provider adds its own flags first)."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments (stand-in)",
                                     allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return args


def validate_args(args, defaults={}):
    """Derive what Megatron-LM derives: data-parallel size, virtual stages, model defaults."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.context_parallel_size)
    assert args.world_size % model_parallel == 0, "world size is not divisible by the model-parallel size"
    args.data_parallel_size = args.world_size // model_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank
    else:
        args.virtual_pipeline_model_parallel_size = None
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    return args


def core_transformer_config_from_args(args):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_moe_experts=args.num_experts, bf16=args.bf16, fp16=args.fp16,
        params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        calculate_per_token_loss=args.calculate_per_token_loss)
