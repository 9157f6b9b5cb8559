"""Shared fixtures: one real local Ray for the whole session, the test Slurm, a second Unix user; the
markers each folder's tests get. Helpers are in helpers.py."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from helpers import ATTACKER, ROOT, SUBMITTED, require

KINDS = ("unit", "ray", "slurm", "browser", "gpu", "tracking")
# the suite's own rayhpc folder: its jobs never join a cluster the developer started with `rayhpc up`, and
# the tests of `rayhpc up` start theirs here (a new 0700 folder, removed at the end)
os.environ["RAYHPC_HOME"] = tempfile.mkdtemp(prefix="rayhpc-home-")
atexit.register(shutil.rmtree, os.environ["RAYHPC_HOME"], True)


def pytest_collection_modifyitems(items):
    """Each test is marked with its folder's kind (`-m "not slurm and not browser"` on a laptop)."""
    for item in items:
        kind = item.path.parent.name
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture(scope="session")
def ray_cluster():
    """Start one local Ray cluster (2 CPUs, no GPUs, token auth, dashboard) shared by every test; yield its
    `address_info` (gcs_address, webui_url, metrics_export_port, node_ip_address, ...).
    No GPUs even on a GPU node: the tests that use it compare against CPU references, and a sweep
    on it would otherwise take GPU shares (the GPU paths are `jobs/gpu_check.py`'s). Started as the platform
    starts a local Ray (`rayhpc.ray_start`: private folder, its own ports): never one that `ray.init()` would
    find on the machine."""
    import psutil  # Ray's

    from rayhpc import cluster, processes, ray_start

    ctx = cluster.start_local(num_cpus=2, num_gpus=0, logging_level="WARNING", include_dashboard=True)
    # the raylet tries its object store's socket every 50 ms, not every second (ray_start.socket_polling): were
    # they Ray's own, every test would pass as well, only slower
    marker = f"{cluster.CLUSTER_MARKER}={cluster._local[-1].marker}"
    (raylet,) = [psutil.Process(pid) for pid in processes.marked(marker) if psutil.Process(pid).name() == "raylet"]
    assert ray_start.socket_polling().items() <= raylet.environ().items(), "the raylet polls its sockets at Ray's default"
    yield ctx.address_info
    cluster.disconnect()


@pytest.fixture(scope="module")
def slurm():
    """Start (or find running) the two-node test Slurm (.ci/slurm-cluster: node1 and node2 in network
    namespaces); it waits until both nodes are idle."""
    require("root and Slurm (slurmctld; bash .ci/slurm-cluster install)",
            os.geteuid() == 0 and shutil.which("slurmctld") is not None)
    subprocess.run(["bash", str(ROOT / ".ci" / "slurm-cluster"), "start"], check=True, capture_output=True, timeout=300)


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


@pytest.fixture(scope="module")
def attacker() -> str:
    """A second, unprivileged user on the nodes."""
    require("root (to add a second Unix user and act as them)", os.geteuid() == 0)
    if subprocess.run(["id", ATTACKER], capture_output=True).returncode:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", ATTACKER], check=True)
    return ATTACKER


@pytest.fixture
def world_tmp():
    """Paths in /tmp that the other user can reach (tmp_path is private to us): `world_tmp(prefix)`
    names a new one; each is removed after the test."""
    made = []

    def name(prefix: str) -> Path:
        made.append(Path(f"/tmp/{prefix}-{uuid.uuid4().hex[:8]}"))
        return made[-1]

    yield name
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
