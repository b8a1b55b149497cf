"""The worst gradient error of these exactness cases (MoE losses on model
chunks, with edge slicing and with padding; uneven layer splits; packed documents): per case,
the largest max|g - g_ref| / max|g_ref| over its parameters (parameters whose reference is 0
up to 1e-8 left out, as harness.check_gradients leaves them), against Megatron's
no-pipelining run (or its interleaved 1F1B). The tests assert FP32's 1e-5; this prints how
far below it each case is. Run: python benchmarks/grad_errors_new_cases.py
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "equivalence"))  # the cases of the tests it reads
from harness import spawn  # noqa: E402
import test_equivalence as eq  # noqa: E402
import test_moe_losses as moe  # noqa: E402
import test_stage_split_runs as split  # noqa: E402
import test_virtual_runs as vr  # noqa: E402

def worst(results: list, name: str) -> tuple[float, str]:
    """The case's largest max-normalised gradient error over every rank's parameters."""
    error, where = 0.0, ""
    for rank_result in results:
        for param, (grad, ref) in rank_result[name]["grads"].items():
            scale = float(ref.abs().max())
            if grad is not None and scale > 1e-8:
                error, where = max((error, where), (float((grad - ref).abs().max()) / scale, param))
    return error, where


def show(title: str, results: list, cases: list) -> None:
    for case in cases:
        error, param = worst(results, case.name)
        print(f"{title:6s} {case.name:55s} worst grad {error:.1e} ({param})", flush=True)


def main() -> None:
    named = lambda cases, *keys: [c for c in cases if any(k in c.name for k in keys)]  # noqa: E731
    moe2, moe4 = named(moe.CASES_2, "virtual", "edge"), named(moe.CASES_4, "virtual", "padding")
    show("moe2", spawn(2, "harness.runs.moe_runs:run_moe_cases", moe2, timeout=600), moe2)
    show("moe4", spawn(4, "harness.runs.moe_runs:run_moe_cases", moe4, timeout=600), moe4)
    split2, split4 = [c for c, _ in split.CASES_2], [c for c, _ in split.CASES_4]
    show("split2", spawn(2, "harness:run_cases", split2, timeout=600), split2)
    show("split4", spawn(4, "harness:run_cases", split4, timeout=600), split4)
    packed2, packed4 = named(eq.CASES_2, "packed"), named(eq.CASES_4, "packed")
    show("eq2", spawn(2, "harness:run_cases", packed2, timeout=600), packed2)
    show("eq4", spawn(4, "harness:run_cases", packed4, timeout=600), packed4)
    virtual = named(vr.CASES_2, "packed")
    show("virt2", spawn(2, "harness.runs.virtual_runs:run_virtual_cases", virtual, timeout=600), virtual)


if __name__ == "__main__":
    main()
