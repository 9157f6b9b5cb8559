"""Tensor, pipeline and data parallelism on the platform's own group of Ray actors.

    from rayhpc.parallel import ParallelConfig, run_parallel, WorkerGroup
"""

from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.mesh import Degrees
from rayhpc.parallel.worker_group import WorkerContext, WorkerGroup, WorkerGroupError


def run_parallel(*args, **kwargs):
    from rayhpc.parallel.trainer import run_parallel as run

    return run(*args, **kwargs)


__all__ = ["Degrees", "ParallelConfig", "WorkerContext", "WorkerGroup", "WorkerGroupError", "run_parallel"]
