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
import math
import os
import sys
import time
from datetime import datetime, timedelta
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_terapipe as mt  # noqa: E402
from megatron_terapipe.megatron.flags import add_terapipe_args  # noqa: E402
from megatron_terapipe.megatron.validation import (  # noqa: E402
    TeraPipeArgumentError,
    validate_terapipe_args,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=2048)
    g.add_argument("--vocab-size", type=int, default=512)
    g.add_argument("--position-embedding-type", choices=("rope", "learned_absolute"), default="rope")
    g = p.add_argument_group("parallelism")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="used only to decide how many processes to launch without torchrun")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--num-microbatches", type=int, default=1)
    g.add_argument("--train-iters", type=int, default=30)
    g.add_argument("--eval-interval", type=int, default=10)
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--seed", type=int, default=1234)
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


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
class SyntheticCorpus:
    """Token streams from a sparse random Markov chain: learnable, so the loss visibly falls."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, 2), generator=gen)
        self.vocab_size = vocab_size

    def sample(self, rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
        out = torch.empty(rows, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab_size, (rows,), generator=gen)
        choice = torch.randint(0, 2, (rows, length), generator=gen)
        for t in range(1, length):
            out[:, t] = self.successors[out[:, t - 1], choice[:, t]]
        return out


class TextCorpus:
    """A text file, tokenised with a byte-level BPE trained on the file itself."""

    def __init__(self, path: str, vocab_size: int) -> None:
        try:
            from tokenizers import ByteLevelBPETokenizer
        except ImportError as exc:
            raise SystemExit("--data-path needs the tokenizers package: pip install tokenizers") from exc
        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train([path], vocab_size=vocab_size, min_frequency=2, show_progress=False)
        with open(path, encoding="utf-8") as f:
            ids = tokenizer.encode(f.read()).ids
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.vocab_size = vocab_size

    def sample(self, rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
        if self.ids.numel() <= length:
            raise SystemExit(f"--data-path has {self.ids.numel()} tokens, fewer than --seq-length + 1")
        starts = torch.randint(0, self.ids.numel() - length, (rows,), generator=gen)
        return torch.stack([self.ids[s:s + length] for s in starts.tolist()])


def batches(corpus, micro_batch_size: int, seq_length: int, seed: int):
    """GPTDataset-style microbatches: tokens, labels, loss_mask, position_ids, attention_mask."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
    while True:
        seq = corpus.sample(micro_batch_size, seq_length + 1, gen)
        yield {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(),
               "loss_mask": torch.ones(micro_batch_size, seq_length),
               "position_ids": positions.contiguous(), "attention_mask": None}


# ---------------------------------------------------------------------------------------------
# Megatron-style forward step and loss (unchanged by TeraPipe)
# ---------------------------------------------------------------------------------------------
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model, device):
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a middle stage: its input comes from the previous stage
        return model(None, None, None), partial(loss_func, None)
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


# ---------------------------------------------------------------------------------------------
# Logging in Megatron's style
# ---------------------------------------------------------------------------------------------
def is_logging_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1  # Megatron logs from the last rank


def log(msg: str) -> None:
    if is_logging_rank():
        print(msg, flush=True)


def log_rank0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def reduce_loss(losses: list, group) -> float:
    """Token-weighted mean over microbatches and data-parallel ranks ([sum, count] reports)."""
    from megatron.core import parallel_state

    total = torch.zeros(2)
    for rep in losses:
        total += rep["lm loss"].detach().float().cpu()
    if parallel_state.is_pipeline_last_stage():
        dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp(min=1))


# ---------------------------------------------------------------------------------------------
# Side by side: TeraPipe against Megatron's own 1F1B on the same model
# ---------------------------------------------------------------------------------------------
def compare_schedules(args, model, common: dict, data, report, plan, device) -> None:
    """Time `args.compare_iters` iterations (forward + backward) of each schedule, interleaved.

    Both run on the same model, weights and batches; gradients are cleared after each and no
    optimizer step is taken. A round runs TeraPipe, then Megatron's 1F1B (the order alternates
    from round to round); each time is the wall time between two barriers of all ranks.
    One untimed round of each comes first.
    """
    import statistics

    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving as megatron_1f1b,
    )
    from megatron_terapipe import forward_backward_terapipe

    schedules = {"terapipe": forward_backward_terapipe, "megatron": megatron_1f1b}
    tty = sys.stdout.isatty()

    def timed(name: str) -> float:
        model.zero_grad_buffer()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        schedules[name](data_iterator=data, forward_only=False, **common)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - start

    n = args.compare_iters
    log(f"> timing {n} more iteration{'s' if n > 1 else ''} of each schedule on the same model "
        f"(forward + backward, interleaved{'; medians' if n > 1 else ''})")
    for name in schedules:
        timed(name)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in schedules}
    for r in range(n):
        for name in (("terapipe", "megatron") if r % 2 == 0 else ("megatron", "terapipe")):
            times[name].append(timed(name))
        if tty and is_logging_rank():
            print(f"\r>   round {r + 1}/{n}", end="", flush=True)
    if tty and is_logging_rank():
        print("\r\033[K", end="", flush=True)
    model.zero_grad_buffer()
    tera, mega = (statistics.median(times[k]) for k in ("terapipe", "megatron"))
    slices = sum(len(ts) for ts in plan.token_slices)

    def predicted(seconds) -> str:
        return f" (planner predicted {seconds * 1e3:.1f} ms)" if seconds else ""

    def row(label: str, value: str) -> str:
        return f">   {label} {'.' * max(3, 28 - len(label))} {value}"

    cells = "token slice" if slices == 1 else "token slices"
    log(row(f"TeraPipe ({slices} {cells})", f"{tera * 1e3:.1f} ms per iteration"
            + predicted(report.iteration_time if report else None)))
    log(row("Megatron 1F1B", f"{mega * 1e3:.1f} ms per iteration"
            + predicted(report.baseline_time if report else None)))
    line = row("speedup", f"{mega / tera:.2f}x")
    if report and report.iteration_time and report.baseline_time:
        line += f" (planner predicted {report.baseline_time / report.iteration_time:.2f}x)"
    bold, plain = ("\033[1m", "\033[0m") if tty else ("", "")
    log(f"{bold}{line}{plain}")
    cores = os.cpu_count() or 1
    if device.type == "cpu" and hasattr(os, "getloadavg") and os.getloadavg()[0] > 1.5 * cores:
        log(f">   note: other processes shared these {cores} cores (load average "
            f"{os.getloadavg()[0]:.1f}); TeraPipe gains by running its stages at the same "
            "time, one core each, so timings under load are not representative")


# ---------------------------------------------------------------------------------------------
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


def train(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")  # Megatron's default
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

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
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank = parallel_state.get_data_parallel_rank()

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, use_cpu_initialization=cpu, pipeline_dtype=dtype,
        params_dtype=dtype, bf16=args.bf16, hidden_dropout=0.0, attention_dropout=0.0)
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
                        params_dtype=dtype, clip_grad=0.0 if cpu else 1.0), [model])
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    plan = report = None
    if args.pipeline_schedule == "terapipe":
        provider = mt.ArgsPlanProvider(args)
        mt.configure(config, provider)
        plan = provider.plan_for(args.seq_length, args.micro_batch_size)  # plan now; rank 0 logs it
        report = provider.reports.get((args.seq_length, args.micro_batch_size))
    mt.install()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    log_rank0(f"> schedule: {getattr(forward_backward, '__name__', forward_backward)}")

    corpus = (TextCorpus(args.data_path, args.vocab_size) if args.data_path
              else SyntheticCorpus(args.vocab_size, seed=args.seed))
    train_data = batches(corpus, args.micro_batch_size, args.seq_length, seed=args.seed + 97 * dp_rank)
    valid_data = batches(corpus, args.micro_batch_size, args.seq_length, seed=10_000 + dp_rank)
    step = partial(forward_step, device=device)
    dp_size = parallel_state.get_data_parallel_world_size()
    global_batch = args.micro_batch_size * args.num_microbatches * dp_size
    common = dict(forward_step_func=step, model=[model], num_microbatches=args.num_microbatches,
                  seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
    log_rank0(f"> training {args.train_iters} iterations, global batch {global_batch} x "
              f"{args.seq_length} tokens, {dist.get_world_size()} processes on {device.type}")

    first_loss = last_loss = None
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(data_iterator=train_data, forward_only=False, **common)
        ok, grad_norm, _ = optimizer.step()
        elapsed = time.perf_counter() - start
        loss = reduce_loss(losses, dp_group)
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        if iteration % args.log_interval == 0:
            tokens_per_s = global_batch * args.seq_length / elapsed
            log(f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {iteration * global_batch:10d} |"
                f" elapsed time per iteration (ms): {elapsed * 1000:.1f} |"
                f" tokens per second: {tokens_per_s:.0f} | learning rate: {args.lr:.6E} |"
                f" global batch size: {global_batch:5d} | lm loss: {loss:.6E} |"
                + (f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else "")
                + ("" if ok else " skipped |"))
        if args.eval_interval and iteration % args.eval_interval == 0:
            model.eval()
            total = []
            with torch.no_grad():
                for _ in range(args.eval_iters):
                    total += forward_backward(data_iterator=valid_data, forward_only=True, **common)
            model.train()
            val = reduce_loss(total, dp_group)
            log("-" * 100)
            log(f" validation loss at iteration {iteration} | lm loss value: {val:.6E} |"
                f" lm loss PPL: {math.exp(min(val, 50)):.6E} |")
            log("-" * 100)

    if args.terapipe_trace and args.pipeline_schedule == "terapipe":
        # One more training step, timed cell by cell on every rank, written as a Chrome trace.
        from megatron_terapipe.runtime.trace import gather_trace

        model.zero_grad_buffer()
        runs = []
        forward_backward(data_iterator=train_data, forward_only=False, on_run=runs.append, **common)
        gather_trace(runs[-1], args.terapipe_trace)
        log_rank0(f"> wrote the measured per-cell trace to {args.terapipe_trace}")
    log(f"> done: lm loss {first_loss:.4f} -> {last_loss:.4f}")
    if args.compare_iters > 0 and plan is not None and pp > 1:
        compare_schedules(args, model, common, train_data, report, plan, device)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
