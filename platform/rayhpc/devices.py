"""The GPU a process trains on, and one refusal where it was given a GPU that torch cannot use.

Ray and Slurm hand out GPUs by what the machine has; torch can only use them with a CUDA build whose
CUDA the driver supports. A `+cpu` build, or a CUDA 13 wheel on a driver older than 580, sees no
GPU, and a job that went on would train on the CPU while its first line said it had GPUs. Every
runner asks here instead (`cuda_device`), and every job asks once on the cluster before it trains
(`rayhpc.cluster.check_gpus_usable`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rayhpc.config import ConfigError


def torch_build() -> str:
    """`torch 2.13.0+cpu (a CPU-only build)` or `torch 2.13.0+cu130 (CUDA 13.0)`."""
    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({f'CUDA {cuda}' if cuda else 'a CPU-only build'})"


def node_gpus() -> int:
    """NVIDIA GPUs of this machine that this process may use, by the driver (`/proc/driver/nvidia/gpus`)
    and CUDA_VISIBLE_DEVICES, whatever torch can do with them (Ray counts them so, from the driver too)."""
    found = len(list(Path("/proc/driver/nvidia/gpus").glob("*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    return min(found, len([v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")]))


def cuda_unusable(what: str) -> str | None:
    """One line saying why torch in this process cannot use the GPU it was given, or None where it can."""
    if torch.cuda.is_available():
        return None
    fix = ("install a CUDA build of torch (TORCH_SPEC=torch bash .ci/setup)" if not torch.version.cuda else
           f"the NVIDIA driver may be older than CUDA {torch.version.cuda} needs (nvidia-smi says which it has)")
    return (f"{what}: this process was given GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}) but {torch_build()} cannot use them: "
            f"torch.cuda.is_available() is False; {fix}")


def cuda_device(what: str, index: int = 0) -> torch.device:
    """GPU `index` of this process's visible ones; a `ConfigError` (one line) where torch cannot use it."""
    problem = cuda_unusable(what)
    if problem is not None:
        raise ConfigError(problem)
    return torch.device("cuda", index)
