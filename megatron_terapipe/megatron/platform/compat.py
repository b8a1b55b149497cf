"""The version-sensitive part of every Megatron touch point, in one place.

Tested megatron-core lines (`TESTED_LINES`): 0.16.x (Python 3.10 or newer), 0.17.x, 0.18.x
and 0.19.x (Python 3.12 or newer). Public names are used where they are.
Everything else the plugin reaches into (a private attribute, a module attribute it replaces,
a helper whose home moved) goes through a function here that calls `require_tested(touch)`
first: on an untested megatron-core that raises `UnsupportedMegatronError` naming the touch
point, the installed version and the supported lines, unless ALLOW_UNTESTED_ENV=1 says to try
anyway. docs/megatron.md lists every touch point and what moved between the lines;
`python -m megatron_terapipe.megatron.platform.version_report` runs every check here.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sys
from typing import Any, Callable, Optional

#: megatron-core lines the test matrix runs (noxfile.py), with the Python each one needs.
TESTED_LINES = {(0, 16): "3.10", (0, 17): "3.12", (0, 18): "3.12", (0, 19): "3.12"}
SUPPORTED = ("megatron-core 0.16.x (Python 3.10 or newer), 0.17.x, 0.18.x or 0.19.x "
             "(Python 3.12 or newer)")
ALLOW_UNTESTED_ENV = "MEGATRON_TERAPIPE_ALLOW_UNTESTED_MEGATRON"

#: TransformerConfig fields the project reads or sets (tests/glue/platform/test_compat.py checks each one
#: exists on the installed megatron-core, and that megatron/ and runtime/ touch no other).
CONFIG_FIELDS_READ = (
    "attention_dropout", "autocast_dtype", "barrier_with_L1_time", "calculate_per_token_loss",
    "context_parallel_size", "deallocate_pipeline_outputs", "defer_embedding_wgrad_compute",
    "enable_autocast", "finalize_model_grads_func", "grad_scale_func", "grad_sync_func",
    "hidden_size", "init_method", "kv_channels", "layernorm_epsilon", "mtp_num_layers",
    "moe_aux_loss_coeff", "moe_expert_capacity_factor", "moe_router_fusion",
    "moe_router_load_balancing_type", "moe_z_loss_coeff",
    "no_sync_func", "normalization", "num_layers", "num_moe_experts", "pipeline_dtype",
    "sequence_parallel", "tensor_model_parallel_size", "timers", "variable_seq_lengths",
    "virtual_pipeline_model_parallel_size")


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core is outside the tested lines, or its API moved."""


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as '0.19.2' or '0.16.0rc0.dev123'."""
    numbers = [int(m.group()) if m else 0
               for m in (re.match(r"\d+", p) for p in (text.split(".") + ["0", "0"])[:3])]
    return numbers[0], numbers[1], numbers[2]


@functools.lru_cache(maxsize=None)
def megatron_core_version() -> tuple[int, int, int]:
    """The megatron-core that is imported (a checkout on sys.path wins over the installed wheel)."""
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise UnsupportedMegatronError(
            f"megatron-terapipe needs megatron-core ({exc}): pip install megatron-core "
            f"(supported: {SUPPORTED})") from exc
    return parse_version(str(package_info.__version__))


def version_text(version: Optional[tuple[int, int, int]] = None) -> str:
    return ".".join(str(v) for v in (version or megatron_core_version()))


def is_tested(version: Optional[tuple[int, int, int]] = None) -> bool:
    return (version or megatron_core_version())[:2] in TESTED_LINES


def untested_message(touch: str, version: tuple[int, int, int]) -> str:
    return (f"megatron-terapipe: {touch} depends on megatron-core internals that were tested "
            f"only with {SUPPORTED}, but megatron-core {version_text(version)} is installed. "
            "Install a tested version (pip install 'megatron-core>=0.19,<0.20' on Python 3.12+, "
            f"or 'megatron-core>=0.16,<0.17'), or set {ALLOW_UNTESTED_ENV}=1 to try this one "
            "at your own risk")


def require_tested(touch: str) -> None:
    """Raise UnsupportedMegatronError unless megatron-core is on a tested line (or the user
    set MEGATRON_TERAPIPE_ALLOW_UNTESTED_MEGATRON=1)."""
    version = megatron_core_version()
    if is_tested(version) or os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        return
    raise UnsupportedMegatronError(untested_message(touch, version))


def moved(touch: str, detail: str) -> UnsupportedMegatronError:
    """The error for an API that is not where the tested lines have it."""
    return UnsupportedMegatronError(
        f"megatron-terapipe: {touch}: {detail} in megatron-core {version_text()} (tested with "
        f"{SUPPORTED}); install a tested megatron-core")


# --- Schedules: the getter TeraPipe replaces, helpers shared with Megatron's schedules ---------
SCHEDULE_GETTER = "get_forward_backward_func"
#: Modules that bind the getter by name; megatron.training.* only inside Megatron-LM.
SCHEDULE_GETTER_MODULES = ("megatron.core.pipeline_parallel.schedules",
                           "megatron.core.pipeline_parallel",
                           "megatron.training.training", "megatron.training")


def schedule_getter_modules() -> list:
    """The imported modules whose `get_forward_backward_func` must be replaced."""
    require_tested("replacing get_forward_backward_func")
    import megatron.core.pipeline_parallel  # noqa: F401  (imports .schedules too)

    modules = [sys.modules[name] for name in SCHEDULE_GETTER_MODULES
               if hasattr(sys.modules.get(name), SCHEDULE_GETTER)]
    if len(modules) < 2:
        raise moved("replacing get_forward_backward_func",
                    "megatron.core.pipeline_parallel(.schedules) has no get_forward_backward_func")
    return modules


def is_multi_module_collection(schedule_pg_collection: Any) -> bool:
    """Whether get_forward_backward_func got a multi-module collection (0.19: bridge schedule)."""
    if schedule_pg_collection is None:
        return False
    try:
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    except ImportError:  # 0.16: the keyword does not exist
        return False
    return isinstance(schedule_pg_collection, MultiModuleProcessGroupCollection)


def check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    """Megatron's rule for calling set_is_first_microbatch (same on both lines)."""
    from megatron.core.pipeline_parallel import schedules

    helper = getattr(schedules, "check_first_val_step", None)
    if helper is None:
        raise moved("the first-microbatch rule", "schedules.check_first_val_step is gone")
    return helper(first_val_step, forward_only, cond)


@functools.lru_cache(maxsize=None)
def _set_current_microbatch_impl():
    require_tested("set_current_microbatch")
    for home in ("megatron.core.transformer.cuda_graphs",  # 0.17 to 0.19
                 "megatron.core.pipeline_parallel.schedules"):  # 0.16
        helper = getattr(importlib.import_module(home), "set_current_microbatch", None)
        if helper is not None:
            return helper
    raise moved("set_current_microbatch", "neither transformer.cuda_graphs nor "
                "pipeline_parallel.schedules defines it")


def set_current_microbatch(model, microbatch: int) -> None:
    """Tell the model's layers which microbatch runs (CUDA-graph replay reads it)."""
    _set_current_microbatch_impl()(model, microbatch)


def default_pg_collection():
    """The process groups Megatron's schedules use when none are passed (both lines' fields)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = parallel_state.get_tensor_model_parallel_group()
    pgc.cp = parallel_state.get_context_parallel_group()
    pgc.pp = parallel_state.get_pipeline_model_parallel_group()
    pgc.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgc.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgc.dp_cp = parallel_state.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=False)
    pgc.dp = parallel_state.get_data_parallel_group(
        with_context_parallel=False, partial_data_parallel=False)
    pgc.tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return pgc


def make_p2p_communicator(pp_group, config):
    """Megatron's P2PCommunicator(pp_group=, config=) (same constructor on both lines)."""
    from megatron.core.pipeline_parallel import p2p_communication

    return p2p_communication.P2PCommunicator(pp_group=pp_group, config=config)


# --- Layers: spec slots, the parallel linears' private forward, rotary embeddings --------------
def layer_submodules(spec) -> Any:
    """The `submodules` of a layer spec: a ModuleSpec, or (0.19) a partial with submodules=."""
    if isinstance(spec, functools.partial) and "submodules" in spec.keywords:
        return spec.keywords["submodules"]
    submodules = getattr(spec, "submodules", None)
    if submodules is None:
        raise ValueError(
            "TeraPipe needs a GPT layer spec with submodules (e.g. Megatron's "
            f"get_gpt_layer_local_spec()), got {type(spec).__name__}")
    return submodules


def local_spec_torch_norm() -> type:
    """The norm Megatron's local spec uses without apex (`WrappedTorchNorm`)."""
    from megatron.core.transformer import torch_norm

    return torch_norm.WrappedTorchNorm


#: Keywords 0.19 adds to `_forward_impl` calls, with the value under which deferring the
#: weight gradient is the same computation (any other value: Megatron computes it at once).
_NEUTRAL_LINEAR_KWARGS = {"gtp_remat_size": 1}


def parallel_linear_classes() -> tuple[type, type]:
    """(ColumnParallelLinear, RowParallelLinear), checked to route their matmul through the
    private `_forward_impl` that weight-gradient deferral replaces per module."""
    require_tested("deferring weight gradients (the parallel linears' _forward_impl)")
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for cls in (ColumnParallelLinear, RowParallelLinear):
        if not callable(getattr(cls, "_forward_impl", None)):
            raise moved("deferring weight gradients", f"{cls.__name__} has no _forward_impl")
    return ColumnParallelLinear, RowParallelLinear


def linear_call_is_deferrable(extra_kwargs: dict) -> bool:
    """Whether a `_forward_impl` call with these keywords (beyond the 0.16 ones) may defer its
    weight gradient: only keywords known to be neutral, at their neutral value."""
    return all(k in _NEUTRAL_LINEAR_KWARGS and v == _NEUTRAL_LINEAR_KWARGS[k]
               for k, v in extra_kwargs.items())


def vocab_parallel_embedding_class() -> type:
    """VocabParallelEmbedding; deferral replaces its forward's F.embedding lookups of `weight`
    (a forward that looks the table up otherwise just does not defer)."""
    require_tested("deferring embedding gradients (VocabParallelEmbedding)")
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    return VocabParallelEmbedding


def fused_wgrad_accumulate() -> Optional[Callable]:
    """Megatron's gradient_accumulation_fusion kernel, apex's wgrad_gemm_accum_fp32(input,
    grad_output, main_grad), from tensor_parallel.layers' private import; None without apex."""
    require_tested("the fused weight-gradient kernel (tensor_parallel.layers)")
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", False):
        return None
    return layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32


def rotary_embedding_classes() -> tuple[type, Optional[type]]:
    """(RotaryEmbedding, MultimodalRotaryEmbedding or None); RotaryEmbedding.forward must take
    the `offset` keyword the RoPE pre-hook sets."""
    require_tested("the RoPE offset hook")
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    if "offset" not in inspect.signature(rope.RotaryEmbedding.forward).parameters:
        raise moved("the RoPE offset hook", "RotaryEmbedding.forward takes no offset=")
    return rope.RotaryEmbedding, getattr(rope, "MultimodalRotaryEmbedding", None)


def gpt_model_class() -> type:
    """GPTModel, checked to take the layer spec as the argument after config."""
    require_tested("wrapping GPTModel.__init__")
    from megatron.core.models.gpt.gpt_model import GPTModel

    params = list(inspect.signature(GPTModel.__init__).parameters)
    if params[1:3] != ["config", "transformer_layer_spec"]:
        raise moved("wrapping GPTModel.__init__",
                    f"GPTModel.__init__ takes {params[1:3]}, not (config, transformer_layer_spec)")
    return GPTModel


# --- CPU mode ----------------------------------------------------------------------------------
#: Modules whose module-level `torch` CPU mode replaces: they create tensors with device="cuda"
#: or ask CUDA for streams on paths a CPU training step takes.
CPU_MODE_MODULES = ("megatron.core.pipeline_parallel.schedules",
                    "megatron.core.distributed.param_and_grad_buffer",
                    "megatron.core.transformer.utils",
                    "megatron.core.optimizer.optimizer",
                    "megatron.core.optimizer.clip_grads",
                    "megatron.core.optimizer.grad_scaler",
                    "megatron.core.utils",  # and MoE's side streams and "cuda" buffers:
                    *(f"megatron.core.transformer.moe.{name}" for name in (
                        "token_dispatcher", "moe_utils", "router", "experts", "shared_experts")))


def cpu_mode_modules() -> list:
    """The imported CPU_MODE_MODULES, each checked to use a module-level `torch`."""
    require_tested("CPU mode")
    modules = []
    for name in CPU_MODE_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is None:
            raise moved("CPU mode", f"{name} no longer imports torch at module level")
        modules.append(module)
    return modules


def rng_module():
    """megatron.core.tensor_parallel.random, checked for the private names CPU mode replaces
    (activation checkpointing saves and restores the CUDA RNG through them) and the planner
    saves around its measurement (the global RNG tracker)."""
    require_tested("Megatron's RNG state (tensor_parallel.random)")
    from megatron.core.tensor_parallel import random as tp_random

    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state", "model_parallel_cuda_manual_seed",
                 "initialize_rng_tracker", "_CUDA_RNG_STATE_TRACKER",
                 "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        if not hasattr(tp_random, name):
            raise moved("Megatron's RNG state", f"tensor_parallel.random.{name} is gone")
    return tp_random


def save_rng_tracker() -> Optional[tuple]:
    """Megatron's global RNG tracker (None before it is made), whether it was initialised, and
    its states. A tracker that cannot give its states raises: the caller promises to keep them."""
    tp_random = rng_module()
    tracker = tp_random._CUDA_RNG_STATE_TRACKER
    states = tracker.get_states() if tracker is not None else None
    return tracker, tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED, states


def restore_rng_tracker(saved: tuple) -> None:
    """Put back what save_rng_tracker saved; a tracker that refuses its states raises."""
    tracker, initialized, states = saved
    tp_random = rng_module()
    tp_random._CUDA_RNG_STATE_TRACKER = tracker
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = initialized
    if tracker is not None:
        tracker.set_states(states)


# --- Megatron-LM (megatron.training: a checkout's, or the one 0.19's wheel ships) --------------
#: (module, function, kind) the launcher wraps: 'parse' gets TeraPipe's flags added, 'validate'
#: sets TeraPipe up after Megatron-LM validated. 0.16's initialize_megatron calls the names it
#: imported into megatron.training.initialize; 0.19's parse_and_validate_args calls the
#: arguments module's globals and imports yaml_arguments.validate_yaml when it runs.
MEGATRON_LM_ARGUMENT_HOOKS = tuple(
    (f"megatron.training.{module}", function, kind) for module, function, kind in (
        ("arguments", "parse_args", "parse"), ("arguments", "validate_args", "validate"),
        ("initialize", "parse_args", "parse"), ("initialize", "validate_args", "validate"),
        ("initialize", "validate_yaml", "validate"),
        ("yaml_arguments", "validate_yaml", "validate")))


def megatron_lm_argument_hooks() -> list[tuple[Any, str, str]]:
    """(module, function name, kind) for each hook point in the importable megatron.training."""
    require_tested("hooking Megatron-LM's parse_args/validate_args")
    found = []
    for name, function, kind in MEGATRON_LM_ARGUMENT_HOOKS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            if name == "megatron.training.arguments":
                raise
            continue  # e.g. yaml_arguments without PyYAML: no YAML configs to validate either
        if callable(getattr(module, function, None)):
            found.append((module, function, kind))
    if not any(f == "parse_args" for _, f, _ in found):
        raise moved("hooking Megatron-LM's arguments", "arguments.parse_args is gone")
    return found


#: Megatron-LM modules whose `torch` sees the CPU as one CUDA device under --terapipe-cpu
#: (lm_cpu.py), per line: 0.18 split megatron.training.utils into a package and wraps models
#: in DDP (in a side CUDA stream) in megatron.training.models.dist_utils.
_LM_CPU_MODULES = ("megatron.core.rerun_state_machine", "megatron.training.initialize",
                   "megatron.training.training")
_LM_CPU_MODULES_SPLIT_UTILS = _LM_CPU_MODULES + ("megatron.training.utils.common_utils",
                                                 "megatron.training.models.dist_utils")
MEGATRON_LM_CPU_MODULES = {(0, 16): _LM_CPU_MODULES + ("megatron.training.utils",),
                           (0, 18): _LM_CPU_MODULES_SPLIT_UTILS,
                           (0, 19): _LM_CPU_MODULES_SPLIT_UTILS}
MEGATRON_LM_CPU_MODULES[(0, 17)] = MEGATRON_LM_CPU_MODULES[(0, 16)]


def megatron_lm_cpu_modules() -> tuple[list, Any]:
    """The imported MEGATRON_LM_CPU_MODULES of this line, and megatron.legacy.fused_kernels
    (built with nvcc at start-up by 0.16's initialize_megatron; None where it is gone)."""
    require_tested("Megatron-LM on CPU (--terapipe-cpu)")
    names = MEGATRON_LM_CPU_MODULES.get(megatron_core_version()[:2],
                                        MEGATRON_LM_CPU_MODULES[max(MEGATRON_LM_CPU_MODULES)])
    try:
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
    except ImportError:
        fused_kernels = None
    return [importlib.import_module(name) for name in names], fused_kernels


def megatron_lm_global_args() -> Optional[Any]:
    """Megatron-LM's global args (the per-cell wrapper mutates them), or None before them."""
    module = sys.modules.get("megatron.training.global_vars")
    if module is None:
        return None
    if not hasattr(module, "_GLOBAL_ARGS"):
        raise moved("running Megatron-LM's forward_step per cell",
                    "megatron.training.global_vars has no _GLOBAL_ARGS")
    return module._GLOBAL_ARGS
