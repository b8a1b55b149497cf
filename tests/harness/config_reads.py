"""Which model-config fields a piece of Megatron-Core reads: every `config.<name>` in its source
(`self.config.<name>` too; not `ddp_config.<name>`). The coverage tests hold TeraPipe to an
answer for each: computed, without effect, or refused."""

from __future__ import annotations

import inspect
import re

_READ = re.compile(r"(?<![A-Za-z0-9_])config\.([A-Za-z_][A-Za-z0-9_]*)")


def config_fields_read(source_of) -> set[str]:
    """The config fields `source_of` (a module, class or function) reads."""
    return set(_READ.findall(inspect.getsource(source_of)))
