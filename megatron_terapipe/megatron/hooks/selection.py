"""Which plan TeraPipe runs, and how: a TeraPipeConfig attached to a model config
(`configure` sets `config.terapipe`), or one chosen for every model (`select`, e.g. from the
flags). Megatron's schedule getter (install.py) and the schedule itself (forward_backward.py)
read it through `run_config`; this module imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Optional

from ...plan import TeraPipePlan
from ...runtime.trace import RunRecord


@dataclass
class TeraPipeConfig:
    """What TeraPipe runs for one model: `config.terapipe` on Megatron's TransformerConfig.

    A field left None takes the process-wide default (`select`: the flags' choice)."""

    plan: object = None  # a TeraPipePlan, or a provider with plan_for(seq_length, micro_batch_size)
    cuda_graphs: Optional[bool] = None  # a CUDA graph per compute action, captured once (cell_graphs.py)
    graph_factory: Optional[Callable[[str], object]] = None  # makes each graph (tests: RecordingGraph)
    on_run: Optional[Callable[[RunRecord], None]] = None  # gets each call's RunRecord
    transport: Optional[str] = None  # "megatron" or "torch": overrides p2p.py's choice

    def over(self, default: "TeraPipeConfig") -> "TeraPipeConfig":
        """These settings, with `default`'s where these are None."""
        return TeraPipeConfig(**{f.name: getattr(default, f.name) if getattr(self, f.name) is None
                                 else getattr(self, f.name) for f in fields(self)})


@dataclass
class SelectionState:
    """What the patched get_forward_backward_func decides by, process-wide. Megatron-LM's flow
    needs it: the flags are read (setup_from_args) before the script builds a model config, and
    Megatron calls the getter without one; so the flags' choice waits here as the default
    TeraPipeConfig of every model whose config has none of its own."""

    selected: bool = False  # get_forward_backward_func returns TeraPipe's schedule
    default: TeraPipeConfig = field(default_factory=TeraPipeConfig)
    schedule_wrapper: Optional[Callable[[Callable], Callable]] = None  # e.g. MegatronLMCells


STATE = SelectionState()
VIRTUAL_STAGES_UNSUPPORTED = (
    "TeraPipe does not support virtual pipeline stages: drop "
    "--num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size")


#: Why MoE layers and CUDA graphs per cell do not go together (flag and Python option).
MOE_GRAPHS = ("{option} replays each cell's kernels as captured, but MoE layers (--num-experts) "
              "route tokens with counts read on the host (the token dispatcher's split sizes): "
              "a capture would fail on that sync, or replay the first iteration's routing; drop "
              "{option} with MoE")


#: What the layers' core attention runs under TeraPipe, whatever the spec had (spec.py).
SLICE_ATTENTION = ("slice attention (torch scaled_dot_product_attention over the cached prefix, "
                   "bottom-right causal mask; torch picks the kernel)")
#: --attention-backend values the slice attention stands for: auto (Megatron-LM's default: the
#: model chooses) and local (PyTorch attention rather than Transformer Engine's kernels).
SLICE_ATTENTION_BACKENDS = ("auto", "local")


def attention_backend_problem(backend: str) -> Optional[str]:
    """Why TeraPipe cannot run --attention-backend `backend` (a Transformer Engine kernel), or None."""
    if backend in SLICE_ATTENTION_BACKENDS:
        return None
    return (f"TeraPipe does not run --attention-backend {backend} (a Transformer Engine attention "
            f"kernel): token slices need TeraPipe's {SLICE_ATTENTION}; use --attention-backend "
            "auto (the default) or local, or --pipeline-schedule 1f1b for Megatron's attention")


#: Why dropout and CUDA graphs need Megatron's graph-safe RNG tracker (flag and Python option).
DROPOUT_GRAPHS = ("{option} captures dropout ({values}) in CUDA graphs, which needs Megatron's "
                  "graph-safe RNG tracker (--te-rng-tracker): its default tracker swaps the CUDA "
                  "generator's state (activation recomputation, RNG forks) in a way a capture "
                  "cannot record; {fix}")


def dropout_values(source) -> list[str]:
    """Megatron's dropout flags above 0 (args or a TransformerConfig: the names are the same)."""
    return [f"--{name.replace('_', '-')} {p:g}" for name in ("hidden_dropout", "attention_dropout")
            if (p := float(getattr(source, name, 0.0) or 0.0)) > 0]


def graph_safe_rng_tracker() -> bool:
    """Whether Megatron's RNG tracker is set up and graph-safe (Transformer Engine's, or Megatron's
    with use_cudagraphable_rng)."""
    from . import compat

    tp_random = compat.rng_module()
    tracker = tp_random._CUDA_RNG_STATE_TRACKER
    if not tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED or tracker is None:
        return False
    check = getattr(tp_random, "is_graph_safe_cuda_rng_tracker", None)
    return bool(check(tracker) if check else getattr(tracker, "use_cudagraphable_rng", False))


def dropout_graphs_problem(config, option: str) -> Optional[str]:
    """Why `config`'s dropout cannot be captured with this process's RNG tracker, or None."""
    values = dropout_values(config)
    if not values or graph_safe_rng_tracker():
        return None
    return DROPOUT_GRAPHS.format(
        option=option, values=", ".join(values),
        fix="seed with tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=True, "
            "force_reset_rng=True) (Transformer Engine; Megatron-LM: --te-rng-tracker) or "
            "use_cudagraphable_rng=True, or set hidden_dropout and attention_dropout to 0 "
            "(--hidden-dropout 0 --attention-dropout 0), or turn the CUDA graphs off")


def select(source, cuda_graphs: bool = False) -> None:
    """Use `source` (a TeraPipePlan or a provider with plan_for) for every model whose config
    has none of its own, e.g. from flags; `cuda_graphs`: capture and replay every compute
    action (--terapipe-cuda-graphs)."""
    if not isinstance(source, TeraPipePlan) and not hasattr(source, "plan_for"):
        raise ValueError(f"select() takes a TeraPipePlan or a plan provider, got {type(source).__name__}")
    STATE.default = TeraPipeConfig(plan=source, cuda_graphs=cuda_graphs)
    STATE.selected = True


def default_plan_source():
    return STATE.default.plan


def run_config(config) -> TeraPipeConfig:
    """What TeraPipe runs for the model of `config`: config.terapipe over the default."""
    return (getattr(config, "terapipe", None) or TeraPipeConfig()).over(STATE.default)


def configure(config, plan, cuda_graphs: Optional[bool] = None,
              graph_factory: Optional[Callable[[str], object]] = None) -> None:
    """Validate `plan` against the model config and attach it (config.terapipe.plan).

    `plan` is a TeraPipePlan, or a provider with `plan_for(seq_length, micro_batch_size)` for
    runs whose sequence length changes. Also selects TeraPipe for `get_forward_backward_func`
    once `install()` has run. `cuda_graphs`: capture every compute action (a cell's forward,
    its backward, a W action) as a CUDA graph once and replay it (runtime/cell_graphs.py);
    needs CUDA; None leaves the choice to the flags (`select`). `graph_factory(label)` makes
    each graph instead of torch.cuda.CUDAGraph (tests pass runtime.cell_graphs.RecordingGraph).
    Other fields of an existing config.terapipe (on_run, transport) are kept.
    """
    if cuda_graphs:  # before the device check: the same refusal wherever it is asked
        problem = dropout_graphs_problem(config, "TeraPipe: configure(..., cuda_graphs=True)")
        if problem:
            raise ValueError(problem)
    if cuda_graphs and graph_factory is None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "TeraPipe: configure(..., cuda_graphs=True) captures cells as CUDA graphs, but "
                "this process sees no CUDA device: drop cuda_graphs=True (on CPU, "
                "megatron_terapipe.runtime.graph_audit.audit_iterations checks that cells "
                "could be captured)")
    if isinstance(plan, TeraPipePlan):
        check_config(config, plan)
    elif not hasattr(plan, "plan_for"):
        raise ValueError(
            f"configure() takes a TeraPipePlan or a plan provider with plan_for(), got {type(plan).__name__}")
    else:
        check_config(config, None)
    own = getattr(config, "terapipe", None) or TeraPipeConfig()
    config.terapipe = replace(own, plan=plan, graph_factory=graph_factory,
                              cuda_graphs=own.cuda_graphs if cuda_graphs is None else cuda_graphs)
    STATE.selected = True


def check_config(config, plan: Optional[TeraPipePlan], cp_size: Optional[int] = None) -> None:
    """Model-level features TeraPipe cannot run, named with the fix.

    cp_size: the context-parallel group's size when known (the schedule passes it), else the
    config's context_parallel_size.
    """
    cp = cp_size if cp_size is not None else getattr(config, "context_parallel_size", 1)
    if cp > 1:
        raise ValueError(
            f"TeraPipe does not support context parallelism (context_parallel_size={cp}): "
            "token slices already split the sequence; set --context-parallel-size 1")
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise ValueError(VIRTUAL_STAGES_UNSUPPORTED)
    if getattr(config, "num_moe_experts", None) and moe_problem(config):
        raise ValueError(moe_problem(config))
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("TeraPipe does not support --defer-embedding-wgrad-compute: drop it")
    if getattr(config, "mtp_num_layers", None):
        raise ValueError("TeraPipe does not support multi-token prediction: unset --mtp-num-layers")
    backend = getattr(config, "attention_backend", None)
    problem = attention_backend_problem(str(getattr(backend, "name", backend or "auto")))
    if problem:
        raise ValueError(problem)
    if plan is not None and getattr(config, "sequence_parallel", False):
        plan.check_multiple_of(config.tensor_model_parallel_size)


#: The loose TransformerConfig attributes config.terapipe replaced (TeraPipeConfig's fields):
#: a script that still sets one is told so, instead of being silently ignored.
REPLACED_ATTRIBUTES = ("terapipe_plan", "terapipe_cuda_graphs", "terapipe_graph_factory",
                       "terapipe_on_run", "terapipe_transport")


def check_replaced_attributes(config) -> None:
    stale = [name for name in REPLACED_ATTRIBUTES if hasattr(config, name)]
    if stale:
        field_name = stale[0].removeprefix("terapipe_")
        raise ValueError(
            f"TeraPipe: config.{stale[0]} is no longer read: set config.terapipe.{field_name} "
            "(a megatron_terapipe.TeraPipeConfig; configure(config, plan) makes one) instead")


def deselect() -> None:
    """Make get_forward_backward_func return Megatron's own schedules again."""
    STATE.selected = False
    STATE.default = TeraPipeConfig()
    STATE.schedule_wrapper = None


def selected() -> bool:
    return STATE.selected


def cuda_graphs_enabled(config) -> bool:
    """configure(..., cuda_graphs=...) for this model's config, else the flags' choice."""
    return bool(run_config(config).cuda_graphs)


def set_schedule_wrapper(wrapper: Optional[Callable[[Callable], Callable]]) -> None:
    """While TeraPipe is selected, get_forward_backward_func returns `wrapper(schedule)`.

    `setup_from_args` uses it to run Megatron-LM's forward_step per cell (MegatronLMCells).
    None restores the plain schedule.
    """
    STATE.schedule_wrapper = wrapper


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def moe_problem(source) -> Optional[str]:
    """Why an MoE model (Megatron-LM's args or a TransformerConfig: the names are the same)
    cannot train exactly under token slices, or None.

    Dropless top-k routing is token-wise: a cell routes its tokens as the whole microbatch
    would, so MoE trains exactly. What depends on all of a microbatch's tokens at once cannot
    be split into slices: load-balancing losses (products of means over the tokens), Sinkhorn
    routing, the router z-loss (a mean per forward pass) and capacity-based token dropping
    (capacity counted per forward pass). Aux-loss-free balancing (expert bias) only adds up
    token counts, which slices do exactly."""
    coeffs = [float(c) for c in _as_list(getattr(source, "moe_aux_loss_coeff", 0.0) or 0.0)]
    balancing = _as_list(getattr(source, "moe_router_load_balancing_type", "aux_loss"))
    if any(c > 0 for c in coeffs) and any(b != "none" for b in balancing):
        return (f"TeraPipe cannot run MoE load-balancing losses (--moe-aux-loss-coeff "
                f"{' '.join(f'{c:g}' for c in coeffs)}, --moe-router-load-balancing-type "
                f"{' '.join(balancing)}): the loss multiplies means over all the microbatch's "
                "tokens, and a token slice sees only its own; use aux-loss-free balancing "
                "(--moe-aux-loss-coeff 0 --moe-router-enable-expert-bias), or "
                "--pipeline-schedule 1f1b")
    if "sinkhorn" in balancing:
        return ("TeraPipe cannot run --moe-router-load-balancing-type sinkhorn: Sinkhorn "
                "normalises the routing over all the microbatch's tokens at once; use top-k "
                "routing with --moe-router-enable-expert-bias, or --pipeline-schedule 1f1b")
    if getattr(source, "moe_z_loss_coeff", None):
        return (f"TeraPipe cannot run the router z-loss (--moe-z-loss-coeff "
                f"{source.moe_z_loss_coeff}): it is a mean over each forward pass's tokens, "
                "and a token slice's mean is not the microbatch's; drop --moe-z-loss-coeff, "
                "or use --pipeline-schedule 1f1b")
    if getattr(source, "moe_expert_capacity_factor", None) is not None:
        return (f"TeraPipe cannot run MoE token dropping (--moe-expert-capacity-factor "
                f"{source.moe_expert_capacity_factor}): an expert's capacity is counted over "
                "each forward pass's tokens, so a token slice would drop other tokens than "
                "the whole microbatch; drop the flag (dropless routing), or use "
                "--pipeline-schedule 1f1b")
    return None
