"""The one start-up path of every job, in the order that keeps bad input cheap:

1. reconcile `--resume` with what is saved (and check the storage folder);
2. load the task and check it on one small batch in the driver (jobs that train a task);
3. probe the cluster (a local one is only described, not started);
4. size the workers (the one CPU-per-worker default policy) and check that they can be placed;
5. the job's own checks against the cluster;
6. start or join Ray; where the job trains on GPUs, check that torch on a GPU node can use them;
   save the job's config beside its results.

Everything that can be wrong with the input fails in steps 1-5, before any cluster starts; a torch
that cannot use the cluster's GPUs fails in step 6, before anything trains.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from rayhpc import cluster
from rayhpc.config import JobConfig, reconcile_resume
from rayhpc.monitor.startup import mark
from rayhpc.task import task_for
from rayhpc.task.check import check_task

log = logging.getLogger(__name__)
J = TypeVar("J", bound=JobConfig)


@dataclass
class Started(Generic[J]):
    """A job whose input is checked and whose Ray connection is up."""

    cfg: J  # resolved: the resumed job's saved values, the CPUs per worker the policy chose
    resources: cluster.Resources
    ray_seconds: float  # to start (or join) Ray
    task: Any = None  # rayhpc.task.LoadedTask, for jobs that train a task
    info: Any = None  # rayhpc.task.check.TaskInfo
    sample_batch: Any = None  # the small batch the task was checked on


def start_job(cfg: J, explicit: set[str] = frozenset(), *,
              bind: Callable[[J, Any], tuple[J, dict]] | None = None,
              workers: Callable[[J], int] | None = None,
              check: Callable[[J, cluster.Resources], None] | None = None,
              gpus: Callable[[J, cluster.Resources], float] | None = None,
              objectives: Callable[[J, Any], Any] | None = None) -> Started[J]:
    """Steps 1-6 above. `bind(cfg, task) -> (cfg, hp)`: the job's hyperparameters for the task check
    (jobs that train a task); `workers(cfg)`: how many workers of `cfg.compute` it places;
    `check(cfg, resources)`: the job's own resource checks; `gpus(cfg, resources)`: GPUs per process
    (default: one where `cfg.compute.gpu`); `objectives(cfg, info) -> info`: the job's own objectives checked
    against what the task reports (sweeps)."""
    mark("imports and config")
    cfg = reconcile_resume(cfg, set(explicit))
    task = info = batch = None
    if bind is not None:
        cfg, task, info, batch = bind_task(cfg, bind)
        info = info if objectives is None else objectives(cfg, info)
        mark("task check")
    address = cluster.resolve_address(cfg.address)
    res = cluster.probe(address)
    if workers is not None:
        cfg = _size_workers(cfg, res, workers(cfg))
    if check is not None:
        check(cfg, res)
    started = time.perf_counter()
    cluster.connect(address)
    ray_seconds = time.perf_counter() - started
    mark("ray")
    each = (gpus or _compute_gpus)(cfg, res)
    if each:
        cluster.check_gpus_usable(each, "gpus_per_trial (--gpus-per-trial)" if gpus else "compute.gpu (--gpu)")
    if task is not None:
        task.ship()
    if not (cfg.resume and cfg.saved_file.exists()):
        cfg.save()
    return Started(cfg, res, ray_seconds, task, info, batch)


def bind_task(cfg, bind):
    """Step 2: (cfg, task, what the check learnt, the checked batch) for a job that trains a task."""
    task = task_for(cfg.task, cfg.data)
    cfg, hp = bind(cfg, task)
    info, batch = check_task(task, hp, cfg.data)
    return cfg, task, info, batch


def _size_workers(cfg: J, res: cluster.Resources, n: int) -> J:
    compute = cfg.compute
    cpus = compute.cpus_per_worker or cluster.default_cpus_per_worker(res, n, compute.gpu)
    cluster.check_workers(res, n, cpus, compute.gpu)
    return cfg.model_copy(update={"compute": compute.model_copy(update={"cpus_per_worker": cpus})})


def _compute_gpus(cfg, _res: cluster.Resources) -> float:
    compute = getattr(cfg, "compute", None)
    return 1.0 if getattr(compute, "gpu", False) else 0.0
