"""Layers per stage and chunk from Megatron-LM's flags, equal to Megatron-Core's own count."""

import itertools
from types import SimpleNamespace

import pytest

from megatron_terapipe.megatron.support.stage_layers import chunk_layers, stage_layers


def _megatron_count(num_layers, pp, vp, stage, chunk, first, last, embedding, loss):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = SimpleNamespace(
        pipeline_model_parallel_layout=None, num_layers=num_layers,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    return get_num_layers_to_build(config, vp_stage=chunk if vp > 1 else None, pp_rank=stage)


def _splits():
    for num_layers, pp, vp in itertools.product((4, 6, 7, 8, 12), (2, 3, 4), (1, 2)):
        for first, last in ((None, None), (1, None), (None, 2), (2, 2), (3, 1)):
            for embedding, loss in itertools.product((False, True), repeat=2):
                yield num_layers, pp, vp, first, last, embedding, loss


def test_every_split_is_megatrons():
    compared = refused = 0
    for num_layers, pp, vp, first, last, embedding, loss in _splits():
        for stage, chunk in itertools.product(range(pp), range(vp)):
            try:
                expected = _megatron_count(num_layers, pp, vp, stage, chunk, first, last,
                                           embedding, loss)
            except AssertionError:  # Megatron cannot build it: neither may we
                with pytest.raises(ValueError):
                    chunk_layers(num_layers, pp, vp, stage, chunk, first=first, last=last,
                                 embedding=embedding, loss=loss)
                refused += 1
                continue
            assert chunk_layers(num_layers, pp, vp, stage, chunk, first=first, last=last,
                                embedding=embedding, loss=loss) == expected, \
                (num_layers, pp, vp, stage, chunk, first, last, embedding, loss)
            compared += 1
    assert compared > 300 and refused > 100, (compared, refused)


def _args(**flags):
    base = dict(num_layers=8, pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_layout=None,
                decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                account_for_embedding_in_pipeline_split=False,
                account_for_loss_in_pipeline_split=False)
    return SimpleNamespace(**{**base, **flags})


def test_stage_layers_from_the_flags():
    even = stage_layers(_args())
    assert even.chunks == ((4,), (4,)) and even.even and even.busiest == 4
    assert even.describe() == ""
    first = stage_layers(_args(decoder_first_pipeline_num_layers=2))
    assert first.per_stage == (2, 6) and first.busiest == 6 and not first.even
    assert first.describe() == "layers per stage 2 6 (--decoder-first-pipeline-num-layers 2)"
    both = stage_layers(_args(num_layers=6, account_for_embedding_in_pipeline_split=True,
                              account_for_loss_in_pipeline_split=True))
    assert both.per_stage == (3, 3) and both.chunks == ((3,), (3,))
    chunks = stage_layers(_args(num_layers=7, virtual_pipeline_model_parallel_size=2,
                                account_for_loss_in_pipeline_split=True))
    assert chunks.chunks == ((2, 2), (2, 1)) and not chunks.even
    assert stage_layers(_args(num_layers=None)) is None


def test_a_layout_is_read_with_megatrons_parser():
    layout = stage_layers(_args(num_layers=4, pipeline_model_parallel_layout="Et|ttt,L"))
    assert layout.chunks == ((1,), (3,)) and layout.busiest == 3
    assert layout.describe() == "layers per stage 1 3 (--pipeline-model-parallel-layout Et|ttt,L)"
    virtual = stage_layers(_args(num_layers=6, virtual_pipeline_model_parallel_size=2,
                                 pipeline_model_parallel_layout="Et|tt|tt|tL"))
    assert virtual.chunks == ((1, 2), (2, 1)) and virtual.per_stage == (3, 3)


# ---- what the glue makes of an uneven split ----------------------------------------------------
# A GPT of 8 layers on 2 stages, its first stage given 2 (Megatron-LM's flag), on an A100's model.
UNEVEN = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048,
              micro_batch_size=1, global_batch_size=8, vocab_size=50304, bf16=True,
              decoder_first_pipeline_num_layers=2)
HARDWARE = ["--terapipe-hardware", "a100"]


def test_the_planner_prices_every_stage_as_the_busiest():
    from megatron_terapipe.megatron.args.inputs_from_flags import planner_inputs
    from megatron_terapipe.megatron.args.settings import RunSettings
    from harness.inputs.flags import parse

    uneven = planner_inputs(RunSettings.from_args(parse(
        ["--pipeline-schedule", "terapipe", *HARDWARE], **UNEVEN)))
    assert uneven.layers_per_stage == 6 and uneven.cost_model.layers_per_stage == 6
    assert "6 layers/stage" in uneven.cost_model.describe()
    assert any("layers per stage 2 6 (--decoder-first-pipeline-num-layers 2): every stage "
               "priced as the busiest, 6 layers" in note for note in uneven.notes), uneven.notes
    even = planner_inputs(RunSettings.from_args(parse(
        ["--pipeline-schedule", "terapipe", *HARDWARE],
        **{**UNEVEN, "decoder_first_pipeline_num_layers": None})))
    assert even.layers_per_stage == 4 and not any("busiest" in n for n in even.notes)
    # the busiest stage's 6 layers hold more than 4: the model state and the time grow with them
    assert uneven.budget.model_state[1] > even.budget.model_state[1]
    assert uneven.search().chosen.time > even.search().chosen.time


def test_auto_leaves_out_model_chunks_on_an_uneven_split():
    from megatron_terapipe.megatron.args.auto_schedule import schedule_table
    from megatron_terapipe.megatron.args.settings import RunSettings
    from harness.inputs.flags import parse

    def chunk_counts(**flags):
        table, _ = schedule_table(RunSettings.from_args(parse(
            ["--pipeline-schedule", "auto", *HARDWARE], **{**UNEVEN, **flags})))
        return {option.num_chunks for option in table.options}

    assert chunk_counts(decoder_first_pipeline_num_layers=None) > {1}  # even: chunked rows
    assert chunk_counts() == {1}


def test_virtual_stages_on_an_uneven_split_are_refused_naming_the_flags():
    from megatron_terapipe.megatron.args.checks import (TeraPipeArgumentError,
                                                        validate_terapipe_args)
    from harness.inputs.flags import parse

    args = parse(["--pipeline-schedule", "terapipe", *HARDWARE], **{
        **UNEVEN, "num_layers": 10, "decoder_first_pipeline_num_layers": 2,
        "num_virtual_stages_per_pipeline_rank": 2, "virtual_pipeline_model_parallel_size": 2})
    with pytest.raises(TeraPipeArgumentError) as info:
        validate_terapipe_args(args)
    message = str(info.value)
    assert "layers per stage 1+1 4+4 (--decoder-first-pipeline-num-layers 2)" in message
    assert "--pipeline-schedule 1f1b" in message


def test_a_v_splits_an_odd_stage_as_its_model_is_built(monkeypatch):
    """In a V, a stage of 3 layers holds chunks of 2 (down) and 1 (back): the flags' split and
    the count the V's build answers Megatron (v_layout's get_num_layers_to_build) agree; the
    ring refuses the same flags, and an even stage keeps Megatron's own count."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_terapipe.megatron.model import v_layout

    odd = dict(num_layers=6, virtual_pipeline_model_parallel_size=2)
    split = stage_layers(_args(**odd, terapipe_virtual_placement="v"))
    assert split.chunks == ((2, 1), (2, 1)) and not split.even and split.describe() == ""
    assert split.v_chunk_layers == (2, 1) and stage_layers(_args()).v_chunk_layers == ()
    with pytest.raises(ValueError, match="a stage's 3 layers do not divide into 2 model chunks"):
        stage_layers(_args(**odd))
    counted = v_layout._layers_in_v(get_num_layers_to_build)
    monkeypatch.setattr(v_layout, "_V_ON", True)
    for layers, expected in ((6, (2, 1)), (8, (2, 2))):
        config = _megatron_config(layers)
        assert tuple(counted(config, vp_stage=c, pp_rank=1) for c in (0, 1)) == expected
        assert tuple(stage_layers(_args(num_layers=layers, virtual_pipeline_model_parallel_size=2,
                                        terapipe_virtual_placement="v")).chunks[1]) == expected
    monkeypatch.setattr(v_layout, "_V_ON", False)
    with pytest.raises(AssertionError):  # Megatron's own count, off the V
        counted(_megatron_config(6), vp_stage=0, pp_rank=1)


def _megatron_config(num_layers):
    return SimpleNamespace(
        pipeline_model_parallel_layout=None, num_layers=num_layers,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
