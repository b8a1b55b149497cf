"""initialize_megatron (stand-in): parse, validate, set globals, start torch.distributed."""

from datetime import timedelta

import torch

from megatron.training.arguments import parse_args, validate_args  # bound at import, as in Megatron-LM
from megatron.training.global_vars import get_args, set_global_variables


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,
                        allow_no_cuda=False, skip_mpu_initialization=False, **unused):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)
    set_global_variables(args)
    _initialize_distributed()


def _initialize_distributed():
    from megatron.core import parallel_state, tensor_parallel

    args = get_args()
    if not torch.cuda.is_available():
        # The real Megatron-LM requires CUDA; the stand-in runs on CPU with gloo.
        from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(
        backend, timeout=timedelta(minutes=args.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
