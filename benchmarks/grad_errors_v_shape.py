"""How far below its tolerances each chunks-in-a-V case of tests/equivalence/test_virtual_runs.py
is: TeraPipe on 2 chunks in a V against Megatron's no-pipelining run on the full model. Per case,
over every rank: the worst max|g - g_ref| / max|g_ref| of any parameter's gradient
(harness.max_relative_error; the test asserts every element within rtol 1e-4 / atol 1e-6) and
the worst relative difference of any reported loss (asserted rtol 1e-6).
Run: python benchmarks/grad_errors_v_shape.py
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "equivalence"))  # the cases of the tests it reads
from harness import max_relative_error, spawn  # noqa: E402
import test_virtual_runs as runs  # noqa: E402


def errors(results: list, case) -> tuple[float, float]:
    grad = loss = 0.0
    for rank_result in results:
        result = rank_result[case.name]
        grad = max(grad, max_relative_error(result["grads"])[0])
        if result["last_stage"]:
            for got, ref in zip(result["losses"], result["ref_losses"]):
                loss = max(loss, abs(got[0] / ref[0] - 1))
    return grad, loss


def main() -> None:
    for world, cases in ((2, runs.CASES_2), (4, runs.CASES_4)):
        in_a_v = [case for case in cases if "in_a_v" in case.name]
        results = spawn(world, "harness.runs.virtual_runs:run_virtual_cases", in_a_v, timeout=900)
        for case in in_a_v:
            grad, loss = errors(results, case)
            print(f"{case.name:40s} {world} processes: worst grad {grad:.1e}  worst loss "
                  f"{loss:.1e}", flush=True)


if __name__ == "__main__":
    main()
