"""Ray on a real two-node Slurm (.ci/slurm-cluster: node1 and node2 in network namespaces)."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

from helpers import (
    CLUSTER,
    LOGS,
    RAYHPC,
    ROOT,
    SUBMITTED,
    assert_nothing_left,
    assert_speedup_and_efficiency,
    job_log,
    skip_requeue_delay,
    submit,
    submit_held,
    wait_cluster,
    wait_done,
    with_changes,
)
from rayhpc.study.folder import LEDGER_FILE, RESULTS_FILE
from rayhpc.tune.results import read_results


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


def test_the_scaling_study_runs_inside_the_startup_and_marks_the_two_node_run(slurm):
    storage = f"/tmp/rayhpc-slurm-results-{uuid.uuid4().hex[:8]}"
    # 1 CPU per node in these jobs: 2 workers must span both nodes
    job = submit("python", "-u", "jobs/scaling_study.py", "--modes", "strong", "--workers", "1,2", "--epochs", "2",
                 "--hidden", "64", "--storage-path", storage)
    info = wait_done(job)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    table = pd.read_parquet(Path(storage) / "scaling" / "scaling.parquet")
    assert table["workers"].tolist() == [1, 2] and table["nodes"].tolist() == [1, 2], table
    assert set(table["global_batch"]) == {512} and (table["samples_per_s"] > 0).all(), table  # strong: one batch
    assert_speedup_and_efficiency(table.set_index("workers"))
    assert (Path(storage) / "scaling" / "scaling.png").stat().st_size > 10_000
    assert "* = the workers spanned several nodes" in log
    assert_nothing_left(job)


def test_a_tp_job_and_a_parameter_server_job_run_across_both_nodes(slurm):
    """The model-parallel job (TP over 2 workers) and the parameter-server job (2 workers, sync) on the job's
    Ray, one after the other in one allocation: 1 CPU per node, so each spans both nodes."""
    storage = f"/tmp/rayhpc-slurm-results-{uuid.uuid4().hex[:8]}"
    job = submit("bash", "-c", f"python -u jobs/train_parallel.py --tp 2 --steps 4 --storage-path {storage} && "
                 f"python -u jobs/train_ps.py --mode sync --num-workers 2 --num-servers 1 --epochs 1 "
                 f"--storage-path {storage}")
    info = wait_done(job)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert log.count("ray: joined Ray at ") == 2 and "rayhpc: command exited with code 0" in log, log
    assert len(list(Path(storage).iterdir())) == 2, list(Path(storage).iterdir())  # each job's run folder
    assert_nothing_left(job)


def test_the_command_exit_code_reaches_slurm(slurm):
    job = submit("python", "-c", "import ray, sys; ray.init(); sys.exit(3)")
    info = wait_done(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", job_log(job)
    assert "rayhpc: command exited with code 3" in job_log(job)
    assert_nothing_left(job)




def from_node2(code: str, env: dict) -> subprocess.CompletedProcess:
    """Python run in node2's network namespace (as another user's process on that node would)."""
    return subprocess.run(["nsenter", "--net=/var/run/netns/n2", sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=120)


HTTP_STATUS = """
import sys, urllib.request, urllib.error
request = urllib.request.Request(sys.argv[1], headers=dict(a.split(": ", 1) for a in sys.argv[2:]))
try:
    print(urllib.request.urlopen(request, timeout=10).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def test_a_client_without_the_token_is_refused(slurm, tmp_path):
    go = tmp_path / "go"
    job = submit("python", "-c", f"import pathlib, time\nwhile not pathlib.Path({str(go)!r}).exists(): time.sleep(0.2)")
    try:
        info = wait_cluster(job)
        status = subprocess.run([RAYHPC, "status"], capture_output=True, text=True, check=True).stdout
        row = next(line.split() for line in status.splitlines() if line.startswith(job + " "))
        assert row[1:3] == ["rayhpc-local-slurm", "RUNNING"] and row[-2:] == ["node1", info["dashboard"]], status
        # another user: no RAY_AUTH_* settings and a home without ~/.ray/auth_token
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}
        client = from_node2(f"import ray; ray.init(address={info['address']!r})", env)
        assert client.returncode != 0 and "token" in client.stderr.lower(), client.stderr[-2000:]
        url = info["dashboard"] + "/api/jobs/"
        status = subprocess.run(["nsenter", "--net=/var/run/netns/n2", sys.executable, "-c", HTTP_STATUS, url],
                                capture_output=True, text=True, env=env).stdout.strip()
        assert status in ("401", "403"), f"the dashboard answered {status} without the token"
        token_file = LOGS / job / "auth_token"
        assert token_file.stat().st_mode & 0o777 == 0o600 and token_file.read_text().strip() not in job_log(job)
        token = token_file.read_text().strip()
        status = subprocess.run(["nsenter", "--net=/var/run/netns/n2", sys.executable, "-c", HTTP_STATUS, url,
                                 f"Authorization: Bearer {token}"], capture_output=True, text=True, env=env).stdout
        assert status.strip() == "200", "the dashboard refused the job's own token"
        # Prometheus file service discovery: both nodes' metrics endpoints, which answer
        sd = json.loads((LOGS / "prometheus" / f"{job}.json").read_text())
        targets = sd[0]["targets"]
        assert [t.split(":")[0] for t in targets] == ["10.77.0.11", "10.77.0.12"], sd
        assert sd[0]["labels"]["slurm_job"] == job
        metrics = subprocess.run(["nsenter", "--net=/var/run/netns/n1", sys.executable, "-c",
                                  "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10)"
                                  ".read().decode())", f"http://{targets[1]}/metrics"],
                                 capture_output=True, text=True).stdout
        assert "ray_" in metrics, metrics[:500]
    finally:
        go.touch()
    assert wait_done(job)["JobState"] == "COMPLETED"
    assert_nothing_left(job)
    assert not (LOGS / "prometheus" / f"{job}.json").exists()  # Prometheus stops scraping the ended job






def broken_ray_on_node2(tmp_path: Path) -> str:
    """A PATH whose `ray` fails on node2 only (a node whose Ray cannot start)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(f'#!/bin/bash\n[ "$(hostname)" = node2 ] && {{ echo "ray: broken on node2" >&2; exit 1; }}\n'
                                 f'exec {Path(sys.executable).parent}/ray "$@"\n')
    (bin_dir / "ray").chmod(0o755)
    return f"{bin_dir}:{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin"


def test_a_node_that_never_joins_is_named_within_the_timeout(slurm, tmp_path):
    # the timeout is also the head's to open its port: on a loaded CI machine that took up to 12 s
    cfg = with_changes(ray={"join_timeout_s": 20.0}, setup={"env": {"PATH": broken_ray_on_node2(tmp_path)}})
    job = submit_held(cfg, ["true"], tmp_path)
    subprocess.run(["scontrol", "release", job], check=True)
    info = wait_done(job)
    log = job_log(job)
    assert "error: node(s) node2 did not join the Ray cluster within 20 s (1 of 2 joined: node1)" in log, log
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0"
    assert_nothing_left(job)


PREEMPT = {
    "scontrol requeue": lambda job: ["scontrol", "requeue", job],
    # what --signal=B:USR1@<lead> delivers before a time limit or preemption: the startup
    # stops the sweep (Tune saves its state) and requeues the job itself
    "USR1 warning": lambda job: ["scancel", "--batch", "--signal=USR1", job],
}


def test_requeue_mid_sweep_resumes_without_rerunning_finished_trials(slurm):
    """Preempted twice, once by each way (`scontrol requeue`, then the USR1 warning), each time after two
    more trials finished: every restart runs only the trials that had not finished. Eight trials, two at a time:
    after the second preemption four are left, so the sweep is still running when the warning comes (with six, on
    a loaded machine, the last two had ended before it once, and the job with them)."""
    storage = f"/tmp/rayhpc-slurm-results-{uuid.uuid4().hex[:8]}"
    job = submit("python", "-u", "jobs/tune_mlp.py", "--num-samples", "8", "--pack", "1", "--epochs", "60",
                 "--storage-path", storage)
    exp_dir = Path(storage) / "mlp-sweep"
    befores = []
    for restart, how in enumerate(PREEMPT):
        deadline = time.monotonic() + 300
        while (before := finished(exp_dir)).shape[0] < 2 * (restart + 1):  # from results.parts/ while it runs
            assert time.monotonic() < deadline, job_log(job)
            time.sleep(0.5)
        subprocess.run(PREEMPT[how](job), check=True)
        skip_requeue_delay(job)
        befores.append(before)
    info = wait_done(job)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", log
    assert "(restart 0)" in log and "(restart 2)" in log, "the log was not appended to across the restarts"
    assert log.rstrip().endswith("rayhpc: command exited with code 0")
    assert not (LOGS / job / "cluster.json").exists(), "the connection file outlived the job"
    final = pd.read_parquet(exp_dir / "results.parquet")
    assert len(final) == 8 and final["trial_id"].is_unique and set(final["status"]) == {"finished"}, final
    for before in befores:  # a finished trial that ran again would have new timings
        again = final.set_index("trial_id").loc[before.index]
        assert again["train_seconds"].tolist() == before["train_seconds"].tolist()
    assert_nothing_left(job)




def finished(exp_dir: Path) -> pd.DataFrame:
    table = read_results(exp_dir)
    return table[table["status"] == "finished"].set_index("trial_id") if len(table) else table


# the Ray sweep's columns for this task: searched parameters, losses, the task's metric
RAY_SWEEP_COLUMNS = ["trial_id", "status", "config.width", "config.lr", "val_loss", "best_val_loss", "val_abs_error",
                     "iterations", "train_seconds", "node", "pack_size", "error"]


def test_array_mode_runs_a_task_shipped_with_the_job_and_writes_the_ray_sweeps_table(slurm, tmp_path):
    storage = Path(f"/tmp/rayhpc-slurm-results-{uuid.uuid4().hex[:8]}")
    private = tmp_path / "private"
    private.mkdir()
    shutil.copy(ROOT / "tests" / "tasks" / "line.py", private / "line.py")
    space = tmp_path / "space.yaml"
    space.write_text("space: {width: {choice: [4, 8]}, lr: {loguniform: [0.01, 0.1]}}\n")
    proc = subprocess.run([RAYHPC, "submit", "--array", "--cluster", CLUSTER, "--", "--task", f"{private}/line.py:Line",
                           "--config", str(space), "--num-samples", "4", "--epochs", "3", "--max-concurrent", "2",
                           "--storage-path", str(storage), "--mlflow", "file"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(private)  # the tasks run the copy in the sweep folder
    array = proc.stdout.split()[3]  # "submitted array job N (4 tasks) ..."
    script = (storage / "line-sweep" / "array.sbatch").read_text()
    assert "#SBATCH --array=0-3%2" in script and f"--task {storage}/line-sweep/task/line.py:Line" in script, script
    wait_done(array)
    results = storage / "line-sweep" / "results.parquet"
    deadline = time.monotonic() + 120
    while not results.is_file():  # written by the collecting job once every task has ended
        assert time.monotonic() < deadline, "no results.parquet from the collecting job"
        time.sleep(0.5)
    table = pd.read_parquet(results)
    assert list(table.columns) == RAY_SWEEP_COLUMNS
    assert len(table) == 4 and set(table["status"]) == {"finished"} and set(table["node"]) <= {"node1", "node2"}, table
    assert set(table["config.width"]) <= {4, 8} and (table["val_abs_error"] > 0).all()
    assert all((LOGS / f"rayhpc-local-slurm-array-{array}_{i}.log").is_file() for i in range(4))
    # each array task tracked its trial in the sweep's MLflow file store: one run each, every epoch
    runs = mlflow_runs(storage / "mlruns", "line-sweep")
    assert sorted(r.data.tags["rayhpc.key"] for r in runs) == ["00000", "00001", "00002", "00003"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert sorted(r.data.metrics["val_loss"] for r in runs) == pytest.approx(sorted(table["val_loss"]), rel=1e-6)


# imported by every Python process of the job: node2's first Ray dashboard agent starts 20 s late, as its imports
# can on a loaded node, longer than the 15 s its raylet waits for it
SLOW_AGENT = """
import os, sys, time
if sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")) and os.environ.get("SLURMD_NODENAME") == "node2":
    try:
        os.close(os.open(os.path.join(os.path.dirname(__file__), "slowed"), os.O_CREAT | os.O_EXCL))
        time.sleep(20)
    except FileExistsError:
        pass
"""


def test_the_sbatch_script_works_directly_and_a_node_whose_ray_agent_starts_late_joins(slurm, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_AGENT)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # the venv, activated
           "PYTHONPATH": str(tmp_path / "site")}
    job = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/%x-%j.log",
                          str(ROOT / "cluster_configs" / "slurm" / "ray_cluster.sbatch"),
                          "python", "-c", "import ray; ray.init(); assert len(ray.nodes()) == 2"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.strip()
    info = wait_done(job)
    log = (tmp_path / f"rayhpc-ray-{job}.log").read_text()
    assert info["JobState"] == "COMPLETED" and "rayhpc: command exited with code 0" in log, log
    assert (tmp_path / "site" / "slowed").exists(), "node2's agent was not slowed"
    node2 = (tmp_path / "rayhpc-logs" / job / "ray-node2.log").read_text()
    # the held start, named and started again (on a loaded machine an agent not held can be late too)
    assert re.search(r"rayhpc: node2: raylet.out: .* C .*Timed out waiting for file", node2), node2
    assert "rayhpc: node2: Ray's agent took longer than the raylet waits for it (a loaded node): starting the " \
           "node's Ray again (2 of 4)" in node2, node2
    assert f"rayhpc: connection file {tmp_path}/rayhpc-logs/{job}/cluster.json" in log, log
    assert not (tmp_path / "rayhpc-logs" / job / "cluster.json").exists(), "the connection file outlived the job"
    assert_nothing_left(job)


def test_two_jobs_on_the_same_nodes_at_once_run_one_tpe_study_together(slurm):
    """`rayhpc submit --study DIR --slices 2`: two jobs at once on the same two nodes, each its own Ray cluster
    on its own block of ports, running one 64-trial TPE sweep together."""
    study = Path(f"/tmp/rayhpc-study-{uuid.uuid4().hex[:8]}")  # every "node" sees /tmp
    proc = subprocess.run([RAYHPC, "submit", "--cluster", CLUSTER, "--study", str(study), "--slices", "2", "--", "python", "-u", "jobs/tune_mlp.py", "--search", "optuna", "--num-samples", "64",
                           "--epochs", "20"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    jobs = re.match(r"submitted job (\d+), (\d+): ", proc.stdout).groups()
    SUBMITTED.extend(jobs)
    infos = [wait_done(job) for job in jobs]
    for job, info in zip(jobs, infos):
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", job_log(job)
        assert_nothing_left(job)
    events = [json.loads(line) for line in (study / LEDGER_FILE).read_text().splitlines()]
    finished = collections.Counter(e["pack"] for e in events if e["event"] == "finish")
    slices = [e["slice"] for e in events if e["event"] == "slice"]
    assert set(finished.values()) == {1} and len(slices) == 2, events
    assert {e["slice"] for e in events if e["event"] == "finish"} == set(slices)  # both ran packs
    assert max(i["StartTime"] for i in infos) < min(i["EndTime"] for i in infos), "the jobs did not overlap"
    assert {i["NodeList"] for i in infos} == {"node[1-2]"}
    blocks = [re.search(r"; ports (\d+-\d+)", job_log(job)).group(1) for job in jobs]
    assert blocks[0] != blocks[1]
    table = pd.read_parquet(study / RESULTS_FILE)
    assert len(table) == 64 and table["trial_id"].is_unique and set(table["status"]) == {"finished"}, table
    status = subprocess.run([RAYHPC, "status", "--study", str(study)], capture_output=True, text=True)
    assert "slices: 0 running (none), 2 ended" in status.stdout and "64 finished" in status.stdout, status


def test_an_array_of_slices_runs_one_optuna_and_asha_study(slurm):
    """`rayhpc submit --array --study DIR`: array tasks without Ray share Optuna's study and ASHA's rungs, and
    track each trial in the study's MLflow file store."""
    study = Path(f"/tmp/rayhpc-study-{uuid.uuid4().hex[:8]}")
    proc = subprocess.run([RAYHPC, "submit", "--array", "--cluster", CLUSTER, "--study", str(study), "--slices", "2",
                           "--", "--search", "optuna", "--scheduler", "asha", "--num-samples", "12", "--epochs", "4",
                           "--mlflow", "file"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    job = re.match(r"submitted array job (\d+) ", proc.stdout).group(1)
    SUBMITTED.append(job)
    wait_done(job)
    events = [json.loads(line) for line in (study / LEDGER_FILE).read_text().splitlines()]
    assert len([e for e in events if e["event"] == "slice"]) == 2, events  # two array tasks, two slices
    finished = collections.Counter(e["pack"] for e in events if e["event"] == "finish")
    assert sorted(finished) == list(range(12)) and set(finished.values()) == {1}, finished
    table = pd.read_parquet(study / RESULTS_FILE)
    assert set(table["status"]) == {"finished", "early-stopped"} and set(table["node"]) <= {"node1", "node2"}, table
    runs = {r.data.tags["rayhpc.key"]: r for r in mlflow_runs(study / "mlruns", study.name)}
    assert sorted(runs) == sorted(table["trial_id"])
    for row in table.itertuples():
        assert runs[row.trial_id].data.tags["rayhpc.status"] == row.status
        assert runs[row.trial_id].data.metrics["val_loss"] == pytest.approx(row.val_loss, rel=1e-6)


def mlflow_runs(store: Path, experiment: str) -> list:
    """The runs of an experiment in an MLflow file store (read with MLflow's own client)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.as_uri())
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=1000)
