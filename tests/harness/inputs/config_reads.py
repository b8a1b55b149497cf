"""Which model-config fields a piece of Megatron-Core reads: every `config.<name>` and
`getattr(config, "<name>"...)` in its source (`self.config` too; not `ddp_config`). The coverage
tests hold TeraPipe to an answer for each: computed, without effect, or refused
(`config_refusal`: what the support rules say of a config holding given fields)."""

from __future__ import annotations

import argparse
import inspect
import re
from typing import Any, Optional

_READ = re.compile(r"(?<![A-Za-z0-9_])config\.([A-Za-z_][A-Za-z0-9_]*)")
_GETATTR = re.compile(r"getattr\((?:self\.)?config,\s*['\"]([A-Za-z_][A-Za-z0-9_]*)['\"]")


def config_fields_read(source_of) -> set[str]:
    """The config fields `source_of` (a module, class or function) reads."""
    text = inspect.getsource(source_of)
    return set(_READ.findall(text)) | set(_GETATTR.findall(text))


def config_refusal(**fields: Any) -> Optional[str]:
    """The support rules' refusal of a config holding just `fields` (None: TeraPipe runs it)."""
    from megatron_terapipe.megatron.support.run_views import view_from_config
    from megatron_terapipe.megatron.support.refusals import refusal

    return refusal(view_from_config(argparse.Namespace(**fields)))
