"""pretrain(): build the model, optimizer and data, then train and evaluate (stand-in).

Like Megatron-LM's training.py, this module imports get_forward_backward_func from
megatron.core.pipeline_parallel when it is imported, and asks it for the schedule in train()
and evaluate().
"""

import torch

from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training.global_vars import get_args, get_timers
from megatron.training.initialize import initialize_megatron
from megatron.training.utils import print_rank_0, print_rank_last


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
             get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,
             store=None, inprocess_call_wrapper=None):
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    args = get_args()
    model, optimizer, config = setup_model_and_optimizer(model_provider)
    train_iter, valid_iter = build_data_iterators(train_valid_test_dataset_provider)
    train(forward_step_func, model, optimizer, config, train_iter)
    evaluate(forward_step_func, valid_iter, model, config)
    torch.distributed.barrier()
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return args


def setup_model_and_optimizer(model_provider):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    args = get_args()
    model = model_provider(pre_process=mpu.is_pipeline_first_stage(),
                           post_process=mpu.is_pipeline_last_stage())
    config = get_model_config(model)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0,
                        params_dtype=config.params_dtype, clip_grad=0.0), [model])
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    return [model], optimizer, config


def build_data_iterators(provider):
    """Datasets exist on tensor-parallel rank 0 of the first and last stages (as in Megatron-LM)."""
    args = get_args()
    if mpu.get_tensor_model_parallel_rank() != 0:
        return None, None
    n_train = args.train_iters * args.global_batch_size
    n_valid = max(1, args.eval_iters) * args.global_batch_size
    train_ds, valid_ds, _ = provider([n_train, n_valid, 0])
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()

    def batches(ds):
        loader = torch.utils.data.DataLoader(
            torch.utils.data.Subset(ds, range(dp_rank, len(ds), dp)),
            batch_size=args.micro_batch_size, shuffle=False, drop_last=True)
        while True:
            yield from loader

    return batches(train_ds), batches(valid_ds)


def num_microbatches():
    args = get_args()
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def _reduce(losses):
    """Token-weighted mean of the 'lm loss' reports ([sum, count]) over microbatches and DP."""
    if not losses:
        return None
    total = torch.stack([torch.as_tensor(r["lm loss"]).float().view(-1) for r in losses]).sum(0)
    torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group())
    return float(total[0] / total[1].clamp(min=1))


def train(forward_step_func, model, optimizer, config, data_iterator):
    args = get_args()
    forward_backward_func = get_forward_backward_func()
    print_rank_0(f"> schedule: {getattr(forward_backward_func, '__name__', forward_backward_func)}")
    for iteration in range(1, args.train_iters + 1):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches(), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
            forward_only=False)
        optimizer.step()
        if mpu.is_pipeline_last_stage():
            loss = _reduce(losses)
            if iteration % args.log_interval == 0:
                print_rank_last(f" iteration {iteration:8d}/{args.train_iters:8d} |"
                                f" lm loss: {loss:.6E} |")


def evaluate(forward_step_func, data_iterator, model, config):
    args = get_args()
    forward_backward_func = get_forward_backward_func()
    for chunk in model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses += forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches(), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                forward_only=True)
    for chunk in model:
        chunk.train()
    if mpu.is_pipeline_last_stage():
        loss = _reduce(losses)
        print_rank_last(f" validation loss | lm loss value: {loss:.6E} |")
