"""What TeraPipe cannot run, as one table: each entry of RULES is one refusal, what it tests on
a RunView and the message naming the flag and the fix. A RunView describes a run the same way
whether it comes from Megatron-LM's flags (`view_from_args`; args/checks.py applies the table at
start-up) or from a TransformerConfig (`view_from_config`; `configure` applies it, and every
schedule call with what only the call knows: its process groups, model chunks and shapes); the
two adapters live in support/run_views.py.
Adding a refusal is one entry in RULES (plus the view's field, if the view lacks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from ...runtime.attention.cpu_prefix import SPLIT_ABOVE_TOKENS
from .stage_layers import StageLayers

#: What the layers' core attention runs under TeraPipe, whatever the spec had (model/layer_specs.py).
SLICE_ATTENTION = ("slice attention (torch scaled_dot_product_attention over the cached prefix, "
                   "bottom-right causal mask; torch picks the kernel, on CPU split in two for "
                   f"slices over {SPLIT_ABOVE_TOKENS} tokens)")
#: --attention-backend values the slice attention stands for: auto (Megatron-LM's default: the
#: model chooses) and local (PyTorch attention rather than Transformer Engine's kernels).
SLICE_ATTENTION_BACKENDS = ("auto", "local")
#: How messages name what asked for CUDA graphs: the flag, or configure's option.
FLAG_GRAPHS = "--terapipe-cuda-graphs"
CONFIGURE_GRAPHS = "configure(..., cuda_graphs=True)"


@dataclass(frozen=True)
class RunView:
    """A run as the rules see it, named as Megatron-LM's flags; the defaults are what TeraPipe
    runs (an adapter leaves what its source does not know at the default)."""

    seq_length: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    tensor_parallel: int = 1
    context_parallel: int = 1
    hybrid_context_parallel: bool = False
    virtual_stages: int = 1  # model chunks per pipeline stage (Megatron's virtual pipeline size)
    model_chunks: Optional[int] = None  # the model chunks a schedule call got
    plan_virtual_stages: Optional[int] = None  # the TeraPipe plan's chunks per stage, if known
    layers_per_stage: Optional[int] = None  # transformer layers per pipeline stage, if known
    stage_layers: Optional[StageLayers] = None  # the layers of each stage's chunks, if known
    num_experts: Optional[int] = None
    moe_aux_loss_coeff: tuple = ()
    moe_router_load_balancing_type: tuple = ("aux_loss",)
    moe_z_loss_coeff: Optional[float] = None
    moe_expert_capacity_factor: Optional[float] = None
    mtp_num_layers: Optional[int] = None
    use_legacy_models: bool = False
    multi_latent_attention: bool = False
    experimental_attention_variant: Optional[str] = None
    window_size: Optional[object] = None
    softmax_type: str = "vanilla"  # Megatron's attention sinks: "off-by-one", "learnable"
    qk_clip: bool = False  # both read the core attention's max logit (Transformer Engine's)
    log_max_attention_logit: bool = False
    activation_offloading: bool = False  # --fine-grained-activation-offloading
    cpu_offloading: bool = False  # config.cpu_offloading (Transformer Engine's, per layer)
    moe_paged_stash: bool = False  # --moe-paged-stash (0.19), set up by Megatron's schedules
    moe_routing_replay: bool = False  # --moe-enable-routing-replay
    ep_overlap: bool = False  # --overlap-moe-expert-parallel-comm (Megatron's combined 1F1B)
    delay_wgrad_compute: bool = False  # its experts' weight gradients, computed by that schedule
    # config.num_microbatches_with_partial_activation_checkpoints (Megatron's schedules only)
    partial_recompute: Optional[int] = None
    position_embedding_type: Optional[str] = None
    sft: bool = False
    attention_backend: str = "auto"
    defer_embedding_wgrad_compute: bool = False
    reset_attention_mask: bool = False
    multi_module: bool = False  # a MultiModuleProcessGroupCollection (Megatron's bridge schedule)
    adjust_tensor_shapes: bool = False  # the schedule got an adjust_tensor_shapes_fn
    cuda_graphs: bool = False  # a CUDA graph per compute action ...
    megatron_graphs: str = "none"  # Megatron's own CUDA graphs (--cuda-graph-impl)
    graphs_option: str = FLAG_GRAPHS  # ... asked for by this option
    overlap_grad_reduce: bool = False
    overlap_option: str = "--overlap-grad-reduce"  # how the source names it
    dropout: tuple = ()  # dropout flags above 0, e.g. "--hidden-dropout 0.1"
    graph_safe_rng: bool = False  # Megatron's RNG tracker can be captured
    graphs_device: str = ""  # why no CUDA device captures the graphs ("" when one does)
    scatter_gather: bool = False  # messages split over the TP ranks (--terapipe-scatter-gather-p2p)
    sequence_parallel: bool = False

    @property
    def uneven_layers(self) -> str:
        """How the flags split the layers unevenly over the stages' chunks (the model chunks
        would differ), or "" (an even split, or none known)."""
        split = self.stage_layers
        return "" if split is None or split.even else split.describe()


@dataclass(frozen=True)
class Rule:
    """A run TeraPipe refuses: `breaks(view)`; `message` (or message(view)) names the fix."""

    breaks: Callable[[RunView], bool]
    message: Union[str, Callable[[RunView], str]]

    def text(self, view: RunView) -> str:
        return self.message(view) if callable(self.message) else self.message


def _moe(v: RunView) -> bool:
    return bool(v.num_experts)


def _aux_loss(v: RunView) -> bool:
    return (_moe(v) and any(c > 0 for c in v.moe_aux_loss_coeff)
            and any(b not in ("none", "sinkhorn") for b in v.moe_router_load_balancing_type))


def _router_losses(v: RunView) -> bool:
    """A load-balancing loss or the z-loss (Megatron adds it whenever the coefficient is set)."""
    return _aux_loss(v) or (_moe(v) and v.moe_z_loss_coeff is not None)


def _router_loss_flags(v: RunView) -> str:
    flags = []
    if _aux_loss(v):
        flags.append(f"--moe-aux-loss-coeff {' '.join(f'{c:g}' for c in v.moe_aux_loss_coeff)} "
                     f"--moe-router-load-balancing-type "
                     f"{' '.join(map(str, v.moe_router_load_balancing_type))}")
    if _moe(v) and v.moe_z_loss_coeff is not None:
        flags.append(f"--moe-z-loss-coeff {v.moe_z_loss_coeff:g}")
    return ", ".join(flags)


def _router_losses_line_problem() -> Optional[str]:
    from ..platform.router_versions import line_problem  # imports torch: only for MoE runs with losses

    return line_problem()


def _given(*flags: tuple[str, bool]) -> str:
    """The flags that are on, named together ("--a and --b")."""
    return " and ".join(flag for flag, on in flags if on)


def _ep_overlap_flags(v: RunView) -> str:
    return _given(("--overlap-moe-expert-parallel-comm", v.ep_overlap),
                  ("--delay-wgrad-compute", v.delay_wgrad_compute))


def _max_logit_flags(v: RunView) -> str:
    return _given(("--qk-clip", v.qk_clip), ("--log-max-attention-logit", v.log_max_attention_logit))


_VP_FLAGS = "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"


# Virtual stages: a plan's virtual_stages model chunks per stage, built as Megatron builds them
# for its interleaved schedule (GPTModel(..., vp_stage=c) under virtual_pipeline_model_parallel
# _size). Only a mismatch is refused.
VIRTUAL_STAGE_RULES = (
    Rule(lambda v: v.layers_per_stage is not None and v.layers_per_stage % v.virtual_stages != 0,
         lambda v: (
             f"{v.virtual_stages} virtual pipeline stages per rank do not divide the "
             f"{v.layers_per_stage} layers of a pipeline stage: give {_VP_FLAGS} so that each "
             "chunk gets whole layers (a divisor of the stage's layers), or drop them")),
    Rule(lambda v: v.virtual_stages > 1 and bool(v.uneven_layers), lambda v: (
        f"TeraPipe on virtual pipeline stages gives every model chunk the same layers, but the "
        f"flags split them unevenly ({v.uneven_layers}): split them evenly, or drop the virtual "
        f"stages ({_VP_FLAGS}), or use --pipeline-schedule 1f1b")),
    Rule(lambda v: v.model_chunks is not None and v.model_chunks != v.virtual_stages, lambda v: (
        f"TeraPipe got {v.model_chunks} model chunks per pipeline stage but the model config's "
        f"virtual_pipeline_model_parallel_size is {v.virtual_stages if v.virtual_stages > 1 else None}"
        f": build one chunk per virtual stage (GPTModel(..., vp_stage=c) for each c) with "
        f"config.virtual_pipeline_model_parallel_size = the number of chunks ({_VP_FLAGS})")),
    Rule(lambda v: v.plan_virtual_stages not in (None, v.virtual_stages), lambda v: (
        f"TeraPipe: the plan runs {v.plan_virtual_stages} model chunks per stage "
        f"(TeraPipePlan.virtual_stages) but the model has {v.virtual_stages} per pipeline stage "
        f"({_VP_FLAGS}, config.virtual_pipeline_model_parallel_size): plan with "
        f"virtual_stages={v.virtual_stages}, or build {v.plan_virtual_stages} chunks per stage "
        f"(--num-virtual-stages-per-pipeline-rank {v.plan_virtual_stages})")),
)

# Dropless top-k MoE routing is token-wise: a cell routes its tokens as the whole microbatch
# would. The load-balancing losses and the z-loss need the whole microbatch's counts: each cell
# adds its counts and its backward takes the microbatch's gradient (model/moe_router_losses.py), on the
# megatron-core lines whose router TeraPipe reproduces. Refused: Sinkhorn (normalised over all
# the tokens at once) and capacity-based dropping (counted per forward pass). Expert bias only
# adds up token counts.
RULES = (
    Rule(lambda v: v.context_parallel > 1, lambda v: (
        f"TeraPipe does not support context parallelism (--context-parallel-size "
        f"{v.context_parallel}): token slices already split the sequence; set "
        "--context-parallel-size 1, or use --pipeline-schedule 1f1b")),
    Rule(lambda v: v.hybrid_context_parallel,
         "TeraPipe does not support --hybrid-context-parallel: drop it"),
    *VIRTUAL_STAGE_RULES,
    Rule(lambda v: _router_losses(v) and _router_losses_line_problem() is not None, lambda v: (
        f"MoE router losses ({_router_loss_flags(v)}): {_router_losses_line_problem()}")),
    Rule(lambda v: _moe(v) and "sinkhorn" in v.moe_router_load_balancing_type, (
        "TeraPipe cannot run --moe-router-load-balancing-type sinkhorn: Sinkhorn normalises the "
        "routing over all the microbatch's tokens at once; use top-k routing with "
        "--moe-router-enable-expert-bias, or --pipeline-schedule 1f1b")),
    Rule(lambda v: _moe(v) and "quantile_balancing" in v.moe_router_load_balancing_type, (
        "TeraPipe cannot run --moe-router-load-balancing-type quantile_balancing: its bias "
        "update takes each forward pass's quantile of the router scores, and a token slice's "
        "quantile is not the microbatch's; use top-k routing with --moe-router-enable-expert-bias "
        "(or an aux loss), or --pipeline-schedule 1f1b")),
    Rule(lambda v: _moe(v) and v.moe_routing_replay, (
        "TeraPipe cannot run --moe-enable-routing-replay: Megatron records and replays the "
        "routing of each forward pass over a whole microbatch, and TeraPipe runs one forward "
        "per token slice; drop --moe-enable-routing-replay (config.moe_enable_routing_replay), "
        "or use --pipeline-schedule 1f1b")),
    Rule(lambda v: v.ep_overlap or v.delay_wgrad_compute, lambda v: (
        f"TeraPipe does not run {_ep_overlap_flags(v)}: it selects Megatron's combined 1F1B "
        "schedule, which overlaps the expert-parallel all-to-all of one microbatch with another's "
        "compute and computes the delayed expert weight gradients; TeraPipe replaces the schedule "
        "(its W actions defer weight gradients its own way): drop "
        f"{_ep_overlap_flags(v)}, or use --pipeline-schedule 1f1b")),
    Rule(lambda v: v.moe_paged_stash, (
        "TeraPipe does not support --moe-paged-stash: Megatron's own schedules set up and "
        "release the experts' paged stash each iteration, and TeraPipe replaces them; drop "
        "--moe-paged-stash (config.moe_paged_stash), or use --pipeline-schedule 1f1b")),
    Rule(lambda v: v.partial_recompute is not None, lambda v: (
        f"TeraPipe recomputes as the model config says in every microbatch: "
        f"config.num_microbatches_with_partial_activation_checkpoints "
        f"({v.partial_recompute}: Megatron's schedules recompute only that many microbatches) is "
        "not supported; set it to None, or use Megatron's own schedule")),
    Rule(lambda v: _moe(v) and v.moe_expert_capacity_factor is not None, lambda v: (
        f"TeraPipe cannot run MoE token dropping (--moe-expert-capacity-factor "
        f"{v.moe_expert_capacity_factor}): an expert's capacity is counted over each forward "
        "pass's tokens, so a token slice would drop other tokens than the whole microbatch; "
        "drop the flag (dropless routing), or use --pipeline-schedule 1f1b")),
    Rule(lambda v: bool(v.mtp_num_layers),
         "TeraPipe does not support multi-token prediction: unset --mtp-num-layers"),
    Rule(lambda v: v.use_legacy_models,
         "TeraPipe needs Megatron-Core models: drop --use-legacy-models"),
    Rule(lambda v: v.multi_latent_attention,
         "TeraPipe does not support multi-latent attention yet: drop --multi-latent-attention"),
    Rule(lambda v: bool(v.experimental_attention_variant),
         "TeraPipe does not support --experimental-attention-variant: drop it"),
    Rule(lambda v: bool(v.window_size),
         "TeraPipe does not support sliding-window attention: drop --window-size "
         "(config.window_size)"),
    Rule(lambda v: v.softmax_type not in (None, "vanilla"), lambda v: (
        f"TeraPipe does not support --softmax-type {v.softmax_type} (an attention sink: Megatron's "
        f"DotProductAttention adds softmax_offset to the softmax); TeraPipe's {SLICE_ATTENTION} "
        "computes the plain softmax: use --softmax-type vanilla (config.softmax_type), or "
        "--pipeline-schedule 1f1b")),
    Rule(lambda v: v.qk_clip or v.log_max_attention_logit, lambda v: (
        f"TeraPipe does not support {_max_logit_flags(v)}: it reads the largest attention logit "
        "from Transformer Engine's core attention, which TeraPipe replaces with its "
        f"{SLICE_ATTENTION}; drop {_max_logit_flags(v)}, or use --pipeline-schedule 1f1b")),
    Rule(lambda v: v.activation_offloading, (
        "TeraPipe does not support --fine-grained-activation-offloading: Megatron's offload "
        "manager reloads a model chunk's activations in the order Megatron's own schedules run "
        "them, while TeraPipe runs a sequence's token slices backward in reverse (and its planner "
        "does not count what moves to the host); drop --fine-grained-activation-offloading "
        "(config.fine_grained_activation_offloading), or use --pipeline-schedule 1f1b")),
    Rule(lambda v: v.cpu_offloading, (
        "TeraPipe has not been run with config.cpu_offloading (Transformer Engine's offload of "
        "each layer's activations between one forward pass and its backward): TeraPipe runs "
        "several token slices' forwards before their backwards, and its planner does not count "
        "what moves to the host; set cpu_offloading=False, or use Megatron's own schedule")),
    Rule(lambda v: v.position_embedding_type == "mrope",
         "TeraPipe does not support --position-embedding-type mrope: use rope or learned_absolute"),
    Rule(lambda v: v.sft, "TeraPipe does not support --sft (packed THD sequences): drop --sft"),
    Rule(lambda v: v.attention_backend not in SLICE_ATTENTION_BACKENDS, lambda v: (
        f"TeraPipe does not run --attention-backend {v.attention_backend} (a Transformer Engine "
        f"attention kernel): token slices need TeraPipe's {SLICE_ATTENTION}; use "
        "--attention-backend auto (the default) or local, or --pipeline-schedule 1f1b for "
        "Megatron's attention")),
    Rule(lambda v: v.decoder_seq_length not in (None, v.seq_length),
         "TeraPipe supports decoder-only GPT models: unset --decoder-seq-length (decoder_seq_length)"),
    Rule(lambda v: v.defer_embedding_wgrad_compute,
         "TeraPipe does not support --defer-embedding-wgrad-compute: drop it"),
    Rule(lambda v: v.tensor_parallel > 1 and v.reset_attention_mask, (
        "TeraPipe with --tensor-model-parallel-size > 1 supports only the causal mask: drop "
        "--reset-attention-mask (it works with --tensor-model-parallel-size 1)")),
    Rule(lambda v: v.multi_module, (
        "TeraPipe does not support multi-module pipelines (a MultiModuleProcessGroupCollection "
        "selects Megatron's bridge schedule): use Megatron's own schedule (drop "
        "--pipeline-schedule terapipe)")),
    Rule(lambda v: v.adjust_tensor_shapes, ("TeraPipe derives tensor shapes from the plan: "
                                            "adjust_tensor_shapes_fn is not supported")),
    Rule(lambda v: v.megatron_graphs not in (None, "none"), lambda v: (
        f"TeraPipe does not run Megatron's own CUDA graphs (--cuda-graph-impl "
        f"{v.megatron_graphs}): Megatron captures them around its own schedules (each layer "
        "call, in its microbatch order, created at the end of its forward-backward functions), "
        "which TeraPipe replaces, and a layer's graph would fix one token slice's K/V cache "
        f"offset for every slice of its shape; use {FLAG_GRAPHS} (a graph per compute action) "
        "instead of --cuda-graph-impl (config.cuda_graph_impl), or --pipeline-schedule 1f1b")),
    Rule(lambda v: v.cuda_graphs and v.overlap_grad_reduce, lambda v: (
        f"{v.graphs_option} replays the W actions without Python, so {v.overlap_option} would "
        "never see gradients ready: drop one of the two (--overlap-grad-reduce, or the graphs)")),
    Rule(lambda v: v.cuda_graphs and _moe(v), lambda v: (
        f"{v.graphs_option} replays each cell's kernels as captured, but MoE layers "
        "(--num-experts) route tokens with counts read on the host (the token dispatcher's "
        "split sizes): a capture would fail on that sync, or replay the first iteration's "
        f"routing; drop {v.graphs_option} with MoE")),
    Rule(lambda v: v.cuda_graphs and bool(v.dropout) and not v.graph_safe_rng, lambda v: (
        f"{v.graphs_option} captures dropout ({', '.join(v.dropout)}) in CUDA graphs, which "
        "needs Megatron's graph-safe RNG tracker (--te-rng-tracker): its default tracker swaps "
        "the CUDA generator's state (activation recomputation, RNG forks) in a way a capture "
        "cannot record; give --te-rng-tracker (Transformer Engine's tracker; in Python: seed "
        "with tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=True, "
        "force_reset_rng=True), or use_cudagraphable_rng=True), or --hidden-dropout 0 "
        f"--attention-dropout 0, or drop {v.graphs_option}")),
    Rule(lambda v: v.cuda_graphs and bool(v.graphs_device), lambda v: (
        f"{v.graphs_option} captures cells as CUDA graphs, but {v.graphs_device}: drop "
        f"{v.graphs_option} (on CPU, megatron_terapipe.runtime.graphs.graph_audit.audit_iterations "
        "checks that cells could be captured)")),
    Rule(lambda v: v.scatter_gather and v.sequence_parallel, (
        "--terapipe-scatter-gather-p2p splits each stage-to-stage message over the TP ranks, "
        "which --sequence-parallel does already (each rank sends its own rows): drop "
        "--terapipe-scatter-gather-p2p (config.terapipe.scatter_gather)")),
)


def refusal(view: RunView) -> Optional[str]:
    """The message of the first rule `view` breaks, or None: TeraPipe runs it."""
    return next((rule.text(view) for rule in RULES if rule.breaks(view)), None)


def check_view(view: RunView) -> None:
    """Raise ValueError (the Python API's error) for the first rule `view` breaks."""
    message = refusal(view)
    if message is not None:
        raise ValueError(message if message.startswith("TeraPipe") else "TeraPipe: " + message)
