"""Pretrain a small GPT with Megatron-Core and the TeraPipe schedule.

    python examples/pretrain_gpt_terapipe.py                 # TeraPipe, 2 CPU processes, 2 stages
    python examples/pretrain_gpt_terapipe.py --pipeline-schedule 1f1b   # Megatron's own 1F1B
    torchrun --nproc-per-node 8 examples/pretrain_gpt_terapipe.py --device cuda \
        --pipeline-model-parallel-size 4 --tensor-model-parallel-size 2 --seq-length 2048 ...

By default each iteration is one sequence of 2048 tokens: a batch far too small for
microbatch pipelining to fill 2 stages, which is the case TeraPipe is for. The planner measures
one layer on this CPU at start-up (cached), cuts the sequence into token slices, and after
training the script times a few more iterations of TeraPipe and of Megatron's own 1F1B
schedule on the same model, next to the planner's predictions (`--compare-iters 0` skips it).

Without torchrun the script relaunches itself under torchrun with as many processes as
tensor x pipeline x data parallelism need. Data: a learnable synthetic corpus by default, or
`--data-path FILE.txt`, tokenised by a byte-level BPE trained on that file (the `tokenizers`
package; no download at run time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_terapipe as mt  # noqa: E402
from gpt_data import SyntheticCorpus, TextCorpus, batches, forward_step  # noqa: E402
from megatron_log import log, log_iteration, log_rank0, log_validation, reduce_loss  # noqa: E402
from megatron_terapipe.megatron.args.flags import add_terapipe_args  # noqa: E402
from megatron_terapipe.megatron.args.checks import (  # noqa: E402
    TeraPipeArgumentError,
    validate_terapipe_args,
)
from side_by_side import compare_schedules  # noqa: E402

# Integer options and their defaults, by argument group.
MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 2048,
         "vocab_size": 512}
PARALLELISM = {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 1}
TRAINING = {"micro_batch_size": 1, "num_microbatches": 1, "train_iters": 30, "eval_interval": 10,
            "eval_iters": 2, "log_interval": 1, "seed": 1234}


def _add_ints(group, defaults: dict) -> None:
    for name, default in defaults.items():
        group.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    _add_ints(g, MODEL)
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default="rope")
    g = p.add_argument_group("parallelism")
    _add_ints(g, PARALLELISM)
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="used only to decide how many processes to launch without torchrun")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    g = p.add_argument_group("training")
    _add_ints(g, TRAINING)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--data-path", default=None, help="a UTF-8 text file (default: synthetic data)")
    g.add_argument("--compare-iters", type=int, default=5,
                   help="after training, time this many iterations of TeraPipe and of Megatron's "
                        "own 1F1B schedule on the same model (0: skip)")
    add_terapipe_args(p)
    p.set_defaults(pipeline_schedule="terapipe")  # this example exists to show TeraPipe
    args = p.parse_args(argv)
    explicit = any(a.startswith("--terapipe-cost-model") for a in (argv or sys.argv[1:]))
    if args.device == "cpu" and not explicit:
        # GPU presets say nothing about a CPU: measure one layer here (a few seconds, cached).
        args.terapipe_cost_model = "profile"
    try:  # bad flags stop here, before any process starts
        validate_terapipe_args(args)
    except TeraPipeArgumentError as exc:
        p.error(str(exc))
    return args


def relaunch_under_torchrun(args: argparse.Namespace) -> None:
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # torchrun's default, said quietly
    print(f"> launching {world} processes "
          f"(TP={args.tensor_model_parallel_size}, PP={args.pipeline_model_parallel_size}, "
          f"DP={args.data_parallel_size}) on {args.device}", flush=True)
    torchrun(["--standalone", f"--nproc-per-node={world}", os.path.abspath(__file__), *sys.argv[1:]])


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:
        relaunch_under_torchrun(args)
        return
    train(args)


def init_distributed(args: argparse.Namespace) -> torch.device:
    """One process per rank: gloo and one pinned core on CPU, NCCL on GPU; Megatron's groups."""
    from megatron.core import parallel_state, tensor_parallel

    cpu = args.device == "cpu"
    if cpu:
        mt.enable_cpu_mode()
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo" if cpu else "nccl", timeout=timedelta(minutes=5))
    if cpu and args.threads == 1:  # one core per stage, as one GPU per rank
        mt.pin_to_core(int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                       int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if dist.get_world_size() % (tp * pp):
        raise SystemExit(f"world size {dist.get_world_size()} is not a multiple of TP x PP = {tp * pp}")
    parallel_state.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    return device


def build_model(args: argparse.Namespace, device: torch.device):
    """This stage's GPTModel in Megatron's DDP wrapper, its optimizer, and its config."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu = device.type == "cpu"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        use_cpu_initialization=cpu, pipeline_dtype=dtype, params_dtype=dtype, bf16=args.bf16,
        hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, mt.get_gpt_layer_spec(backend="auto"), vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=False)
    model.to(device)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, bf16=args.bf16,
                        params_dtype=dtype, clip_grad=1.0), [model])
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, config


def plan_terapipe(args: argparse.Namespace, config):
    """The plan and the planner's report (None, None under Megatron's own schedules)."""
    if args.pipeline_schedule != "terapipe":
        return None, None
    provider = mt.ArgsPlanProvider.from_args(args)
    mt.configure(config, provider)
    plan = provider.plan_for(args.seq_length, args.micro_batch_size)  # plan now; rank 0 logs it
    return plan, provider.reports.get((args.seq_length, args.micro_batch_size))


def train(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")  # Megatron's default
    from megatron.core import parallel_state

    device = init_distributed(args)
    model, optimizer, config = build_model(args, device)
    plan, report = plan_terapipe(args, config)
    mt.install()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    log_rank0(f"> schedule: {getattr(forward_backward, '__name__', forward_backward)}")
    dp_rank = parallel_state.get_data_parallel_rank()
    corpus = (TextCorpus(args.data_path, args.vocab_size) if args.data_path
              else SyntheticCorpus(args.vocab_size, seed=args.seed))
    train_data = batches(corpus, args.micro_batch_size, args.seq_length, seed=args.seed + 97 * dp_rank)
    valid_data = batches(corpus, args.micro_batch_size, args.seq_length, seed=10_000 + dp_rank)
    common = dict(forward_step_func=partial(forward_step, device=device), model=[model],
                  num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                  micro_batch_size=args.micro_batch_size)
    run = partial(forward_backward, **common)
    first_loss, last_loss = train_loop(args, model, optimizer, run, train_data, valid_data)
    if args.terapipe_trace and plan is not None:
        write_trace(args.terapipe_trace, model, run, train_data)
    log(f"> done: lm loss {first_loss:.4f} -> {last_loss:.4f}")
    if args.compare_iters > 0 and plan is not None and args.pipeline_model_parallel_size > 1:
        compare_schedules(args, model, common, train_data, report, plan, device)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def train_loop(args: argparse.Namespace, model, optimizer, run, train_data, valid_data):
    """Megatron's training loop, cut to its core; returns the first and the last loss."""
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    global_batch = (args.micro_batch_size * args.num_microbatches
                    * parallel_state.get_data_parallel_world_size())
    log_rank0(f"> training {args.train_iters} iterations, global batch {global_batch} x "
              f"{args.seq_length} tokens, {dist.get_world_size()} processes on {args.device}")
    losses = []
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = run(data_iterator=train_data, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        elapsed = time.perf_counter() - start
        losses.append(reduce_loss(reports, dp_group))
        if iteration % args.log_interval == 0:
            log_iteration(args, iteration, global_batch, elapsed, losses[-1], grad_norm, ok)
        if args.eval_interval and iteration % args.eval_interval == 0:
            log_validation(iteration, evaluate(args, model, run, valid_data, dp_group))
    return losses[0], losses[-1]


def evaluate(args: argparse.Namespace, model, run, valid_data, dp_group) -> float:
    model.eval()
    reports = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            reports += run(data_iterator=valid_data, forward_only=True)
    model.train()
    return reduce_loss(reports, dp_group)


def write_trace(path: str, model, run, train_data) -> None:
    """One more training step, timed cell by cell on every rank, written as a Chrome trace."""
    from megatron_terapipe.runtime.trace import gather_trace

    model.zero_grad_buffer()
    runs = []
    run(data_iterator=train_data, forward_only=False, on_run=runs.append)
    gather_trace(runs[-1], path)
    log_rank0(f"> wrote the measured per-cell trace to {path}")


if __name__ == "__main__":
    main()
