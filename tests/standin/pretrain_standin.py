"""A pretrain_gpt.py-style script for the launcher tests (runs on the stand-in megatron.training).

Written like Megatron-LM's pretrain_gpt.py: get_batch reads through get_batch_on_this_tp_rank,
loss_func returns (summed loss, token count, report), forward_step calls the model with
labels and loss_mask, and the model is built with Megatron's stock local layer spec. It knows
nothing about TeraPipe; `python -m megatron_terapipe.megatron.launch pretrain_standin.py ...` adds it.
At the end every rank prints what the TeraPipe executor ran (test instrumentation).
"""

import os
from functools import partial

import torch

from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_batch_on_this_tp_rank, is_first_or_last_pipeline_stage

from megatron_terapipe import TeraPipeConfig  # test instrumentation only (report_schedule)


TERAPIPE_RUNS = []  # what the TeraPipe schedule ran on this rank, call by call


def get_batch(data_iterator, vp_stage=None):
    """Generate a batch."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator)
    return batch.values()


def loss_func(loss_mask, output_tensor, model=None):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan=False):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    config.terapipe = TeraPipeConfig(on_run=TERAPIPE_RUNS.append)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type)


class LearnableMockDataset(torch.utils.data.Dataset):
    """GPTDataset-style samples of a deterministic token chain (t -> 3t + 1 mod V): learnable."""

    def __init__(self, num_samples, seq_length, vocab_size, seed, create_attention_mask):
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, vocab_size, (num_samples,), generator=gen)
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.create_attention_mask = create_attention_mask

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, idx):
        text = torch.empty(self.seq_length + 1, dtype=torch.long)
        text[0] = self.starts[idx]
        for i in range(1, self.seq_length + 1):
            text[i] = (3 * text[i - 1] + 1) % self.vocab_size
        s = self.seq_length
        sample = {"tokens": text[:-1].contiguous(), "labels": text[1:].contiguous(),
                  "loss_mask": torch.ones(s), "position_ids": torch.arange(s)}
        if self.create_attention_mask:
            sample["attention_mask"] = torch.tril(torch.ones(s, s)).unsqueeze(0) < 0.5
        return sample


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    make = partial(LearnableMockDataset, seq_length=args.seq_length, vocab_size=args.vocab_size,
                   create_attention_mask=args.create_attention_mask_in_dataloader)
    n_train, n_valid, n_test = train_val_test_num_samples
    return (make(n_train, seed=args.standin_data_seed), make(n_valid, seed=args.standin_data_seed + 1),
            make(max(1, n_test), seed=args.standin_data_seed + 2))


def add_standin_args(parser):
    """The script's own extra_args_provider (as pretrain_gpt passes add_modelopt_args)."""
    group = parser.add_argument_group(title="stand-in")
    group.add_argument("--standin-data-seed", type=int, default=7)
    return parser


def report_schedule():
    """Test instrumentation: what the TeraPipe executor ran on this rank (its run records come
    through config.terapipe.on_run, set in model_provider)."""
    run = TERAPIPE_RUNS[-1] if TERAPIPE_RUNS else None
    cells = len(run.schedule.stages[run.stage]) if run is not None else 0
    rank = os.environ.get("RANK", "0")
    print(f"> standin rank {rank}: terapipe actions in the last schedule call: {cells}", flush=True)


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, extra_args_provider=add_standin_args)
    report_schedule()
