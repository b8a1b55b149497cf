"""python -m megatron_terapipe.megatron.measure {layers,memory} ... (see cli.py)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: timings on one thread

from .cli import main  # noqa: E402

sys.exit(main())
