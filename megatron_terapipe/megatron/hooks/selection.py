"""Which plan TeraPipe runs, and how: a TeraPipeConfig attached to a model config
(`configure` sets `config.terapipe`), or one chosen for every model (`select`, e.g. from the
flags). Megatron's schedule getter (install.py) and the schedule itself (forward_backward.py)
read it through `run_config`; this module imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Optional

from ...plan import TeraPipePlan
from ...runtime.trace import RunRecord
from ..support.run_views import view_from_config
from ..support.refusals import CONFIGURE_GRAPHS, FLAG_GRAPHS, RunView, check_view


@dataclass
class TeraPipeConfig:
    """What TeraPipe runs for one model: `config.terapipe` on Megatron's TransformerConfig.

    A field left None takes the process-wide default (`select`: the flags' choice)."""

    plan: object = None  # a TeraPipePlan, or a provider with plan_for(seq_length, micro_batch_size)
    # a CUDA graph per compute action, captured once (runtime/graphs/cell_graphs.py)
    cuda_graphs: Optional[bool] = None
    graph_factory: Optional[Callable[[str], object]] = None  # makes each graph (tests: RecordingGraph)
    on_run: Optional[Callable[[RunRecord], None]] = None  # gets each call's RunRecord
    # "megatron", "torch" or "host" (torch's through host memory: stages sharing one GPU)
    transport: Optional[str] = None  # overrides p2p.py's choice
    # each TP rank sends 1/TP of a message, the receivers all-gather (runtime/comm/scatter_gather.py)
    scatter_gather: Optional[bool] = None

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
    # --pipeline-schedule auto's trials: a MeasuredChoice (measured_choice.py), or None
    measured: Optional[object] = None


STATE = SelectionState()


def select(source, cuda_graphs: bool = False, scatter_gather: bool = False) -> None:
    """Use `source` (a TeraPipePlan or a provider with plan_for) for every model whose config
    has none of its own, e.g. from flags; `cuda_graphs`: capture and replay every compute
    action (--terapipe-cuda-graphs); `scatter_gather`: split each message over the TP ranks
    (--terapipe-scatter-gather-p2p)."""
    if not isinstance(source, TeraPipePlan) and not hasattr(source, "plan_for"):
        raise ValueError(f"select() takes a TeraPipePlan or a plan provider, got {type(source).__name__}")
    STATE.default = TeraPipeConfig(plan=source, cuda_graphs=cuda_graphs,
                                   scatter_gather=scatter_gather)
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
    its backward, a W action) as a CUDA graph once and replay it (runtime/graphs/cell_graphs.py);
    needs CUDA; None leaves the choice to the flags (`select`). `graph_factory(label)` makes
    each graph instead of torch.cuda.CUDAGraph (tests pass
    runtime.graphs.cell_graphs.RecordingGraph).
    Other fields of an existing config.terapipe (on_run, transport) are kept.
    """
    if not isinstance(plan, TeraPipePlan) and not hasattr(plan, "plan_for"):
        raise ValueError(
            f"configure() takes a TeraPipePlan or a plan provider with plan_for(), got {type(plan).__name__}")
    check_config(config, plan if isinstance(plan, TeraPipePlan) else None, bool(cuda_graphs),
                 graph_factory)
    own = getattr(config, "terapipe", None) or TeraPipeConfig()
    config.terapipe = replace(own, plan=plan, graph_factory=graph_factory,
                              cuda_graphs=own.cuda_graphs if cuda_graphs is None else cuda_graphs)
    STATE.selected = True


def check_config(config, plan: Optional[TeraPipePlan] = None, cuda_graphs: bool = False,
                 graph_factory: Optional[Callable[[str], object]] = None) -> None:
    """What `configure` refuses: the support rules (support/refusals.py) on `config` with the CUDA graphs
    asked for and the plan's model chunks per stage, and a plan whose slices sequence parallelism cannot split over the TP ranks."""
    device = ""
    if cuda_graphs and graph_factory is None:
        import torch

        device = "" if torch.cuda.is_available() else "this process sees no CUDA device"
    view = view_from_config(config, cuda_graphs, CONFIGURE_GRAPHS, device)
    check_view(replace(view, plan_virtual_stages=plan.virtual_stages) if plan is not None else view)
    if plan is not None and getattr(config, "sequence_parallel", False):
        plan.check_multiple_of(config.tensor_model_parallel_size)


def config_view(config, model=None) -> RunView:
    """The rules' view of the model `config` describes, with the CUDA graphs it runs with
    (run_config: configure's, or the flag's); without a graph factory, a `model` not on CUDA
    cannot capture them."""
    terapipe, own = run_config(config), getattr(config, "terapipe", None)
    graphs = bool(terapipe.cuda_graphs)
    option = CONFIGURE_GRAPHS if own is not None and own.cuda_graphs is not None else FLAG_GRAPHS
    device = ""
    if graphs and terapipe.graph_factory is None and model is not None:
        on = next((p.device.type for p in getattr(model, "parameters", list)()), "cuda")
        device = "" if on == "cuda" else f"the model is on {on}"
    return replace(view_from_config(config, graphs, option, device),
                   scatter_gather=bool(terapipe.scatter_gather))


#: The loose TransformerConfig attributes config.terapipe replaced (TeraPipeConfig's fields):
#: a script that still sets one is told so, instead of being silently ignored.
REPLACED_ATTRIBUTES = ("terapipe_plan", "terapipe_cuda_graphs", "terapipe_graph_factory",
                       "terapipe_on_run", "terapipe_transport")


def check_replaced_attributes(config) -> None:
    """Raise ValueError, naming the new field, for a config with one of REPLACED_ATTRIBUTES."""
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
    STATE.measured = None


def selected() -> bool:
    return STATE.selected


def set_schedule_wrapper(wrapper: Optional[Callable[[Callable], Callable]]) -> None:
    """While TeraPipe is selected, get_forward_backward_func returns `wrapper(schedule)`.

    `setup_from_args` uses it to run Megatron-LM's forward_step per cell (MegatronLMCells).
    None restores the plain schedule.
    """
    STATE.schedule_wrapper = wrapper


def set_measured_choice(choice: Optional[object]) -> None:
    """While TeraPipe is selected, get_forward_backward_func returns `choice.wrap(Megatron's
    schedule, TeraPipe's)`: a MeasuredChoice (measured_choice.py) times its candidates on the
    first iterations and keeps the fastest. None: TeraPipe's schedule alone."""
    STATE.measured = choice
