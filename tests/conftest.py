"""Shared fixtures: one real local Ray instance for the whole test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))  # the benchmarks' helpers (jobs/bench/), whose tables some tests check
# Ray Train's controller polls its workers every 2 s, so each of the suite's many short training runs
# ends up to 2 s after its last step; polling at 0.5 s (set before any Ray or job starts, which inherit
# it) shortens the suite by about a minute and changes nothing a test checks
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def _machine() -> tuple[int, int]:
    from rayhpc.cluster import local_cpus, local_gpus

    return local_cpus(), local_gpus()


# What a job started by a test without --address sees (a local Ray is sized from this machine):
# bad-input expectations are derived from it, so the suite passes on a laptop and a GPU node alike.
CPUS, GPUS = _machine()


def too_many_gpu_workers(flag: str, *extra: str) -> tuple[list[str], str]:
    """Arguments asking for one more GPU worker than this machine holds (`flag` sets the worker count;
    `extra` follow it, `{n}` standing for the count), and the error's start: "no GPUs" on a machine
    without, else how many GPU workers fit."""
    if GPUS == 0:
        return ["--gpu"], "error: compute.gpu (--gpu): the cluster has no GPUs"
    n = min(CPUS, GPUS) + 1
    return (["--gpu", flag, str(n), "--cpus-per-worker", "1", *(e.format(n=n) for e in extra)],
            f"error: compute.num_workers (--num-workers) {n}: the cluster can place {n - 1} worker(s) of "
            "1 CPU + 1 GPU each")


@pytest.fixture(scope="session")
def ray_cluster():
    """Start one local Ray cluster (2 CPUs, no GPUs, token auth, dashboard) shared by every test; yield
    its `address_info` (gcs_address, webui_url, metrics_export_port, node_ip_address, ...).
    No GPUs even on a GPU node: the tests that use it compare against CPU references, and a sweep
    on it would otherwise take GPU shares (the GPU paths are `jobs/gpu_check.py`'s)."""
    import ray

    ctx = ray.init(num_cpus=2, num_gpus=0, logging_level="WARNING", include_dashboard=True)
    yield ctx.address_info
    ray.shutdown()


@pytest.fixture(scope="module")
def slurm():
    """Start (or find running) the two-node test Slurm (.ci/slurm-cluster: node1 and node2 in network
    namespaces); it waits until both nodes are idle."""
    subprocess.run(["bash", str(ROOT / ".ci" / "slurm-cluster"), "start"], check=True, capture_output=True, timeout=300)


SUBMITTED: list[str] = []  # Slurm jobs the running test submitted


@pytest.fixture(autouse=True)
def cancel_submitted_jobs():
    """A test that fails midway leaves no job of its own running, to hold the nodes for the next."""
    yield
    if SUBMITTED:
        subprocess.run(["scancel", *SUBMITTED], capture_output=True)
        SUBMITTED.clear()


@pytest.fixture(scope="session")
def ray_address(ray_cluster):
    """The shared local Ray cluster's address."""
    return ray_cluster["gcs_address"]


def run_job(script: str, *args: str, env: dict | None = None, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `python jobs/<script> args...` the way a user does; capture its output."""
    return subprocess.run([sys.executable, str(ROOT / "jobs" / script), *args], capture_output=True, text=True,
                          env=job_env(env), timeout=timeout, cwd=kwargs.pop("cwd", ROOT), **kwargs)


def job_env(env: dict | None) -> dict:
    """A job's environment: the suite's, unbuffered, with `env`; without RAY_ADDRESS unless `env` sets it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if "RAY_ADDRESS" not in (env or {}):
        full_env.pop("RAY_ADDRESS", None)
    return full_env


_warm: list = []  # the warm job server, started by the first run_job_warm


def run_job_warm(script: str, *args: str, env: dict | None = None, timeout: float = 120,
                 cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`run_job` for a job that ends before it starts Ray (bad input): the same script, argv, environment
    and exit status, in a process forked from one that has imported the platform already (tests/warm_jobs.py)."""
    import atexit
    import tempfile

    from warm_jobs import WarmJobs

    if not _warm:
        _warm.append(WarmJobs(ROOT))
        atexit.register(_warm[0].close)
    with tempfile.TemporaryDirectory(prefix="warm-job-") as out:
        return _warm[0].run(ROOT / "jobs" / script, list(args), job_env(env), cwd, Path(out), timeout)


def tensorboard_scalars(folder: Path) -> dict[str, list[float]]:
    """Every scalar in the TensorBoard event files under `folder`, by tag (read with
    tensorboardX's protobufs: TFRecord = length, crc, Event, crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[float]] = {}
    for path in sorted(Path(folder).rglob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(value.simple_value)
    return scalars
