"""python -m megatron_terapipe.planner.cli: terapipe-plan."""

import sys

from .command import main

sys.exit(main())
