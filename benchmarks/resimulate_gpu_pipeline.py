"""The simulator's predictions for a bench_gpu_pipeline.py run again, with the link measured.

    python benchmarks/resimulate_gpu_pipeline.py benchmarks/results/gpu/h100/pipeline.json
    python benchmarks/resimulate_gpu_pipeline.py FILE --run 0     # the file's oldest run
    python benchmarks/resimulate_gpu_pipeline.py FOLDER           # a device session's --out

bench_gpu_pipeline's earliest runs priced every stage-to-stage transfer at a loopback
estimate (100 GB/s, 10 us) while the activations went through pinned host memory and gloo,
measured at the start of the same run (5-7 ms one way for [2048, 1, 4096] bf16). This reads a
run (a results file's newest, or --run's; or a folder's results.json) and the layer profiles
it planned on (inside the run, or cached in the folder), rebuilds each case's plans
(pipeline_plans.plans_for on the cost model the run planned on: they must come out as the rows
say) and simulates every measured row twice, with the old link and with one priced from the
run's own transfer measurement: the JSON's two-point fit where the run made one, else its one
size as bandwidth with no latency (a lower bound for smaller messages). The measured times are
the run's; nothing is timed here. Prints both errors per row and writes them as JSON (its
provenance first) to --out; for a folder, by default resimulated.json in it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from provenance import provenance, script_command  # noqa: E402
from results_layout import load_runs, unpack_profiles  # noqa: E402


def run_link(results: dict):
    """The link the run measured: its fit, else its one transfer as bandwidth alone."""
    from megatron_terapipe.planner.cost.dims import Link

    if "link" in results:
        return Link(bandwidth=results["link"]["bandwidth_bytes_per_s"],
                    latency=results["link"]["latency_s"]), "two-point fit"
    one_way = results["transfer_one_way_s"]
    shape, seconds = one_way["shape"], one_way["seconds"]
    fp32 = results["device"] != "cuda" or "--fp32" in results["provenance"]["command"]
    element = 4 if fp32 else 2
    nbytes = element * shape[0] * shape[1] * shape[2]
    return Link(bandwidth=nbytes / seconds, latency=0.0), f"{nbytes} bytes in {seconds * 1e3:.3f} ms"


def row_plan(row: dict, plans: dict):
    """The plan a row ran: the one it carries (measured auto's re-planned rows, and every
    TeraPipe row of later runs), else the one rebuilt under its label (None: Megatron's)."""
    from megatron_terapipe.plan import TeraPipePlan

    if row.get("plan") is not None:
        return TeraPipePlan.from_dict(row["plan"])
    return plans[row["config"].replace("+graphs", "")]


def case_rows(folder: str, results: dict, case_name: str, granularity: int, link) -> list[dict]:
    import bench_gpu_pipeline as bench
    from pipeline_plans import plans_for, predict, profile_cost_model

    case = next(c for suite in bench.SUITES.values() for c in suite if c.name == case_name)
    bf16 = results["device"] == "cuda"
    model = case.model(bf16)
    cache = case.profile_cache(folder, "cuda")
    if not os.path.exists(cache):
        raise SystemExit(f"{cache}: the run's cached layer profile is needed")
    dtype = "bfloat16" if bf16 else "float32"
    old = profile_cost_model(model, granularity, case.layers_per_stage, "cuda", cache, dtype)
    new = profile_cost_model(model, granularity, case.layers_per_stage, "cuda", cache, dtype, link=link)
    # the run planned on its own link where it measured one (since dccf566), else the old one
    planned_on = new if "link" in results else old
    plans, _ = plans_for(planned_on, model, case.num_microbatches, granularity, case.stages)
    _, info = plans_for(new, model, case.num_microbatches, granularity, case.stages)
    out = []
    for row in (r for r in results["rows"] if r["case"] == case_name):
        plan = row_plan(row, plans)
        if (None if plan is None else list(plan.seq_slices)) != row["slices"]:
            raise SystemExit(f"{case_name} {row['config']}: rebuilt {plan and plan.seq_slices}, "
                             f"the run had {row['slices']}")
        before = predict(old, plan, model, case.num_microbatches, float(case.stages), case.stages)
        after = predict(new, plan, model, case.num_microbatches, float(case.stages), case.stages)
        out.append({"case": case_name, "config": row["config"], "slices": row["slices"],
                    "measured_s": row["measured_s"], "predicted_s_run": row["predicted_s"],
                    "predicted_s_old_link": before, "predicted_s_measured_link": after,
                    "sim_error_old_link": before / row["measured_s"] - 1,
                    "sim_error_measured_link": after / row["measured_s"] - 1,
                    "dp_slices_with_measured_link": info["dp_slices"]})
    return out


def the_run(args) -> tuple[dict, str]:
    """The run to re-simulate and the folder that holds its layer profiles."""
    if os.path.isdir(args.input):
        with open(os.path.join(args.input, "results.json")) as f:
            return json.load(f), args.input
    run = load_runs(args.input)[args.run]
    folder = tempfile.mkdtemp(prefix="resimulate_")  # only this run's profiles
    unpack_profiles(run, folder)
    return run, folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", help="a results file (bench_gpu_pipeline's JSON) or a device "
                                 "session's --out folder (results.json and cached profiles)")
    p.add_argument("--run", type=int, default=-1, help="which of the file's runs (default: newest)")
    p.add_argument("--out", help="write the rows here (default: resimulated.json in a folder "
                                 "input; none for a file)")
    args = p.parse_args()
    results, folder = the_run(args)
    command = results["provenance"]["command"]
    granularity = int(command[command.index("--granularity") + 1]) if "--granularity" in command else 64
    link, how = run_link(results)
    print(f"link: {link.latency * 1e3:.3f} ms + {link.bandwidth / 1e9:.2f} GB/s ({how})")
    rows = []
    for name in dict.fromkeys(r["case"] for r in results["rows"]):
        rows += case_rows(folder, results, name, granularity, link)
    print(f"{'case':<16} {'schedule':<26} {'slices':<22} {'measured ms':>11} {'old sim':>8} "
          f"{'err':>7} {'new sim':>8} {'err':>7}")
    for r in rows:
        print(f"{r['case']:<16} {r['config']:<26} {str(r['slices']):<22} {r['measured_s'] * 1e3:>11.1f} "
              f"{r['predicted_s_old_link'] * 1e3:>8.1f} {r['sim_error_old_link']:>+7.1%} "
              f"{r['predicted_s_measured_link'] * 1e3:>8.1f} {r['sim_error_measured_link']:>+7.1%}")
    for key in ("sim_error_old_link", "sim_error_measured_link"):
        errors = [abs(r[key]) for r in rows]
        print(f"{key}: mean |error| {statistics.mean(errors):.1%}, worst {max(errors):.1%}")
    out = args.out or (os.path.join(args.input, "resimulated.json")
                       if os.path.isdir(args.input) else None)
    if out is None:
        return 0
    with open(out, "w") as f:
        json.dump({"provenance": provenance(script_command(__file__)), "input": results["provenance"],
                   "link": {"bandwidth_bytes_per_s": link.bandwidth, "latency_s": link.latency,
                            "from": how}, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
