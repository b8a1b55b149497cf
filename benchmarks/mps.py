"""N pipeline-stage processes on one GPU, each with its own share of the SMs (CUDA MPS).

    with MpsDaemon():                       # nvidia-cuda-mps-control -d ... echo quit
        spawn(n, "module:stage_main", ..., rank_environ=stage_environ(n))
                                            # each stage calls enter_stage(rank, n) first

One GPU cannot hold a NCCL group of several ranks ("Duplicate GPU detected"); under MPS each
process with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/N runs like a GPU of 1/N the SMs (two
processes at 50% ran bf16 GEMMs at 343 and 346 TFLOP/s side by side, 720 alone, on an H100).
Stages talk through host memory over gloo (host_staged.py). A benchmark tool, not the product.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Optional

MPS_CONTROL_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/cuda/bin")


def mps_control() -> Optional[str]:
    """Path of nvidia-cuda-mps-control, or None where MPS is not installed."""
    found = shutil.which("nvidia-cuda-mps-control")
    if found:
        return found
    for folder in MPS_CONTROL_DIRS:
        path = os.path.join(folder, "nvidia-cuda-mps-control")
        if os.access(path, os.X_OK):
            return path
    return None


class MpsDaemon:
    """Starts the MPS control daemon for this process tree and stops it on exit.

    The pipe and log folders go to the environment, so child processes started inside the
    `with` block find the daemon.
    """

    def __init__(self, root: Optional[str] = None) -> None:
        self.control = mps_control()
        if self.control is None:
            raise RuntimeError("CUDA MPS is not installed here (nvidia-cuda-mps-control not "
                               f"found on PATH or in {', '.join(MPS_CONTROL_DIRS)})")
        self.root = root or tempfile.mkdtemp(prefix="terapipe-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.root, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.root, "log")}

    def __enter__(self) -> "MpsDaemon":
        for folder in self.env.values():
            os.makedirs(folder, exist_ok=True)
        os.environ.update(self.env)
        subprocess.run([self.control, "-d"], check=True, env=os.environ.copy())
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([self.control], input=b"quit\n", env=os.environ.copy(), check=False)


SHARE_VARIABLE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"  # MpsDaemon sets it; its stage processes inherit it


def stage_share(num_stages: int) -> str:
    return str(max(1, 100 // num_stages))


def stage_environ(num_stages: int, ranks: Optional[int] = None) -> dict[int, dict[str, str]]:
    """What spawn(..., rank_environ=) gives each of `ranks` (default: every stage) processes:
    its SM share, in its environment before anything in it asks the CUDA driver (NCCL's
    process-group set-up does, before a worker's own code runs; a share set after that is
    ignored, and the 2- and 4-stage profiles then measure at the same speed)."""
    return {r: {SHARE_VARIABLE: stage_share(num_stages)}
            for r in range(num_stages if ranks is None else ranks)}


def enter_stage(rank: int, num_stages: int) -> None:
    """Call first in a stage process started with `stage_environ` inside `MpsDaemon`: checks
    that its SM share came with its environment and that the daemon's pipe folder did too, and
    takes the GPU. Without a daemon the share is ignored and the stage processes take turns on
    the whole GPU, at about twice what the simulator gives stages running side by side."""
    if PIPE_VARIABLE not in os.environ:
        raise RuntimeError(
            f"stage {rank} of {num_stages}: no MPS daemon ({PIPE_VARIABLE} is not set): start "
            "the stage processes inside `with mps.MpsDaemon():`, else their SM shares are "
            "ignored and they take turns on the whole GPU")
    share = os.environ.get(SHARE_VARIABLE)
    if share != stage_share(num_stages):
        raise RuntimeError(
            f"stage {rank} of {num_stages}: {SHARE_VARIABLE} is {share!r}, not "
            f"{stage_share(num_stages)!r}: start the stage processes with spawn(..., "
            f"rank_environ=mps.stage_environ({num_stages})); set inside the process it comes "
            "after NCCL's set-up has started CUDA, and MPS ignores it")
    import torch

    torch.cuda.set_device(0)
