"""The schedule table's V rows (terapipe-plan): TeraPipe on 2 chunks per stage in a V beside
the ring's chunk counts, where a stage's layers split in 2, with the plan, its memory per
stage and the Megatron-LM flags that run it; on a stage of odd layers, in unequal chunks."""

from __future__ import annotations

from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset
from megatron_terapipe.planner.cli.command import build_parser, megatron_flags
from megatron_terapipe.planner.cost.stage_memory import MemoryBudget
from megatron_terapipe.planner.schedule_choice import AutoChoice, compare_schedules
from megatron_terapipe.planner.search import SearchSpace

MODEL = model_preset("gpt3-1b")  # 24 layers


def table(stages: int, v_rows: bool = True, virtual_stages: tuple = (1, 2)):
    layers = MODEL.num_layers // stages
    cost = AnalyticCostModel(MODEL, hardware_preset("a100"), layers_per_stage=layers)
    space = SearchSpace(1024, 1, stages, 4, granularity=64, virtual_stages=virtual_stages)
    return compare_schedules(cost, space, MemoryBudget(None), layers, v_rows=v_rows)


def test_v_rows_sit_beside_the_rings_where_a_stage_splits_in_two():
    options = {o.name: o for o in table(4).options}  # 6 layers per stage
    for order in ("1f1b", "gpipe"):
        v = options[f"TeraPipe {order}, 2 chunks in a V"]
        assert v.placement == "v" and v.num_chunks == 2 and v.runnable
        assert v.plan.virtual_placement == "v" and v.plan.virtual_stages == 2
        assert len(v.totals) == 4 and "in a V" in v.note
        assert options[f"TeraPipe {order}, 2 chunks"].placement == "ring"
    assert not any("in a V" in o.name for o in table(4, v_rows=False).options)


def test_a_stage_of_odd_layers_gets_v_rows_on_unequal_chunks():
    """3 layers per stage: the ring cannot split them in 2, a V can (2 down, 1 back)."""
    options = {o.name: o for o in table(8).options}
    assert not any(o.num_chunks == 2 and o.placement == "ring" for o in options.values())
    for order in ("1f1b", "gpipe"):
        v = options[f"TeraPipe {order}, 2 chunks in a V"]
        assert v.runnable and v.plan.chunk_layers == (2, 1), v.plan
    # the ring's only chunk count (3) opens the V too; no chunks at all (--virtual-stages 1)
    # opens none
    assert sum("in a V" in o.name for o in table(8, virtual_stages=(3,)).options) == 2
    assert not any("in a V" in o.name for o in table(8, virtual_stages=()).options)


def test_the_flags_that_run_a_v():
    v = next(o for o in table(4).options if o.placement == "v")
    args = build_parser().parse_args(["--model", "gpt3-1b", "--pipeline-stages", "4",
                                      "--seq-length", "1024", "--hardware", "a100"])
    flags = megatron_flags(args, AutoChoice(v, None, None, ""))
    assert ("--pipeline-schedule terapipe --num-virtual-stages-per-pipeline-rank 2 "
            "--terapipe-virtual-placement v --untie-embeddings-and-output-weights") in flags
