"""Helpers for multi-process CPU runs of the tests and benchmarks (everything on CPU with gloo).

Here: spawn (run one function on several gloo processes, one run at a time on the machine:
machine_lock), process_groups (releasing what a case set up), models (a small GPT, its
batches, a pretrain_gpt-style forward_step), compare (weights and gradients between the full
model and its shards, and the tolerances TeraPipe must meet), cases (the equivalence
experiment: Case, run_cases, check_case), megatron_lm (Megatron-LM's own script on CPU) and
paths (the checkout's folders).

runs/: the worker bodies of the other runs compared with Megatron's (virtual stages, MoE, the
distributed optimizer, graph replays and audits, failures). measured/: runs that measure what
the planner predicts (memory, host cost, schedule times). inputs/: what planner and flag
tests build without processes (cost models, random draws, Megatron-LM's flags, the config
fields Megatron reads).

Workers are named to `spawn` as "harness:<function>" (those exported here) or by their module,
e.g. "harness.runs.graph_runs:audit_runs".
"""

from .cases import Case, baseline, check_case, run_case, run_cases
from .compare import (BF16, FP32, Tolerance, check_gradients, check_losses, grad_pairs,
                      load_full_state, max_relative_error, report_values, unwrap)
from .models import (TinyGPT, build_stage_model, forward_step, in_precision, legacy_forward_step,
                     loss_func, make_batches, to_device)
from .process_groups import os_thread_count, release_model_parallel
from .runs.replay_runs import use_cell_graphs
from .spawn import GLOO_AND_NCCL, WorkerError, free_port, spawn
from .runs.workers import (InjectedFailure, grads_with_and_without_deferral_hooks,
                           measure_peak_activations, pinned_core, run_megatron_1f1b,
                           run_variable_lengths, run_with_failure, run_with_mismatched_batch)

__all__ = [
    "BF16", "Case", "FP32", "GLOO_AND_NCCL", "InjectedFailure", "TinyGPT", "Tolerance",
    "WorkerError", "baseline",
    "build_stage_model", "check_case", "check_gradients", "check_losses", "forward_step",
    "free_port", "grad_pairs", "grads_with_and_without_deferral_hooks", "in_precision",
    "legacy_forward_step",
    "load_full_state", "loss_func", "make_batches", "max_relative_error",
    "measure_peak_activations", "os_thread_count", "pinned_core", "release_model_parallel",
    "report_values", "run_case", "run_cases",
    "run_megatron_1f1b", "run_variable_lengths", "run_with_failure", "run_with_mismatched_batch",
    "spawn", "to_device", "unwrap", "use_cell_graphs",
]
