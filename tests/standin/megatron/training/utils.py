"""Batch broadcasting over the tensor-parallel group and logging helpers (stand-in)."""

import torch

from megatron.core import parallel_state as mpu
from megatron.training.global_vars import get_args


def print_rank_0(message):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def is_last_rank():
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank_last(message):
    if not torch.distributed.is_initialized() or is_last_rank():
        print(message, flush=True)


def is_first_or_last_pipeline_stage(vp_stage=None):
    return mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()


def get_batch_on_this_tp_rank(data_iterator):
    """Tensor-parallel rank 0 reads the batch and broadcasts it; the other ranks receive into
    buffers shaped (args.micro_batch_size, args.seq_length) (attention mask
    (args.micro_batch_size, 1, args.seq_length, args.seq_length) when
    args.create_attention_mask_in_dataloader), as Megatron-LM's function of the same name."""
    args = get_args()

    def _broadcast(item):
        if item is not None:
            torch.distributed.broadcast(item, mpu.get_tensor_model_parallel_src_rank(),
                                        group=mpu.get_tensor_model_parallel_group())

    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    if mpu.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {
            "tokens": data["tokens"].cuda(non_blocking=True),
            "labels": data["labels"].cuda(non_blocking=True),
            "loss_mask": data["loss_mask"].cuda(non_blocking=True),
            "attention_mask": (None if "attention_mask" not in data
                               else data["attention_mask"].cuda(non_blocking=True)),
            "position_ids": data["position_ids"].cuda(non_blocking=True),
        }
        if args.pipeline_model_parallel_size == 1:
            for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"):
                _broadcast(batch[key])
        elif first:
            for key in ("tokens", "attention_mask", "position_ids"):
                _broadcast(batch[key])
        elif last:
            for key in ("labels", "loss_mask", "attention_mask"):
                _broadcast(batch[key])
        return batch

    shape = (args.micro_batch_size, args.seq_length)
    device = torch.cuda.current_device()
    tokens = torch.empty(shape, dtype=torch.int64, device=device)
    labels = torch.empty(shape, dtype=torch.int64, device=device)
    loss_mask = torch.empty(shape, dtype=torch.float32, device=device)
    position_ids = torch.empty(shape, dtype=torch.int64, device=device)
    attention_mask = (torch.empty((args.micro_batch_size, 1, args.seq_length, args.seq_length),
                                  dtype=torch.bool, device=device)
                      if args.create_attention_mask_in_dataloader else None)
    if args.pipeline_model_parallel_size == 1:
        for item in (tokens, labels, loss_mask, attention_mask, position_ids):
            _broadcast(item)
    elif first:
        labels = loss_mask = None
        for item in (tokens, attention_mask, position_ids):
            _broadcast(item)
    elif last:
        tokens = position_ids = None
        for item in (labels, loss_mask, attention_mask):
            _broadcast(item)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "attention_mask": attention_mask, "position_ids": position_ids}
