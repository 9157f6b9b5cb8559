"""Ray on a four-node test Slurm (.ci/slurm-cluster start --nodes 4: node1..node4, 1 CPU each)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pandas as pd
import pytest

from helpers import ROOT, assert_nothing_left, job_log, submit, wait_done

NODES = 4


@pytest.fixture(scope="module")
def four_nodes():
    cluster = ["bash", str(ROOT / ".ci" / "slurm-cluster"), "start"]
    subprocess.run([*cluster, "--nodes", str(NODES)], check=True, capture_output=True, timeout=300)
    yield
    subprocess.run(cluster, check=True, capture_output=True, timeout=300)  # the two nodes the other tests expect


def test_a_sweep_across_four_nodes_runs_trials_on_every_node_and_leaves_nothing_behind(four_nodes):
    idle = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], capture_output=True, text=True).stdout
    assert sorted(set(idle.split())) == [f"node{i}" for i in range(1, NODES + 1)], idle
    storage = f"/tmp/rayhpc-slurm-results-{uuid.uuid4().hex[:8]}"
    # 4 unpacked trials on 4 one-CPU nodes start at once, one per node; each long enough (100 epochs) that
    # none ends before the slowest node's trial process is up (Tune would hand an idle process the trial)
    job = submit("python", "-u", "jobs/tune_mlp.py", "--num-samples", "4", "--pack", "1", "--epochs", "100",
                 "--storage-path", storage, nodes=NODES)
    info = wait_done(job, timeout_s=600)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["NodeList"] == f"node[1-{NODES}]" and f"rayhpc: all {NODES} node(s) joined" in log, log
    results = pd.read_parquet(Path(storage) / "mlp-sweep" / "results.parquet")
    assert len(results) == 4 and (results["status"] == "finished").all(), results
    assert set(results["node"]) == {f"node{i}" for i in range(1, NODES + 1)}, results[["trial_id", "node"]]
    assert_nothing_left(job)
