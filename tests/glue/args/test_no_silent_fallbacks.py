"""What used to fall back without a word now stops or says so: the RNG tracker's save and
restore around the planner's measurement, a Transformer Engine that fails to import for another
reason than being absent, a layer split Megatron cannot build, an unexpected error while
planning (its type and traceback kept), a megatron-core without a version in the profile
cache's key, the flags' defaults (one place: TeraPipeSettings) and the search space's W
placement (the CLIs' default)."""

from __future__ import annotations

import argparse
import pickle
import sys
import traceback

import pytest
import torch

from megatron_terapipe.megatron.args import plan_provider
from megatron_terapipe.megatron.args.checks import TeraPipeArgumentError, validate_terapipe_args
from megatron_terapipe.megatron.args.plan_provider import ArgsPlanProvider
from megatron_terapipe.megatron.args.profile_cache import profile_cache_key
from megatron_terapipe.megatron.args.settings import TeraPipeSettings
from megatron_terapipe.megatron.model import layer_specs as spec
from megatron_terapipe.megatron.support.run_views import view_from_args
from megatron_terapipe.megatron.platform import compat
from megatron_terapipe.planner.cli.command import build_parser
from megatron_terapipe.planner.search import SearchSpace
from harness import spawn
from harness.inputs.flags import parse, run_settings

TERAPIPE = ["--pipeline-schedule", "terapipe"]


# ---- the RNG tracker around the planner's measurement (compat.save/restore_rng_tracker) ------
class _Tracker:
    """A tracker whose get_states or set_states fails, as one on a lost device would."""

    def __init__(self, get_fails: bool = False, set_fails: bool = False):
        self.get_fails, self.set_fails = get_fails, set_fails

    def get_states(self):
        if self.get_fails:
            raise RuntimeError("get_states: the device is gone")
        return {"model-parallel-rng": torch.ones(2)}

    def set_states(self, states):
        if self.set_fails:
            raise RuntimeError("set_states: the device is gone")


@pytest.fixture
def tracker(monkeypatch):
    """Megatron's global RNG tracker, set per test."""
    from megatron.core.tensor_parallel import random as tp_random

    def install(value):
        monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER", value)
        monkeypatch.setattr(tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
        return tp_random

    return install


def test_a_tracker_whose_states_cannot_be_read_or_restored_is_an_error(tracker):
    tracker(_Tracker(get_fails=True))
    with pytest.raises(RuntimeError, match="get_states: the device is gone"):
        compat.save_rng_tracker()
    tracker(_Tracker(set_fails=True))
    saved = compat.save_rng_tracker()
    with pytest.raises(RuntimeError, match="set_states: the device is gone"):
        compat.restore_rng_tracker(saved)


def test_the_measurement_leaves_the_tracker_and_its_states_as_they_were(tracker):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    kept = CudaRNGStatesTracker()
    kept.set_states({"model-parallel-rng": torch.ones(2)})
    tp_random = tracker(kept)

    def measure():  # what the measurement does: a tracker of its own, seeded
        tp_random._CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()
        kept.set_states({"model-parallel-rng": torch.zeros(2)})
        return "measured"

    assert plan_provider._with_rng_kept(measure) == "measured"
    assert tp_random._CUDA_RNG_STATE_TRACKER is kept
    assert torch.equal(kept.get_states()["model-parallel-rng"], torch.ones(2))


# ---- Transformer Engine: absent is False, broken is its own error ------------------------------
class _FailingImport:
    """A meta path finder that fails the import of transformer_engine with `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine":
            raise self.error
        return None


def _importing_te_raises(monkeypatch, error: Exception) -> None:
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingImport(error), *sys.meta_path])


def test_a_missing_transformer_engine_is_unavailable(monkeypatch):
    _importing_te_raises(monkeypatch, ModuleNotFoundError("No module named 'transformer_engine'"))
    assert spec.transformer_engine_available() is False


def test_a_transformer_engine_that_fails_to_import_says_why(monkeypatch):
    _importing_te_raises(monkeypatch, OSError("libcudart.so.12: cannot open shared object"))
    with pytest.raises(OSError, match="libcudart"):
        spec.transformer_engine_available()


# ---- a layer split Megatron cannot build is refused, not read as an even split -----------------
@pytest.mark.parametrize("megatron, flag", [
    (dict(num_layers=7, pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=2),
     "--decoder-first-pipeline-num-layers 2"),
    (dict(num_layers=8, pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=3,
          account_for_loss_in_pipeline_split=True), "--account-for-loss-in-pipeline-split"),
])
def test_a_split_megatron_cannot_build_names_its_flags(megatron, flag):
    args = parse(TERAPIPE, **megatron)
    with pytest.raises(ValueError) as info:
        view_from_args(args)
    message = str(info.value)
    assert flag in message and f"--num-layers {megatron['num_layers']}" in message
    assert "--pipeline-model-parallel-size" in message and "give" in message
    with pytest.raises(TeraPipeArgumentError, match=flag):
        validate_terapipe_args(args)


def test_a_split_megatron_builds_is_read_as_it_is():
    view = view_from_args(parse(TERAPIPE, num_layers=7, pipeline_model_parallel_size=2,
                                decoder_first_pipeline_num_layers=3))
    assert view.stage_layers.per_stage == (3, 4) and view.layers_per_stage is None


# ---- planning: its own errors are flag errors, anything else keeps its type and traceback -----
def _failing_measure(error: Exception):
    def measure(settings, cells):
        raise error
    return measure


def _profiled(tmp_path, measure) -> ArgsPlanProvider:
    argv = TERAPIPE + ["--terapipe-cost-model", "profile", "--terapipe-cache-dir", str(tmp_path)]
    return ArgsPlanProvider.from_args(parse(argv), measure=measure, log=False)


def test_an_unexpected_error_while_planning_keeps_its_type_and_traceback(tmp_path, monkeypatch):
    with pytest.raises(KeyError, match="cell") as info:
        _profiled(tmp_path, _failing_measure(KeyError("cell"))).plan_for(64, 2)
    assert "measure" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]

    def plan_run(*args, **kwargs):
        raise TypeError("plan_run() got an unexpected keyword")

    monkeypatch.setattr(plan_provider, "plan_run", plan_run)
    provider = ArgsPlanProvider.from_args(parse(TERAPIPE), log=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        provider.plan_for(64, 2)


def test_the_planners_own_errors_stay_flag_errors(tmp_path):
    with pytest.raises(TeraPipeArgumentError, match="ValueError: no cells"):
        _profiled(tmp_path, _failing_measure(ValueError("no cells"))).plan_for(64, 2)
    bad = parse(TERAPIPE + ["--terapipe-slices", "32", "16"])
    with pytest.raises(TeraPipeArgumentError, match="sum to 48 tokens"):
        ArgsPlanProvider.from_args(bad, log=False).plan_for(64, 2)


def test_other_ranks_learn_of_an_unexpected_error_by_its_name():
    failure = plan_provider._guard(lambda: {}["cell"])
    sent = pickle.loads(pickle.dumps(failure))  # what another rank receives: no exception object
    assert sent.error is None and "KeyError" in sent.message
    with pytest.raises(RuntimeError, match="KeyError: 'cell'") as info:
        plan_provider._unwrap(sent)
    assert not isinstance(info.value, TeraPipeArgumentError)
    with pytest.raises(KeyError):  # the rank that raised it raises it again
        plan_provider._unwrap(failure)


def test_an_unexpected_error_on_rank_zero_reaches_every_rank():
    raised = spawn(2, "test_no_silent_fallbacks:unexpected_error_on_rank_zero", timeout=120)
    assert raised[0] == ("LookupError", "no such cell")
    assert raised[1][0] == "RuntimeError" and "LookupError: no such cell" in raised[1][1]


def unexpected_error_on_rank_zero(rank: int, world_size: int):
    """Worker: rank 0's planning fails with an error of no flag's making. Rank 0 raises it as
    itself, the other ranks by its name; none waits for a plan that never comes."""
    if rank == 0:
        def plan_run(*args, **kwargs):
            raise LookupError("no such cell")

        plan_provider.plan_run = plan_run
    try:
        ArgsPlanProvider.from_args(parse(TERAPIPE), log=False).plan_for(64, 2)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


# ---- the profile cache's key holds megatron-core's version, never "unknown" ------------------
def test_the_cache_key_holds_megatron_cores_own_version():
    from megatron.core import package_info

    key = profile_cache_key(run_settings(parse(TERAPIPE), 64, 2))
    assert key["versions"]["megatron.core"] == str(package_info.__version__)


def test_a_megatron_core_without_a_version_is_refused_not_keyed_unknown(monkeypatch):
    import megatron.core
    from megatron.core import package_info

    monkeypatch.delattr(package_info, "__version__")
    monkeypatch.delattr(megatron.core, "__version__", raising=False)
    with pytest.raises(compat.UnsupportedMegatronError, match="megatron-core's version"):
        profile_cache_key(run_settings(parse(TERAPIPE), 64, 2))


# ---- defaults: TeraPipeSettings holds them; the flags and the search space agree -------------
def test_the_flags_defaults_are_the_settings_defaults():
    assert TeraPipeSettings.from_args(parse([])) == TeraPipeSettings()
    assert TeraPipeSettings.from_args(argparse.Namespace()) == TeraPipeSettings()


def test_a_script_without_the_flags_gets_the_dataclasses_defaults():
    from dataclasses import dataclass
    from typing import Optional

    @dataclass(frozen=True)
    class Other(TeraPipeSettings):  # every default changed: from_args must follow each
        schedule: str = "terapipe"
        defer_wgrad: Optional[bool] = None
        wgrad_placement: bool = False
        cache_dir: Optional[str] = "/tmp/elsewhere"
        cuda_graphs: bool = True
        scatter_gather: bool = True
        cpu: bool = True
        trace: Optional[str] = "trace.json"
        memory_profile: Optional[str] = "memory.json"

    assert Other.from_args(argparse.Namespace()) == Other()


def test_the_search_space_places_w_actions_as_both_clis_do():
    planner_cli = build_parser().parse_args(
        ["--model", "gpt3-1b", "--seq-length", "2048", "--pipeline-stages", "4"])
    assert planner_cli.wgrad_placement == "auto"
    assert parse([]).terapipe_wgrad_placement == "auto"
    assert SearchSpace(2048, 1, 4).place_wgrad is TeraPipeSettings().wgrad_placement is True

