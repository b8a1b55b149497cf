"""Megatron-LM's argument handling, cut down to the flags the launcher tests pass (stand-in).

Flag names, destinations and defaults follow megatron/training/arguments.py at core_v0.16.1.
Every other Megatron-LM flag is missing here; the launcher reads the ones it checks with
getattr and a default, and tests/glue/args/test_arguments.py covers those checks without a parser.
"""

import argparse
import os


def add_megatron_arguments(parser):
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g = parser.add_argument_group(title="data and training")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--decoder-seq-length", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
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
    """Derive what Megatron-LM derives and the stand-in uses: data-parallel size, global batch,
    maximum positions."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    assert args.world_size % model_parallel == 0, "world size is not divisible by the model-parallel size"
    args.data_parallel_size = args.world_size // model_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    return args


def core_transformer_config_from_args(args):
    """float32 only (no --bf16/--fp16 here)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0)
