"""Pictures of a simulated schedule: Chrome-trace JSON (Perfetto, chrome://tracing) and PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from ...schedule.files import action_events, chrome_trace_of, write_trace
from ..evaluate.simulator import SimulationResult

PathLike = Union[str, Path]


def short_plan_text(plan, limit: int = 110) -> str:
    """plan.describe(), or a summary of it when that is too long for a title."""
    text = plan.describe()
    if len(text) <= limit:
        return text
    counts = sorted({len(ts) for ts in plan.token_slices})
    slices = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    rows = plan.batch_slices or ("all",)
    shown = ", ".join(str(r) for r in rows[:8]) + (", ..." if len(rows) > 8 else "")
    edges = "".join(f"; {w} {n} microbatches in {len(ts)}" for w, (n, ts)
                    in zip(("first", "last"), plan.edge_slices) if n)
    return (f"order={plan.order}{plan.chunks_text()}; {len(rows)} batch slice(s) of [{shown}] "
            f"rows; {slices} token slices each{edges}{'; W placed' if plan.wgrad_after else ''}")


def chrome_trace(result: SimulationResult) -> dict:
    """Trace events: one process per stage, one complete event ('X') per action, memory counters
    (schedule/files.py, the writer of measured traces too). Times are microseconds."""
    counters = [{"name": "memory (MiB)", "ph": "C", "pid": k, "tid": 0, "ts": p.time * 1e6,
                 "args": {"activations": p.activation_bytes / 2 ** 20, "kv": p.kv_bytes / 2 ** 20}}
                for k, points in enumerate(result.memory) for p in points]
    plan = result.schedule.plan
    return chrome_trace_of(
        action_events(result.timeline) + counters,
        other_data={"plan": plan.describe(), "num_microbatches": result.schedule.num_microbatches,
                    "iteration_time_s": result.iteration_time,
                    "bubble_fraction": result.bubble_fraction})


def write_chrome_trace(result: SimulationResult, path: PathLike) -> Path:
    return write_trace(chrome_trace(result), path)


def write_png(result: SimulationResult, path: PathLike, title: str = "", dpi: int = 110) -> Path:
    """Timeline picture: one row per stage, one box per action, coloured by microbatch;
    backward boxes are hatched and lighter. Needs matplotlib (`pip install matplotlib`)."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the PNG timeline needs matplotlib: pip install 'megatron-terapipe[plot]'"
                          ) from exc
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    K = result.num_stages
    M = result.schedule.num_microbatches
    cmap = plt.get_cmap("tab10" if M <= 10 else "tab20")
    colours = [cmap(m % cmap.N) for m in range(M)]
    height = max(2.0, 0.35 * K + 1.4)
    fig, ax = plt.subplots(figsize=(12, height))
    scale = 1e3  # milliseconds on the axis
    # one collection per (stage, microbatch, direction): fast even for many thousand boxes
    boxes: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
    for ta in result.timeline:
        key = (ta.stage, ta.action.cell.microbatch, ta.action.kind)
        boxes.setdefault(key, []).append((ta.start * scale, (ta.end - ta.start) * scale))
    style = {"F": (1.0, None), "B": (0.55, "//"), "W": (0.3, "..")}  # alpha, hatch
    for (stage, mb, kind), ranges in boxes.items():
        alpha, hatch = style[kind]
        ax.broken_barh(ranges, (stage - 0.4, 0.8), facecolors=colours[mb], alpha=alpha,
                       hatch=hatch, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(K))
    ax.set_yticklabels([f"stage {k}" for k in range(K)])
    ax.set_ylim(K - 0.5, -0.5)  # stage 0 on top
    ax.set_xlabel("time (ms)")
    shown = min(M, 10)
    handles = [Patch(facecolor=colours[m], label=f"microbatch {m}") for m in range(shown)]
    if M > shown:
        handles.append(Patch(facecolor="white", label=f"... {M - shown} more"))
    handles += [Patch(facecolor="grey", edgecolor="black", label="forward"),
                Patch(facecolor="grey", alpha=0.55, hatch="//", edgecolor="black", label="backward")]
    if any(ta.action.kind == "W" for ta in result.timeline):
        handles.append(Patch(facecolor="grey", alpha=0.3, hatch="..", edgecolor="black",
                             label="weight gradients (W)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    heading = title or short_plan_text(result.schedule.plan)
    ax.set_title(f"{heading}\niteration {result.iteration_time * 1e3:.2f} ms, "
                 f"bubble {100 * result.bubble_fraction:.1f}%", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
