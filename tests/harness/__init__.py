"""Helpers for multi-process CPU runs of the tests and benchmarks (everything on CPU with gloo).

spawn: run one function on several gloo processes. models: a small GPT, its batches, a
pretrain_gpt-style forward_step. compare: weights and gradients between the full model and its
shards, and the tolerances TeraPipe must meet. cases: the equivalence experiment (Case,
run_cases, check_case). replay_runs: training with a graph per compute action against
eager, and use_cell_graphs. workers: the other multi-process worker bodies. What several test
files share, imported from its module: flags (Megatron-LM's flags without Megatron-LM),
cost_models (analytic models, synthetic measurements), draws (the random tests' draws), paths
(the checkout's folders).

Workers are named to `spawn` as "harness:<function>", so every worker is exported here.
"""

from .cases import Case, baseline, check_case, run_case, run_cases
from .compare import (BF16, FP32, Tolerance, check_gradients, check_losses, grad_pairs,
                      load_full_state, max_relative_error, report_values, unwrap)
from .models import (TinyGPT, build_stage_model, forward_step, in_precision, legacy_forward_step,
                     loss_func, make_batches, to_device)
from .process_groups import os_thread_count, release_model_parallel
from .replay_runs import use_cell_graphs
from .spawn import GLOO_AND_NCCL, WorkerError, free_port, spawn
from .workers import (InjectedFailure, grads_with_and_without_deferral_hooks,
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
