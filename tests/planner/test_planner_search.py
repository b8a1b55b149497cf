"""The one plan search: solve, terapipe-plan and the flags choose through it, with one rule for
the weight-gradient mode and one for the link between stages."""

from __future__ import annotations

import json
import types

import pytest

from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner import AnalyticCostModel, hardware_preset, model_preset, solve
from megatron_terapipe.planner.cli.command import main
from megatron_terapipe.planner.search import (DEFER_MIN_GAIN, SearchSpace, choose_deferral,
                                              deferral_pays, pipeline_link, search,
                                              stages_cross_nodes)


def gpt1b(layers=3, inter_node=False):
    return AnalyticCostModel(model_preset("gpt3-1b"), hardware_preset("v100"), layers,
                             inter_node=inter_node)


@pytest.mark.parametrize("K,M,B,order,defer", [(4, 1, 2, "1f1b", None), (8, 2, 1, "gpipe", None),
                                               (4, 3, 2, "1f1b", True), (2, 1, 4, "1f1b", False)])
def test_solve_is_the_searchs_plan(K, M, B, order, defer):
    cost = gpt1b()
    plan = solve(cost, 2048, B, K, granularity=64, num_microbatches=M, order=order,
                 defer_wgrad=defer)
    result = search(cost, SearchSpace(2048, B, K, M, order, granularity=64, defer_wgrad=defer))
    assert plan == result.plan
    assert plan.predicted_time == pytest.approx(result.chosen.time)
    if defer is not None:
        assert all(c.plan.defer_wgrad == defer for c in result.starts)


def test_rows_list_refinements_first_and_the_plain_baseline_last():
    cost = gpt1b()
    result = search(cost, SearchSpace(2048, 8, 8, 1, "gpipe", granularity=8))
    rows = result.rows
    assert rows[-1] is result.baseline
    assert result.baseline.plan == TeraPipePlan([2048], order="gpipe", defer_wgrad=False)  # Megatron's
    assert [r.name for r in rows[len(result.steps):len(result.steps) + 2]] == [
        "TeraPipe DP", f"uniform x{len(result.starts[1].plan.seq_slices)}"]
    assert list(rows[:len(result.steps)]) == list(reversed(result.steps))
    assert result.chosen is (result.steps[-1] if result.steps else result.best_start)
    # every start in the one weight-gradient mode the rule chose
    assert len({c.plan.defer_wgrad for c in result.starts}) == 1


def test_the_cli_prints_the_searchs_plan(tmp_path, capsys):
    saved = tmp_path / "plan.json"
    assert main(["--model", "gpt3-1b", "--hardware", "v100", "--pipeline-stages", "8",
                 "--seq-length", "1024", "--micro-batch-size", "8", "--order", "gpipe",
                 "--virtual-stages", "1", "--wgrad-placement", "off",  # search() alone
                 "--save-plan", str(saved)]) == 0
    out = capsys.readouterr().out
    result = search(gpt1b(), SearchSpace(1024, 8, 8, 1, "gpipe", granularity=8))
    assert f"TeraPipe gpipe on one model chunk ({result.chosen.label};" in out
    # the saved plan is auto's choice: with one chunk and one microbatch, the orders run the
    # same actions, and the table's first TeraPipe row is the search's plan in its order
    saved_plan = TeraPipePlan.from_dict(json.loads(saved.read_text()))
    assert saved_plan.token_slices == result.plan.token_slices
    assert saved_plan.virtual_stages == 1
    for row in result.rows:
        assert any(line.startswith(row.label) for line in out.splitlines()), row.label


# simulated seconds by (token slices, deferred weight gradients), for TableSpace
TIMES = {((16, 16), False): 100.0, ((16, 16), True): 98.5,
         ((8, 8, 8, 8), False): 99.2, ((8, 8, 8, 8), True): 99.0}


class TableSpace(SearchSpace):
    """A search space whose "simulator" reads TIMES."""

    def simulate(self, plan, cost_model):
        return types.SimpleNamespace(iteration_time=TIMES[(plan.seq_slices, plan.defer_wgrad)])


def test_deferral_is_chosen_against_the_fastest_plain_plan():
    """Deferred plans win only when DEFER_MIN_GAIN faster than the fastest plain plan, even if
    one of them is that much faster than its own plain version."""
    assert deferral_pays(100.0, 100.0 * (1 - DEFER_MIN_GAIN) - 1e-9)
    assert not deferral_pays(100.0, 100.0 * (1 - DEFER_MIN_GAIN))
    space = TableSpace(32, 1, 1, granularity=8, defer_wgrad=None)  # auto: the rule below
    halves, quarters = TeraPipePlan([16, 16]), TeraPipePlan([8, 8, 8, 8])
    alone = choose_deferral(None, space, [("halves", halves)])
    assert [c.plan.defer_wgrad for c in alone] == [True]  # 98.5 is 1.5% under its own 100
    both = choose_deferral(None, space, [("halves", halves), ("quarters", quarters)])
    assert [c.plan.defer_wgrad for c in both] == [False, False]  # 98.5 vs 99.2: under 1%
    assert min(both, key=lambda c: c.time).name == "quarters"
    fixed = choose_deferral(None, TableSpace(32, 1, 1, defer_wgrad=True), [("halves", halves)])
    assert fixed[0].plan.defer_wgrad and fixed[0].time == 98.5
    # the default space defers whatever the simulator says
    default = choose_deferral(None, TableSpace(32, 1, 1), [("halves", halves), ("quarters", quarters)])
    assert [c.plan.defer_wgrad for c in default] == [True, True]


@pytest.mark.parametrize("ranks_per_stage,stages,per_node,crosses", [
    (1, 8, 8, False),   # one node
    (8, 48, 8, True),   # TP=8: every boundary crosses
    (1, 16, 8, True),   # two nodes, one boundary crosses: the slow link paces the pipeline
    (2, 4, 8, False),
    (4, 4, 8, True),
])
def test_stages_cross_nodes(ranks_per_stage, stages, per_node, crosses):
    assert stages_cross_nodes(ranks_per_stage, stages, per_node) == crosses
    v100 = hardware_preset("v100")
    assert pipeline_link(v100, crosses) == (v100.inter_node if crosses else v100.intra_node)


def test_cli_and_flags_price_the_links_alike(monkeypatch):
    """TP=1 on 16 stages, 8 GPUs a node: the CLI and the flags both use the inter-node link."""
    import argparse

    from megatron_terapipe.megatron.args.inputs_from_flags import planner_inputs
    from megatron_terapipe.megatron.args.settings import RunSettings
    from megatron_terapipe.planner.cli.command import build_parser
    from megatron_terapipe.planner.cli.arguments import inputs_from_options

    parser = build_parser()
    cli_args = parser.parse_args(["--model", "gpt3-13b", "--pipeline-stages", "20",
                                  "--seq-length", "2048", "--hardware", "v100"])
    cli_cost = inputs_from_options(cli_args, parser).cost_model
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    flags = argparse.Namespace(num_layers=40, hidden_size=5120, num_attention_heads=40,
                               pipeline_model_parallel_size=20, tensor_model_parallel_size=1,
                               world_size=20, terapipe_hardware="v100")
    flags_cost = planner_inputs(RunSettings.from_args(flags).for_batch(2048, 1)).cost_model
    assert cli_cost.inter_node and flags_cost.inter_node
    assert cli_cost.link == flags_cost.link == hardware_preset("v100").inter_node
