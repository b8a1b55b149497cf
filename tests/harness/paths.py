"""Where things are in the checkout, for tests that read its files or start its scripts."""

from __future__ import annotations

import os

#: The checkout's root (this file is tests/harness/paths.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The package's folder.
PACKAGE = os.path.join(ROOT, "megatron_terapipe")
#: The tests, the benchmarks, and the stand-in of Megatron-LM's `megatron.training`.
TESTS = os.path.join(ROOT, "tests")
BENCHMARKS = os.path.join(ROOT, "benchmarks")
STANDIN = os.path.join(TESTS, "standin")
