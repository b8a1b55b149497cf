"""A small stand-in for Megatron-LM's `megatron.training` package (tests/glue/test_launch.py only).

What it stands for: the parts of Megatron-LM (NVIDIA/Megatron-LM at tag core_v0.16.1) that the
TeraPipe launcher touches, under the same module and function names, so that
`megatron_terapipe.megatron.launch` hooks it as it hooks the real one:

- arguments.parse_args(extra_args_provider, ignore_unknown_args) builds the parser, lets the
  script's provider add flags, parses; validate_args(args, defaults) derives sizes;
- initialize.py imports parse_args / validate_args by name at import time, as the real one does;
- training.py imports get_forward_backward_func from megatron.core.pipeline_parallel at import
  time and calls it in train() / evaluate(), passing seq_length=args.seq_length and
  micro_batch_size=args.micro_batch_size, as the real one does;
- utils.get_batch_on_this_tp_rank broadcasts the batch over the tensor-parallel group; ranks
  other than 0 allocate their receive buffers from args.micro_batch_size and args.seq_length.

What it does not cover: Megatron-LM's own code. Its full parser and validate_args (only about
20 flags exist here), its training loop (optimizer setup, loss scaling, gradient clipping,
checkpoints, microbatch calculator, logging and timers), its datasets and tokenizers, its
model builders, CUDA and NCCL, and the megatron-core 0.19 entry points
(parse_and_validate_args). Megatron-LM's real pretrain_gpt.py is not run here.

Megatron-LM is not pip-installable (the megatron-core wheel ships only megatron/core), which is
why a stand-in exists. `megatron` is a namespace package, so with this directory on the import
path `megatron.core` still comes from the installed megatron-core. Runs on CPU with gloo.
"""

from .global_vars import get_args, get_timers
from .initialize import initialize_megatron
from .training import pretrain
from .utils import print_rank_0

__all__ = ["get_args", "get_timers", "initialize_megatron", "pretrain", "print_rank_0"]
