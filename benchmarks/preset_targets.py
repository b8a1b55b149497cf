"""What the hardware presets are fitted on and judged by: published runs and this project's own
GPU measurements, each as a `Target` whose prediction comes from the planner's own cost model
and simulator under a given `Hardware`.

- The TeraPipe paper (V100, calibration/published_rows.json): per row, the iteration "without"
  token slicing (GPipe over microbatches only: the best number of microbatches) and "with" it
  (GPipe order with the slices its DP chose: here the best uniform slicing while fitting, the
  planner's own DP plan when judged); the 175B uniform-slice ablation, one target per count.
  The paper's runs are one order (GPipe), so both sides are predicted in it.
- Megatron-LM's published H100 table: per row, the per-GPU model TFLOP/s of Megatron's
  interleaved 1F1B at the chunk count that simulates fastest (1 chunk: plain 1F1B).
- This project's H100 stage (benchmarks/results/gpu/h100/stage_graphs.json): the GPU busy time
  of one graphed stage with 1, 8 and 16 uniform token slices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner.cost.analytic import AnalyticCostModel
from megatron_terapipe.planner.cost.dims import Hardware, ModelDims
from megatron_terapipe.planner.cost.presets import model_preset
from megatron_terapipe.planner.evaluate.simulator import plan_time, schedule_time
from megatron_terapipe.planner.schedule_choice import interleaved_chunk_counts
from megatron_terapipe.planner.search import solve, stages_cross_nodes
from megatron_terapipe.schedule import build_interleaved_schedule

HERE = Path(__file__).resolve().parent
PUBLISHED = HERE / "calibration" / "published_rows.json"
H100_STAGE = HERE / "results" / "gpu" / "h100" / "stage_graphs.json"
FIT_SLICES = (2, 4, 8, 16, 32, 64)  # uniform slice counts tried for "with" while fitting


@dataclass(frozen=True)
class Target:
    """One measured number and how the preset predicts it."""

    name: str
    measured: float
    predict: Callable[[Hardware], float]
    unit: str  # "s" (iteration or busy time) or "TFLOP/s"
    judge: Optional[Callable[[Hardware], tuple[float, str]]] = None  # the final prediction


@dataclass(frozen=True)
class PaperRow:
    model: ModelDims
    stages: int
    tensor_parallel: int
    data_parallel: int
    sequences: int  # per pipeline per iteration
    seq_length: int = 2048

    @classmethod
    def from_dict(cls, row: dict) -> "PaperRow":
        return cls(model_preset(row["model"]), row["pipe"], row["op"], row["data"],
                   row["batch"] // row["data"])

    def cost(self, hardware: Hardware) -> AnalyticCostModel:
        cross = stages_cross_nodes(self.tensor_parallel * self.data_parallel, self.stages,
                                   hardware.gpus_per_node)
        return AnalyticCostModel(self.model, hardware, self.model.num_layers // self.stages,
                                 self.tensor_parallel, inter_node=cross)

    def time(self, hardware: Hardware, token_slices: int, batch_slices: int) -> float:
        """GPipe with uniform token slices and `batch_slices` microbatches, plus the part of the
        data-parallel reduction that is not overlapped."""
        cost = self.cost(hardware)
        rows = self.sequences // batch_slices
        plan = TeraPipePlan([self.seq_length // token_slices] * token_slices,
                            batch_slices=[rows] * batch_slices, order="gpipe", defer_wgrad=False)
        return (plan_time(plan, cost, 1, self.stages, self.sequences)
                + cost.data_parallel_time(self.data_parallel))

    def batch_splits(self) -> list[int]:
        return [k for k in (1, 2, 4, 8, 16, 32) if k <= self.sequences and self.sequences % k == 0]

    def uniform(self, hardware: Hardware, token_slices: int) -> float:
        """`token_slices` uniform slices, with the best batch slicing (as the paper's DP)."""
        return min(self.time(hardware, token_slices, k) for k in self.batch_splits())

    def without(self, hardware: Hardware) -> float:
        return self.uniform(hardware, 1)

    def with_uniform(self, hardware: Hardware) -> float:
        return min(self.time(hardware, m, k) for m in FIT_SLICES for k in self.batch_splits()[:3])

    def with_planner(self, hardware: Hardware) -> tuple[float, str]:
        """The planner's own DP plan in GPipe order (the paper's setting) and its time."""
        cost = self.cost(hardware)
        plan = solve(cost, self.seq_length, self.sequences, self.stages, granularity=16,
                     order="gpipe", defer_wgrad=False)
        seconds = (plan_time(plan, cost, 1, self.stages, self.sequences)
                   + cost.data_parallel_time(self.data_parallel))
        slices = max(len(s) for s in plan.token_slices)
        return seconds, f"{slices} token slices, {len(plan.rows(self.sequences))} batch slices"


def paper_targets(published: dict) -> list[Target]:
    paper = published["terapipe_paper"]
    out = []
    for row in paper["rows"]:
        r = PaperRow.from_dict(row)
        label = f"{row['model']} pipe {row['pipe']} op {row['op']} data {row['data']}"
        out.append(Target(f"{label}, without slicing", row["without"], r.without, "s"))
        out.append(Target(f"{label}, with slicing", row["with"], r.with_uniform, "s",
                          judge=r.with_planner))
    for key, times in paper["uniform_slices_ablation"].items():
        row = next(x for x in paper["rows"] if x["model"] == "gpt3-175b" and x["pipe"] == 96)
        r = PaperRow.from_dict(row)
        for count, seconds in times.items():
            if count != "dp":
                out.append(Target(f"{key}, {count} uniform slices", seconds,
                                  lambda hw, m=int(count): r.uniform(hw, m), "s"))
    return out


def gpt_model(row: dict, vocab: int) -> ModelDims:
    return ModelDims(num_layers=row["layers"], hidden_size=row["hidden"],
                     num_attention_heads=row["heads"], name=row["params"], vocab_size=vocab)


def megatron_flops(row: dict, seq: int, vocab: int) -> float:
    """Model FLOPs per iteration of a plain GPT: 72 B s l h^2 (1 + s / 6h + V / 12 l h)."""
    B, l, h = row["global_batch"], row["layers"], row["hidden"]
    return 72.0 * B * seq * l * h * h * (1 + seq / (6 * h) + vocab / (12 * l * h))


def megatron_tflops(row: dict, hardware: Hardware, seq: int = 4096,
                    vocab: int = 131072) -> float:
    """Per-GPU model TFLOP/s of Megatron's fastest interleaved schedule (or plain 1F1B)."""
    model = gpt_model(row, vocab)
    K, tp, M = row["pp"], row["tp"], row["global_batch"] // row["dp"]
    layers = row["layers"] // K
    cost = AnalyticCostModel(model, hardware, layers, tp,
                             inter_node=stages_cross_nodes(tp * row["dp"], K,
                                                           hardware.gpus_per_node))
    best = float("inf")
    for chunks in [1, *interleaved_chunk_counts(layers)]:
        try:
            schedule = build_interleaved_schedule(seq, M, K, chunks, 1)
        except ValueError:  # Megatron's own conditions on microbatches and chunks
            continue
        best = min(best, schedule_time(schedule, cost))
    seconds = best + cost.data_parallel_time(row["dp"])
    return megatron_flops(row, seq, vocab) / (seconds * row["gpus"]) / 1e12


def megatron_targets(published: dict) -> list[Target]:
    return [Target(f"Megatron-LM {row['params']} (TP {row['tp']}, PP {row['pp']}, DP "
                   f"{row['dp']})", row["per_gpu_tflops"],
                   lambda hw, row=row: megatron_tflops(row, hw), "TFLOP/s")
            for row in published["megatron_lm_h100"]["rows"]]


def stage_busy(hardware: Hardware, args: dict, slices: int) -> float:
    """One stage holding the whole model (embedding and loss too): its cells' forward and
    backward seconds, summed."""
    model = ModelDims(num_layers=args["num_layers"], hidden_size=args["hidden_size"],
                      num_attention_heads=args["num_attention_heads"],
                      vocab_size=args["vocab_size"])
    cost = AnalyticCostModel(model, hardware, args["num_layers"])
    b, length = args["micro_batch_size"], args["seq_length"] // slices
    total = 0.0
    for i in range(slices):
        c = i * length
        total += (cost.forward_time(b, length, c) + cost.backward_time(b, length, c)
                  + cost.edge_forward_time(b, length, True, True)
                  + cost.edge_backward_time(b, length, True, True))
    return float(total)


def stage_targets(path: Path = H100_STAGE) -> list[Target]:
    data = json.loads(path.read_text())
    args = data["args"]
    return [Target(f"H100 stage (hidden {args['hidden_size']}, {args['num_layers']} layers), "
                   f"{row['slices']} slices graphed, GPU busy", row["gpu_busy_ms"] / 1e3,
                   lambda hw, n=row["slices"]: stage_busy(hw, args, n), "s")
            for row in data["rows"] if row["graphed"]]


def published() -> dict:
    return json.loads(PUBLISHED.read_text())
