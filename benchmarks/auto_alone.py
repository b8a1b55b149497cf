"""One schedule of auto's shortlist, alone: Megatron-LM's script through the launcher with
`--pipeline-schedule auto`, the shortlist replaced by the one candidate given (bench_auto.py's
"alone" runs). Its trial line is that candidate's median over --terapipe-auto-trials iterations
after one warm-up, as auto times it among the others.

    torchrun --nproc-per-node 2 benchmarks/auto_alone.py NAME PLAN_JSON|megatron SCRIPT FLAGS...
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from megatron_terapipe.megatron import launch
    from megatron_terapipe.megatron.args import auto_trials
    from megatron_terapipe.megatron.hooks.measured_choice import TrialCandidate
    from megatron_terapipe.plan import TeraPipePlan

    name, plan_text, rest = argv[0], argv[1], argv[2:]
    plan = None if plan_text == "megatron" else TeraPipePlan.from_dict(json.loads(plan_text))
    candidate = TrialCandidate(name, plan)
    auto_trials.shortlist = lambda inputs, table, chunks, placement="ring": [candidate]
    auto_trials.make_replan = lambda *args, **kwargs: None
    return launch.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
