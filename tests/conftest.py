"""Shared fixtures: one real local Ray for the whole session, the test Slurm, a second Unix user; the
markers each folder's tests get. Helpers are in helpers.py."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
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
    """Start one local Ray cluster (2 CPUs, no GPUs, token auth, dashboard, warm workers) shared by every test; yield
    its `address_info` (gcs_address, webui_url, metrics_export_port, node_ip_address, ...).
    No GPUs even on a GPU node: the tests that use it compare against CPU references, and a sweep
    on it would otherwise take GPU shares (the GPU paths are `jobs/gpu_check.py`'s). Started as the platform
    starts a local Ray (private folder, its own port, its workers forked from a warm starter of its own): never
    one that `ray.init()` would find on the machine."""
    import importlib.util

    from rayhpc import cluster
    from rayhpc.up import setup_worker

    # the Hugging Face tasks' workers run on it too: loaded here, Hugging Face's library is loaded by its starter
    # of workers as well (as a command's is where its task's model is a Hugging Face one), not by each worker
    if importlib.util.find_spec("transformers"):
        import transformers.modeling_utils  # noqa: F401
    with node_asks() as asks:
        ctx = cluster.start_local(num_cpus=2, num_gpus=0, logging_level="WARNING", include_dashboard=True)
    # Ray asked the GCS for its node once, after the raylet had registered: the platform watched for that itself
    # (cluster.registration_polled); Ray's own ask sleeps a whole second after each miss
    assert asks == [True], f"Ray's start asked for its node before its raylet had registered: {asks}"
    # and the raylet tries its object store's socket every 50 ms, not every second (cluster.socket_polling)
    raylet_env = raylet(os.getpid()).environ()
    assert cluster.socket_polling().items() <= raylet_env.items(), "the raylet polls its sockets at Ray's default"
    # were they Ray's own, every test would pass as well, only slower (2.3x in test_parallel, test_ps,
    # test_search, test_train and test_training_options). The first worker comes at once, while its starter
    # imports: it waits for the starter (rayhpc.up.warm.waiting_for). Forked by the starter of this job's workers
    # (the starter's child), which has loaded Ray Tune and Ray Train (in each of them, 1 s of CPU less again)
    parents, ray_loaded = worker_parents()
    assert parents[1] == warm_starter(os.getpid()) and ray_loaded, "the shared cluster's workers are not warm forks"
    assert set_up_by(os.getpid()) == setup_worker.__file__, "the shared cluster's workers are set up by Ray's own script"
    yield ctx.address_info
    cluster.disconnect()


def worker_parents() -> tuple[list[int], bool]:
    """The parent and grandparent processes of a Ray worker of this job's, and whether it had Ray Tune and Ray
    Train loaded before its task ran."""
    import ray

    @ray.remote(num_cpus=0)
    def parents() -> tuple[list[int], bool]:
        import psutil  # Ray's

        return [os.getppid(), psutil.Process(os.getppid()).ppid()], {"ray.tune", "ray.train.torch"} <= set(sys.modules)

    return ray.get(parents.remote())


@contextlib.contextmanager
def node_asks():
    """Inside: for each time Ray's start asks the GCS for its node (Ray's private `services.get_node`), whether
    the node had registered by then."""
    from ray._private import services
    from ray._raylet import GcsClient

    asks, get_node = [], services.get_node

    def recorded(gcs_address, node_id, *args, **kwargs):
        alive = GcsClient(address=gcs_address).get_all_node_info(timeout=30, state_filter=0)  # 0: ALIVE
        asks.append(any(found.hex() == node_id for found in alive))
        return get_node(gcs_address, node_id, *args, **kwargs)

    services.get_node = recorded
    try:
        yield asks
    finally:
        services.get_node = get_node


def raylet(parent: int):
    """The raylet among `parent`'s children (a psutil.Process), if any."""
    import psutil  # Ray's

    return next((child for child in psutil.Process(parent).children() if child.name() == "raylet"), None)


def set_up_by(parent: int) -> str | None:
    """The script that the raylet among `parent`'s children runs to set up each worker (Ray's `setup_worker_path`,
    the second word of the command it starts workers with)."""
    found = raylet(parent)
    flag = next((arg for arg in found.cmdline() if arg.startswith("--python_worker_command=")), None) if found else None
    return flag.split("=", 1)[1].split()[1] if flag else None


def warm_starter(parent: int) -> int | None:
    """The warm starter of workers (`rayhpc.up.starter --workers`) among `parent`'s children."""
    import psutil  # Ray's

    return next((child.pid for child in psutil.Process(parent).children()
                 if child.cmdline()[1:5] == ["-P", "-m", "rayhpc.up.starter", "--workers"]), None)


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
