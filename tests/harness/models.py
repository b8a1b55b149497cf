"""A small GPT for CPU runs, its batches, and a pretrain_gpt-style forward_step and loss_func."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class TinyGPT:
    """A small GPT for CPU runs."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    vocab_size: int = 64
    seq_length: int = 16
    position_embedding_type: str = "rope"
    untie: bool = True
    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None
    recompute_modules: Optional[tuple[str, ...]] = None
    recompute_method: str = "uniform"  # with recompute_granularity "full"
    recompute_num_layers: int = 1
    calculate_per_token_loss: bool = False
    normalization: str = "LayerNorm"
    num_experts: Optional[int] = None  # MoE: dropless top-2 routing, alltoall dispatcher
    # options the layer spec function and the config both take, e.g. (("qk_layernorm", True),)
    spec_and_config: tuple[tuple[str, Any], ...] = ()
    config_extra: tuple[tuple[str, Any], ...] = ()  # more TransformerConfig fields, as given
    # how the layers split over the stages (e.g. (("num_layers_in_first_pipeline_stage", 1),)):
    # pipelined configs only, the no-pipelining baseline holds every layer
    stage_split: tuple[tuple[str, Any], ...] = ()
    seed: int = 1234

    @property
    def spec_kwargs(self) -> dict[str, Any]:
        """What the layer spec functions need for this model (MoE layers, query-key norms)."""
        return {**({"num_experts": self.num_experts} if self.num_experts else {}),
                **dict(self.spec_and_config)}

    def config(self, tp: int = 1, pp: int = 1):
        from megatron.core.transformer.transformer_config import TransformerConfig

        extra: dict[str, Any] = {}
        if self.recompute_granularity is not None:
            extra["recompute_granularity"] = self.recompute_granularity
            if self.recompute_granularity == "full":
                extra.update(recompute_method=self.recompute_method,
                             recompute_num_layers=self.recompute_num_layers)
            if self.recompute_modules is not None:
                extra["recompute_modules"] = list(self.recompute_modules)
        if self.num_experts:
            # Megatron's local experts add their bias in place on a view: MoE without biases.
            extra.update(num_moe_experts=self.num_experts, moe_router_topk=2,
                         moe_token_dispatcher_type="alltoall", add_bias_linear=False)
        return TransformerConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, num_query_groups=self.num_query_groups,
            use_cpu_initialization=True, pipeline_dtype=self.params_dtype,
            params_dtype=self.params_dtype, bf16=self.bf16,
            hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            sequence_parallel=self.sequence_parallel and tp > 1,  # the TP=1 baseline has none
            calculate_per_token_loss=self.calculate_per_token_loss,
            normalization=self.normalization,
            **extra, **dict(self.spec_and_config), **dict(self.config_extra),
            **(dict(self.stage_split) if pp > 1 else {}))

    def build(self, config, spec, pre_process: bool = True, post_process: bool = True,
              vp_stage: Optional[int] = None):
        from megatron.core.models.gpt import GPTModel

        chunk = {} if vp_stage is None else {"vp_stage": vp_stage}  # model chunk c of V
        return GPTModel(config, spec, vocab_size=self.vocab_size,
                        max_sequence_length=self.seq_length, pre_process=pre_process,
                        post_process=post_process,
                        position_embedding_type=self.position_embedding_type,
                        share_embeddings_and_output_weights=not self.untie, **chunk)


def seed(value: int) -> None:
    from megatron_terapipe.megatron.platform.cpu_mode import cpu_model_parallel_seed

    cpu_model_parallel_seed(value)


def build_stage_model(model_cfg: TinyGPT, tp: int, pp: int, spec=None):
    """This rank's pipeline stage of `model_cfg`, with the slice-aware spec by default."""
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.model.layer_specs import get_gpt_layer_spec

    config = model_cfg.config(tp, pp)
    seed(model_cfg.seed)
    model = model_cfg.build(config, spec if spec is not None else get_gpt_layer_spec(**model_cfg.spec_kwargs),
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    return config, model


def to_device(model, device):
    """`model` on `device`, with the rotary table Megatron keeps outside the parameters (built on
    the host under use_cpu_initialization, which these small models use: `.to()` leaves it)."""
    model = model.to(device)
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            module.inv_freq = inv_freq.to(device)
    return model


def in_precision(config, model):
    """`model` as Megatron trains it in half precision: a Float16Module (every parameter, norms
    included, in bf16/fp16; float outputs from the last stage), else `model` itself. Without it
    Megatron's torch norms keep float32 weights, which CUDA's layer_norm refuses on bf16 input."""
    if not (config.bf16 or config.fp16):
        return model
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model)


def make_batches(num: int, micro_batch_size: int, seq_length: int, vocab_size: int, seed: int = 0,
                 with_mask: bool = False, masked_rows: bool = True,
                 packed: bool = False) -> list[dict[str, torch.Tensor]]:
    """Megatron-GPTDataset-style dicts of [b, s] tensors, with zeros in the loss masks;
    `packed`: documents packed in each row (`packed_documents`)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
        loss_mask = (torch.rand(micro_batch_size, seq_length, generator=gen) > 0.25).float()
        if masked_rows:
            loss_mask[0, : seq_length // 2] = 0.0  # a fully masked stretch: empty cells happen
        batch = {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1).contiguous(),
            "attention_mask": None,
        }
        if with_mask:
            batch["attention_mask"] = torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool).triu(1)
        if packed:
            batch["attention_mask"], batch["position_ids"] = packed_documents(
                gen, micro_batch_size, seq_length)
        batches.append(batch)
    return batches


def packed_documents(gen: torch.Generator, rows: int,
                     seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What Megatron-LM's dataset gives with --reset-attention-mask --reset-position-ids: each
    row holds 1 to 4 documents (random lengths), a token attends to the earlier tokens of its
    own document only ([b, 1, s, s], True: masked) and its position counts from its document's
    start."""
    masks, positions = [], []
    at = torch.arange(seq_length)
    for _ in range(rows):
        count = int(torch.randint(0, 4, (1,), generator=gen))  # documents after the first
        cuts = (torch.randperm(seq_length - 1, generator=gen)[:count] + 1).sort().values
        document = torch.bucketize(at, cuts, right=True)
        starts = torch.tensor([0, *cuts.tolist()])[document]
        visible = (document[:, None] == document[None, :]) & (at[None, :] <= at[:, None])
        masks.append(~visible)
        positions.append(at - starts)
    return torch.stack(masks).unsqueeze(1), torch.stack(positions)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt-style loss: (summed masked loss, token count, report [sum, count])."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def legacy_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Older (loss, report) form: loss averaged over the unmasked tokens."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.clone().detach()}


def forward_step(data_iterator, model, legacy: bool = False):
    """An unmodified Megatron-style forward_step: read a batch, run the model, return loss_func."""
    batch = next(data_iterator) if data_iterator is not None else None
    loss = legacy_loss_func if legacy else loss_func
    if batch is None:
        return model(None, None, None), partial(loss, None)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(loss, batch["loss_mask"])


def legacy_forward_step(data_iterator, model):
    return forward_step(data_iterator, model, legacy=True)
