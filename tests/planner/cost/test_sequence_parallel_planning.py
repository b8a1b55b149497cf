"""The planner under Megatron's --sequence-parallel: activations split over the TP ranks as
Korthikanti et al. 2022 (section 4.2.2) count them and as a CPU run measures them, P2P messages
of seq_length / TP tokens per rank, slices in multiples of the TP size, and terapipe-plan's flag.
(Every gradient of TeraPipe under sequence parallelism equal to Megatron's own run:
test_equivalence.py and test_virtual_runs.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import TinyGPT, spawn
from harness.inputs.cost_models import GPT13, H100, gpt3_13b_h100
from megatron_terapipe.plan import TeraPipePlan
from megatron_terapipe.planner.cli.command import main
from megatron_terapipe.planner.cost.dims import LayerMemory, ModelDims


@pytest.mark.parametrize("tp", [2, 8])
def test_a_layer_keeps_34_sbh_over_t(tp):
    """Korthikanti's sbh (34 / t) per layer under sequence parallelism with flash attention
    (no score matrix; its fp32 log-sum-exp per head and query row added), where ffn = 4 h
    and 16-bit activations: K and V are kept apart (kv_bytes), the rest in activation_bytes."""
    s, b, h = 4096, 2, GPT13.hidden_size
    memory = LayerMemory(GPT13, tp, 2, True, sequence_parallel=True)
    kept = float(memory.activation_bytes(b, s, 0)) + float(memory.kv_bytes(b, s))
    lse = b * s * GPT13.num_attention_heads * 4.0 / tp
    assert kept == pytest.approx(s * b * h * 34 / tp + lse, rel=1e-12)
    without = LayerMemory(GPT13, tp, 2, True)  # Korthikanti's sbh (10 + 24 / t)
    assert (float(without.activation_bytes(b, s, 0)) + float(without.kv_bytes(b, s))
            == pytest.approx(s * b * h * (10 + 24 / tp) + lse, rel=1e-12))


def test_messages_and_held_bytes_split_and_tp1_changes_nothing():
    b, l = np.array([1.0, 2.0]), np.array([1024.0, 8192.0])
    plain, split = gpt3_13b_h100(8, False), gpt3_13b_h100(8, True)
    link = H100.inter_node
    assert np.allclose(split.transfer_time(b, l) - link.latency,
                       (plain.transfer_time(b, l) - link.latency) / 8, rtol=1e-12)
    assert np.all(split.activation_bytes(b, l, 0) < plain.activation_bytes(b, l, 0) / 2.5)
    assert np.all(split.wgrad_hold_bytes(b, l) < plain.wgrad_hold_bytes(b, l))
    # an all-gather and a reduce-scatter take what the all-reduce they replace took
    assert np.allclose(split.forward_time(b, l, 0), plain.forward_time(b, l, 0), rtol=1e-12)
    one, one_sp = gpt3_13b_h100(1, False), gpt3_13b_h100(1, True)  # Megatron turns it off at TP 1
    assert not one_sp.sequence_parallel and one_sp.describe() == one.describe()
    assert np.array_equal(one_sp.activation_bytes(b, l, 0), one.activation_bytes(b, l, 0))
    assert np.array_equal(one_sp.transfer_time(b, l), one.transfer_time(b, l))
    assert "sequence parallel" in split.describe() and "sequence parallel" not in plain.describe()


def test_the_split_is_what_a_run_keeps():
    """Measured on CPU (TP 2 on gloo, Megatron's no-pipelining forward and backward, autograd's
    saved tensors): what sequence parallelism takes off one layer's saved bytes equals the
    model's replicated terms times (1 - 1/t). The runs have no dropout, so the two 1-byte masks
    the model counts for Megatron's default dropout are left out of the comparison."""
    model = TinyGPT(num_layers=1, hidden_size=128, num_attention_heads=4, vocab_size=128,
                    seq_length=256)
    measured = spawn(2, "harness.measured.sp_memory:saved_bytes_per_layer", model, 2, timeout=600)[0]
    dims = ModelDims(num_layers=1, hidden_size=128, num_attention_heads=4)
    predicted = [float(LayerMemory(dims, 2, 4, True, sp).activation_bytes(1, 256, 0))
                 for sp in (False, True)]
    masks = 2 * 128 * 256 * (1 - 1 / 2)
    saved = measured["replicated"] - measured["sequence_parallel"]
    assert saved == pytest.approx(predicted[0] - predicted[1] - masks, rel=0.02)
    assert saved > 0.15 * measured["replicated"]  # a real part of the layer, not noise


BASE = ["--model", "gpt3-13b", "--hardware", "h100", "--pipeline-stages", "8",
        "--tensor-parallel-size", "8", "--micro-batch-size", "1", "--virtual-stages", "1",
        "--wgrad-placement", "off"]


def test_terapipe_plan_cuts_slices_in_multiples_of_tp_and_names_the_flag(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(BASE + ["--seq-length", "2048", "--granularity", "4", "--num-microbatches", "1",
                        "--sequence-parallel", "--save-plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "TP=8, sequence parallel" in out
    plan = TeraPipePlan.from_dict(json.loads(path.read_text()))
    assert len(plan.seq_slices) > 1 and all(s % 8 == 0 for s in plan.seq_slices)
    with pytest.raises(SystemExit):
        main(BASE + ["--seq-length", "2052", "--granularity", "4", "--sequence-parallel"])
    err = capsys.readouterr().err
    assert "--seq-length 2052" in err and "--tensor-parallel-size 8" in err
    assert main(BASE + ["--seq-length", "2052", "--granularity", "4"]) == 0  # no SP: fine


def test_megatron_1f1b_predicted_peak_drops(capsys):
    """The schedule table's Megatron 1F1B row: the same run with sequence parallelism keeps
    much less on its first stage, as the activations' replicated share says."""
    def first_stage_peak(extra: list[str]) -> float:
        assert main(BASE + ["--seq-length", "8192", "--num-microbatches", "8", *extra]) == 0
        row = [line for line in capsys.readouterr().out.splitlines()
               if line.strip().startswith("Megatron 1F1B")][0]
        return float(row.split("%")[1].split()[0])

    plain, split = first_stage_peak([]), first_stage_peak(["--sequence-parallel"])
    assert split < 0.5 * plain


def test_the_last_stage_keeps_its_rows_of_the_output_layer_input():
    """The final norm's and the output layer's 16-bit inputs are this rank's rows under
    sequence parallelism; the loss's float32 softmax is split by the vocabulary either way."""
    from megatron_terapipe.planner.cost.stage_memory import CostModelMemory

    def output_bytes(sp: bool) -> float:
        memory = CostModelMemory(gpt3_13b_h100(8, sp))
        return memory.cell_bytes(1, 4096, 0, False, True) - memory.cell_bytes(1, 4096, 0, False, False)

    h, V = GPT13.hidden_size, GPT13.vocab_size
    assert output_bytes(False) == pytest.approx(4096 * (2 * h * 2 + 4 * V / 8), rel=1e-12)
    assert output_bytes(True) == pytest.approx(4096 * (2 * h * 2 / 8 + 4 * V / 8), rel=1e-12)
