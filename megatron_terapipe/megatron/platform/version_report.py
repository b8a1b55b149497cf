"""Every check of megatron/platform/compat.py on the installed megatron-core, as a report:

    python -m megatron_terapipe.megatron.platform.version_report

Exit status 0 when megatron-core is on a tested line and every touch point checks out (the nox
sessions print it before their tests; tests/glue/platform/test_compat.py asserts it).
"""

from __future__ import annotations

import sys
from typing import Optional

from . import compat
from . import router_versions


def check_all() -> list[tuple[str, Optional[str]]]:
    """(touch point, None if it checks out or the error) for every check that needs no process
    group and no Megatron-LM."""
    checks = [("schedule getter", compat.schedule_getter_modules),
              ("set_current_microbatch", compat._set_current_microbatch_impl),
              ("parallel linears' _forward_impl", compat.parallel_linear_classes),
              ("VocabParallelEmbedding", compat.vocab_parallel_embedding_class),
              ("fused weight-gradient kernel", compat.fused_wgrad_accumulate),
              ("RoPE offset", compat.rotary_embedding_classes),
              ("GPTModel.__init__", compat.gpt_model_class),
              ("CPU mode modules", compat.cpu_mode_modules),
              ("RNG state (tensor_parallel.random)", compat.rng_module),
              ("TopKRouter's loss methods", router_versions.router_class),
              ("MoE loss tracker", router_versions.metrics_recorder),
              ("TransformerConfig fields", missing_config_fields)]
    results = []
    for name, check in checks:
        try:
            missing = check()
            error = f"missing {missing}" if name == "TransformerConfig fields" and missing else None
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            error = f"{type(exc).__name__}: {exc}"
        results.append((name, error))
    return results


def missing_config_fields() -> list[str]:
    """CONFIG_FIELDS_READ, and the line-specific fields of the installed line, that the
    installed TransformerConfig does not define."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    line = compat.megatron_core_version()[:2]
    read = [*compat.CONFIG_FIELDS_READ,
            *(name for name, since in router_versions.LINE_CONFIG_FIELDS.items() if line >= since)]
    return [name for name in read if name not in fields]


def main() -> int:
    import platform

    version = compat.megatron_core_version()
    print(f"megatron-core {compat.version_text(version)} on Python {platform.python_version()}: "
          f"{'tested' if compat.is_tested(version) else 'NOT tested'} "
          f"(supported: {compat.SUPPORTED})")
    failed = 0
    for name, error in check_all():
        print(f"  {name:32s} {'ok' if error is None else error}")
        failed += error is not None
    return 1 if failed or not compat.is_tested(version) else 0


if __name__ == "__main__":
    sys.exit(main())
