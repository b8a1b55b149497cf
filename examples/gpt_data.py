"""The example's data and forward step, as a Megatron-LM script would write them.

Nothing here knows about TeraPipe: the schedule calls `forward_step` once per cell, and the
iterator it hands in yields that cell's rows and tokens of the microbatch.
"""

from __future__ import annotations

from functools import partial

import torch


class SyntheticCorpus:
    """Token streams from a sparse random Markov chain: learnable, so the loss visibly falls."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, 2), generator=gen)
        self.vocab_size = vocab_size

    def sample(self, rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
        out = torch.empty(rows, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab_size, (rows,), generator=gen)
        choice = torch.randint(0, 2, (rows, length), generator=gen)
        for t in range(1, length):
            out[:, t] = self.successors[out[:, t - 1], choice[:, t]]
        return out


class TextCorpus:
    """A text file, tokenised with a byte-level BPE trained on the file itself."""

    def __init__(self, path: str, vocab_size: int) -> None:
        try:
            from tokenizers import ByteLevelBPETokenizer
        except ImportError as exc:
            raise SystemExit("--data-path needs the tokenizers package: pip install tokenizers") from exc
        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train([path], vocab_size=vocab_size, min_frequency=2, show_progress=False)
        with open(path, encoding="utf-8") as f:
            ids = tokenizer.encode(f.read()).ids
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.vocab_size = vocab_size

    def sample(self, rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
        if self.ids.numel() <= length:
            raise SystemExit(f"--data-path has {self.ids.numel()} tokens, fewer than --seq-length + 1")
        starts = torch.randint(0, self.ids.numel() - length, (rows,), generator=gen)
        return torch.stack([self.ids[s:s + length] for s in starts.tolist()])


def batches(corpus, micro_batch_size: int, seq_length: int, seed: int):
    """GPTDataset-style microbatches: tokens, labels, loss_mask, position_ids, attention_mask."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
    while True:
        seq = corpus.sample(micro_batch_size, seq_length + 1, gen)
        yield {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(),
               "loss_mask": torch.ones(micro_batch_size, seq_length),
               "position_ids": positions.contiguous(), "attention_mask": None}


# The loss and forward step of Megatron-LM's pretrain_gpt.py, shortened; TeraPipe needs no change.
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model, device):
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a middle stage: its input comes from the previous stage
        return model(None, None, None), partial(loss_func, None)
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])
