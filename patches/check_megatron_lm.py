"""Check the Megatron-LM drop-in against a real Megatron-LM checkout, on CPU (maintainers).

    git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /path/to/Megatron-LM
    torchrun --nproc-per-node 2 patches/check_megatron_lm.py --megatron-lm /path/to/Megatron-LM \
        --tp 1 --pp 2
    python patches/check_megatron_lm.py --args-only [--megatron-lm /path/to/Megatron-LM]

Use the checkout of the release matching the installed megatron-core: core_v0.16.1 for 0.16.x,
core_v0.17.1 for 0.17.x, core_v0.18.2 for 0.18.x, core_v0.19.0 for 0.19.x. Without --megatron-lm,
the megatron.training that megatron-core 0.17's to 0.19's wheels ship is used (0.16's wheel has
none; there is no pretrain_gpt.py either, so only --args-only runs). --args-only stops after
step 2 and needs no torchrun (tests/glue/test_compat_megatron_lm.py runs it).

What it runs, with Megatron-LM's own code wherever the drop-in touches it:
1. `megatron_terapipe.megatron.launch.install_hooks()`, then Megatron-LM's `megatron.training.training` is
   imported: its module-level `get_forward_backward_func` must be the patched one.
2. Megatron-LM's `parse_args` (called as the release calls it: through `initialize_megatron`'s
   names on 0.16 and 0.17, through `parse_and_validate_args` on 0.18 and 0.19, with
   pretrain_gpt.py's own extra_args_provider) accepts --pipeline-schedule terapipe
   --terapipe-slices ... (argparse would refuse a flag of ours that collides with one of
   Megatron-LM's); Megatron-LM's `validate_args` then runs our validation and selects TeraPipe.
3. The GPT model comes from pretrain_gpt.py's model_provider + gpt_builder with Megatron's stock
   local layer spec: the hook must give it slice-aware attention.
4. Batches come from pretrain_gpt.py's train_valid_test_datasets_provider (MockGPTDataset, with
   the dataloader's attention mask); pretrain_gpt.py's forward_step / get_batch
   (get_batch_on_this_tp_rank) / loss_func run unchanged, per cell.
5. Forward-only losses of the TeraPipe schedule equal those of Megatron's own schedule
   (no pipelining or 1F1B) on the same model and data; then one training step runs.

CPU shims (none touches the code paths above): Megatron-LM requires CUDA, so CPU mode is on; a
missing `triton` is stubbed for the batch-invariant kernels module; the device-architecture query
in validate_args answers "pre-Blackwell"; the dataset index helper comes from the installed
megatron-core wheel if the checkout's is not compiled.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
import warnings
from typing import Optional


def _prepare(checkout: Optional[str]) -> None:
    if checkout:
        sys.path.insert(0, checkout)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if importlib.util.find_spec("triton") is None:
        name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
        stub = types.ModuleType(name)
        for fn in ("set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                   "disable_batch_invariant_mode", "enable_batch_invariant_mode"):
            setattr(stub, fn, lambda *a, **k: False)
        sys.modules[name] = stub


def _dataset_helpers() -> None:
    """Use the installed megatron-core wheel's compiled dataset helper if the checkout has none."""
    import site

    import megatron.core.datasets as datasets

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        return
    for base in site.getsitepackages():
        candidate = os.path.join(base, "megatron", "core", "datasets")
        if os.path.isdir(candidate) and any(f.startswith("helpers_cpp") for f in os.listdir(candidate)):
            datasets.__path__.append(candidate)
            return


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", default=None,
                        help="Megatron-LM checkout (default: the installed megatron.training)")
    parser.add_argument("--args-only", action="store_true",
                        help="only steps 1-2: the launcher's hooks on Megatron-LM's arguments")
    parser.add_argument("--patched-script", default=None,
                        help="run this patched copy of pretrain_gpt.py up to pretrain() instead")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--slices", default="16,24,24", help="token slices of the 64-token sequence ('' to let the planner choose)")
    parser.add_argument("--extra", default="", help="more Megatron-LM / TeraPipe flags")
    return parser.parse_args()


def _argv(opts: argparse.Namespace) -> list[str]:
    return ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
            "--micro-batch-size", "2", "--global-batch-size", "8",
            "--pipeline-model-parallel-size", str(opts.pp),
            "--tensor-model-parallel-size", str(opts.tp), "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--transformer-impl", "local", "--lr", "1e-3", "--train-iters", "3",
            "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
            "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
            "--no-bias-gelu-fusion", "--no-persist-layer-norm", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--position-embedding-type", "rope",
            "--pipeline-schedule", "terapipe",
            *(["--terapipe-slices", *opts.slices.split(",")] if opts.slices else []),
            *opts.extra.split()]


def check_arguments(opts: argparse.Namespace, extra_args_provider=None):
    """Steps 1-2: the hooks, then Megatron-LM's parse/validate as its release calls them."""
    from megatron_terapipe.megatron.hooks import install, selection
    from megatron_terapipe.megatron.launch import install_hooks

    install_hooks()
    import megatron.training.arguments as megatron_arguments
    import megatron.training.training as megatron_training

    assert megatron_training.get_forward_backward_func is install._terapipe_or_megatron, \
        "megatron.training.training.get_forward_backward_func is not patched"
    megatron_arguments.get_device_arch_version = lambda: 9
    sys.argv = _argv(opts)
    os.environ.setdefault("WORLD_SIZE", str(opts.tp * opts.pp))
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    if hasattr(megatron_arguments, "parse_and_validate_args"):  # 0.18, 0.19: also sets the globals
        args = megatron_arguments.parse_and_validate_args(
            extra_args_provider=extra_args_provider, args_defaults=defaults)
    else:  # 0.16, 0.17: initialize_megatron's names, then set_global_variables
        import megatron.training.initialize as megatron_initialize
        from megatron.training.global_vars import set_global_variables

        args = megatron_initialize.parse_args(extra_args_provider)
        megatron_initialize.validate_args(args, defaults)
        set_global_variables(args)
    assert args.pipeline_schedule == "terapipe"
    assert selection.selected(), "validate_args did not select TeraPipe"
    print(f"megatron.training from {os.path.dirname(megatron_arguments.__file__)}: "
          "parse_args took the TeraPipe flags, validate_args selected TeraPipe", flush=True)
    return args


def main() -> int:
    opts = _options()
    warnings.filterwarnings("ignore")
    checkout = os.path.abspath(opts.megatron_lm) if opts.megatron_lm else None
    _prepare(checkout)
    if opts.args_only:
        check_arguments(opts)
        return 0
    if opts.patched_script:
        check_patched_script(opts)
        return 0
    if checkout is None:
        sys.exit("check_megatron_lm.py: steps 3-5 need --megatron-lm (pretrain_gpt.py)")
    import pretrain_gpt  # the checkout's script, imported (its __main__ block does not run)

    from megatron_terapipe.megatron.platform.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    _dataset_helpers()
    script_provider = pretrain_gpt.add_modelopt_args if pretrain_gpt.has_nvidia_modelopt else None
    args = check_arguments(opts, script_provider)
    check_training(opts, args, pretrain_gpt)
    return 0


def check_patched_script(opts: argparse.Namespace) -> None:
    """Run a patched pretrain_gpt.py as __main__ with pretrain() stubbed out: the script's own
    calls must add the TeraPipe flags and select TeraPipe (0.16 parses inside pretrain())."""
    import runpy

    import megatron.training
    import megatron.training.arguments as megatron_arguments

    from megatron_terapipe.megatron.hooks import selection

    def pretrain(*_args, **kwargs):
        import megatron.training.global_vars as global_vars

        args = global_vars._GLOBAL_ARGS
        if args is None:  # 0.16: initialize_megatron would parse and validate here
            import megatron.training.initialize as megatron_initialize

            args = megatron_initialize.parse_args(kwargs.get("extra_args_provider"))
            megatron_initialize.validate_args(args, kwargs.get("args_defaults", {}))
        assert args.pipeline_schedule == "terapipe" and selection.selected()
        print(f"patched {os.path.basename(opts.patched_script)}: TeraPipe flags parsed "
              f"(--terapipe-slices {args.terapipe_slices}), TeraPipe selected", flush=True)

    megatron.training.pretrain = pretrain
    megatron_arguments.get_device_arch_version = lambda: 9
    sys.argv = _argv(opts)
    os.environ.setdefault("WORLD_SIZE", str(opts.tp * opts.pp))
    runpy.run_path(opts.patched_script, run_name="__main__")


def _model(opts: argparse.Namespace):
    """Steps 3: pretrain_gpt's model_provider + gpt_builder, on a fresh gloo world."""
    import torch
    from gpt_builders import gpt_builder
    from megatron.core import parallel_state, tensor_parallel
    from model_provider import model_provider

    from megatron_terapipe.runtime.attention.slice_attention import SliceAttention

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(opts.tp, opts.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = model_provider(gpt_builder, pre_process=parallel_state.is_pipeline_first_stage(),
                           post_process=parallel_state.is_pipeline_last_stage())
    assert any(isinstance(m, SliceAttention) for m in model.modules()), \
        "the stock layer spec did not get slice-aware attention"
    from megatron.core.utils import get_model_config

    get_model_config(model).timers = None
    return model


def check_training(opts: argparse.Namespace, args, pretrain_gpt) -> None:
    """Steps 3-5: forward-only losses of both schedules, then one TeraPipe training step."""
    import megatron.training.training as megatron_training
    import torch
    from megatron.core import parallel_state

    from megatron_terapipe.megatron.hooks import selection
    from megatron_terapipe.megatron.wiring import setup_from_args

    model = _model(opts)
    train_ds, _, _ = pretrain_gpt.train_valid_test_datasets_provider([64, 0, 0])

    def data():
        if parallel_state.get_tensor_model_parallel_rank() != 0 or train_ds is None:
            return None
        return iter(torch.utils.data.DataLoader(train_ds, batch_size=2, shuffle=False))

    common = dict(forward_step_func=pretrain_gpt.forward_step, model=[model], num_microbatches=4,
                  seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                  decoder_seq_length=args.decoder_seq_length)
    terapipe = megatron_training.get_forward_backward_func()
    ours = terapipe(data_iterator=data(), forward_only=True, **common)
    selection.deselect()
    megatron = megatron_training.get_forward_backward_func()
    theirs = megatron(data_iterator=data(), forward_only=True, **common)
    rank = torch.distributed.get_rank()
    if parallel_state.is_pipeline_last_stage():
        a = torch.stack([r["lm loss"].float() for r in ours])
        b = torch.stack([r["lm loss"].float() for r in theirs])
        diff = float((a[:, 0] / a[:, 1] - b[:, 0] / b[:, 1]).abs().max())
        print(f"rank {rank}: {terapipe.__name__} vs {megatron.__name__}: per-microbatch losses "
              f"{(a[:, 0] / a[:, 1]).tolist()}, max abs difference {diff:.2e}", flush=True)
        assert diff < 1e-4
    setup_from_args(args)
    megatron_training.get_forward_backward_func()(data_iterator=data(), forward_only=False, **common)
    print(f"rank {rank}: training step through {terapipe.__name__}: ok", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    sys.exit(main())
