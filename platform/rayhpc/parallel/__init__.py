"""Tensor, pipeline and data parallelism on the platform's own group of Ray actors (`rayhpc.workers`).

    from rayhpc.parallel import ParallelConfig, run_parallel
"""

from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.mesh import Degrees


def run_parallel(*args, **kwargs):
    """Train (or resume) the run a `ParallelConfig` describes (`rayhpc.parallel.trainer.run_parallel`): the
    per-step losses, step times, the whole model's final weights and validation; input errors are raised
    before Ray starts."""
    from rayhpc.parallel.trainer import run_parallel as run  # the job's Ray and torch: not when the package is imported

    return run(*args, **kwargs)


__all__ = ["Degrees", "ParallelConfig", "run_parallel"]
