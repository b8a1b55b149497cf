"""megatron/platform/compat.py: the version check, the supported range, and each touch point's adapter
on the installed megatron-core (run on both lines by noxfile.py)."""

from __future__ import annotations

import configparser
import functools
import os
import re

import pytest

from megatron_terapipe.megatron.platform import compat
from megatron_terapipe.megatron.platform import version_report
from megatron_terapipe.megatron.platform import checkpoint_versions
from harness.paths import PACKAGE, ROOT


def test_version_strings_parse():
    assert compat.parse_version("0.19.2") == (0, 19, 2)
    assert compat.parse_version("0.16.0rc0.dev123") == (0, 16, 0)
    assert compat.parse_version("1") == (1, 0, 0)


def test_the_installed_megatron_core_is_a_tested_line_and_every_check_passes():
    assert compat.is_tested(), compat.version_text()
    assert [(name, error) for name, error in version_report.check_all() if error] == []


@pytest.mark.parametrize("version", [(0, 15, 3), (0, 20, 0), (1, 0, 0)])
def test_an_untested_megatron_core_is_refused_naming_the_supported_lines(monkeypatch, version):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: version)
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UnsupportedMegatronError) as info:
        compat.require_tested("the RoPE offset hook")
    message = str(info.value)
    for needle in ("the RoPE offset hook", compat.version_text(version), "0.16.x", "0.17.x",
                   "0.18.x", "0.19.x", "Python 3.12", compat.ALLOW_UNTESTED_ENV):
        assert needle in message
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    compat.require_tested("the RoPE offset hook")  # the user's choice: no error


def test_every_private_touch_point_checks_the_version(monkeypatch):
    from megatron_terapipe.megatron.hooks import install
    from megatron_terapipe.megatron import launch

    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 20, 0))
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    checks = [install.install, launch.install_hooks, compat.cpu_mode_modules,
              compat.rng_module, compat.parallel_linear_classes,
              compat.vocab_parallel_embedding_class, compat.fused_wgrad_accumulate,
              compat.rotary_embedding_classes, compat.gpt_model_class,
              compat.megatron_lm_argument_hooks,
              checkpoint_versions.megatron_lm_checkpointing]
    for check in checks:
        with pytest.raises(compat.UnsupportedMegatronError):
            check()


def test_linear_calls_defer_only_with_neutral_extra_keywords():
    assert compat.linear_call_is_deferrable({})
    assert compat.linear_call_is_deferrable({"gtp_remat_size": 1})  # 0.19, weight not sharded
    assert not compat.linear_call_is_deferrable({"gtp_remat_size": 2})
    assert not compat.linear_call_is_deferrable({"a_keyword_from_the_future": None})


def test_parallel_linears_call_forward_impl_with_only_known_keywords():
    """What the deferral patch sees: the keywords the installed layers pass to _forward_impl."""
    import inspect

    for cls in compat.parallel_linear_classes():
        source = inspect.getsource(cls.forward)
        call = source[source.index("self._forward_impl("):]
        call = call[:call.index("\n        )")]
        keywords = set(re.findall(r"\n\s+(\w+)=", call))
        known = {"input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad",
                 "sequence_parallel", "grad_output_buffer", "wgrad_deferral_limit", "tp_group"}
        assert keywords - known <= set(compat._NEUTRAL_LINEAR_KWARGS), keywords - known


def test_layer_submodules_of_a_module_spec_and_of_a_partial():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_terapipe.megatron.model.layer_specs import with_slice_attention
    from megatron_terapipe.runtime.attention.slice_attention import SliceAttention

    spec = get_gpt_layer_local_spec()
    assert compat.layer_submodules(spec) is spec.submodules
    as_partial = functools.partial(TransformerLayer, submodules=spec.submodules)
    assert compat.layer_submodules(as_partial) is spec.submodules
    sliced = with_slice_attention(as_partial)
    attention = compat.layer_submodules(compat.layer_submodules(sliced).self_attention)
    assert attention.core_attention is SliceAttention
    with pytest.raises(ValueError, match="submodules"):
        compat.layer_submodules(object())


def test_config_fields_read_are_listed_and_exist_on_transformer_config():
    read = set()  # where Megatron's config is handled (the planner has configs of its own)
    # megatron/'s top-level modules and every runtime/ module (its wgrad/ and graphs/ included)
    folders = ("megatron", "runtime", "runtime/wgrad", "runtime/graphs")
    for folder in (os.path.join(PACKAGE, *name.split("/")) for name in folders):
        for name in os.listdir(folder):
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                read |= set(re.findall(r"\bconfig\.([A-Za-z_][A-Za-z0-9_]*)\b(?!\()", text))
                read |= set(re.findall(r"getattr\(config, \"(\w+)\"", text))
    ours = {name for name in read if name.startswith("terapipe_")}
    assert read - ours - set(compat.CONFIG_FIELDS_READ) == set(), \
        "a TransformerConfig field is read but not listed in compat.CONFIG_FIELDS_READ"
    assert version_report.missing_config_fields() == []


def test_a_multi_module_collection_is_refused_when_terapipe_is_selected():
    pytest.importorskip("megatron.core.process_groups_config")
    from megatron.core import process_groups_config

    from megatron_terapipe import TeraPipePlan
    from megatron_terapipe.megatron.hooks import install, selection

    multi = getattr(process_groups_config, "MultiModuleProcessGroupCollection", None)
    if multi is None:
        pytest.skip("this megatron-core has no multi-module collections (0.16)")
    collection = multi.__new__(multi)
    assert compat.is_multi_module_collection(collection)
    assert not compat.is_multi_module_collection(None)
    install.install()
    selection.select(TeraPipePlan(seq_slices=(4, 4)))
    try:
        with pytest.raises(ValueError, match="multi-module"):
            install._terapipe_or_megatron(schedule_pg_collection=collection)
    finally:
        selection.deselect()


def test_set_current_microbatch_comes_from_the_lines_home():
    impl = compat._set_current_microbatch_impl()
    expected = ("megatron.core.transformer.cuda_graphs" if compat.megatron_core_version() >= (0, 17)
                else "megatron.core.pipeline_parallel.schedules")
    assert impl.__module__ == expected


def test_cpu_mode_answers_cuda_stream_queries_without_cuda():
    import torch

    from megatron_terapipe.megatron.platform.cpu_mode import _CpuTorchProxy

    proxy = _CpuTorchProxy()
    if torch.cuda.is_available():
        assert proxy.cuda is torch.cuda
        return
    stream = proxy.cuda.current_stream()
    stream.wait_event(None)
    stream.wait_stream(proxy.cuda.default_stream())
    with proxy.cuda.stream(stream):
        pass
    assert proxy.zeros(2, device="cuda").device.type == "cpu"


def test_the_pin_admits_exactly_the_tested_lines():
    from packaging.requirements import Requirement

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines()]
    pin = Requirement(next(line for line in lines if line.startswith("megatron-core")))
    for version in ("0.16.0", "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.2", "0.19.0", "0.19.2"):
        assert pin.specifier.contains(version), version
    for version in ("0.15.3", "0.20.0"):
        assert not pin.specifier.contains(version), version
    assert sorted(compat.TESTED_LINES) == [(0, 16), (0, 17), (0, 18), (0, 19)]
    # The sentence every refusal quotes names each tested line and the Python it needs.
    for (major, minor), python in compat.TESTED_LINES.items():
        assert f"{major}.{minor}.x" in compat.SUPPORTED, (major, minor)
        assert f"Python {python} or newer" in compat.SUPPORTED, python
