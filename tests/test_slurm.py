"""Ray on a real two-node Slurm (.ci/slurm-cluster: node1 and node2 in network namespaces)."""

from __future__ import annotations

import glob
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

from conftest import ROOT

RAYHPC = str(Path(sys.executable).with_name("rayhpc"))
CLUSTER = str(ROOT / "cluster_configs" / "local-slurm.yaml")
LOGS = Path("/tmp/rayhpc-slurm-logs")  # the log_dir of local-slurm.yaml


@pytest.fixture(scope="module")
def slurm():
    """Start (or find running) the two-node test cluster."""
    subprocess.run(["bash", str(ROOT / ".ci" / "slurm-cluster"), "start"], check=True, capture_output=True, timeout=300)


def submit(*command: str) -> str:
    proc = subprocess.run([RAYHPC, "submit", "--cluster", CLUSTER, "--", *command], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[2].rstrip(":")  # "submitted job N: log ..."


def wait_done(job: str, timeout_s: float = 400) -> dict:
    """The job's final `scontrol show job` fields once it has left the queue."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued or running after {timeout_s} s"
        time.sleep(1)
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(part.split("=", 1) for part in out.split() if "=" in part)


def job_log(job: str) -> str:
    return (LOGS / f"rayhpc-local-slurm-{job}.log").read_text()


def assert_nothing_left(job: str) -> None:
    procs = subprocess.run(["pgrep", "-af", f"/tmp/[r]h-{job}-"], capture_output=True, text=True).stdout
    assert procs == "", f"Ray processes of job {job} survived it:\n{procs}"
    assert glob.glob(f"/tmp/rh-{job}-*") == [], "the job's temp dirs were left behind"
    assert not (LOGS / job / "auth_token").exists(), "the job's token was left behind"


def test_a_sweep_runs_trials_on_both_nodes_and_leaves_nothing_behind(slurm, tmp_path):
    # every "node" sees /tmp; trials long enough (60 epochs) that two run at once, one per 1-CPU node
    storage = f"/tmp/rayhpc-slurm-results-{uuid.uuid4().hex[:8]}"
    job = submit("python", "-u", "jobs/tune_mlp.py", "--num-samples", "4", "--pack", "1", "--epochs", "60",
                 "--storage-path", storage)
    info = wait_done(job)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "rayhpc: all 2 node(s) joined" in log and "rayhpc: command exited with code 0" in log, log
    results = pd.read_parquet(Path(storage) / "mlp-sweep" / "results.parquet")
    assert len(results) == 4 and set(results["node"]) == {"node1", "node2"}, results
    assert_nothing_left(job)


def test_the_command_exit_code_reaches_slurm(slurm):
    job = submit("python", "-c", "import ray, sys; ray.init(); sys.exit(3)")
    info = wait_done(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", job_log(job)
    assert "rayhpc: command exited with code 3" in job_log(job)
    assert_nothing_left(job)
