"""Experiment tracking end to end: a real MLflow tracking server on loopback receives a packed sweep, one run per
trial; a DDP job's rank 0 writes one run to MLflow's file store; W&B offline runs written with no network route
(a network namespace of loopback only), read back from W&B's own files; `rayhpc export` of the best trials.
Checkpoints kept by score (`keep_best`) are checked against what Tune and Ray Train recorded of each report."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import torch
from wandb_files import offline_run

from helpers import ROOT, job_env, mlp_split, require, run_job, sweep
from rayhpc.config import validate
from rayhpc.task import task_for
from rayhpc.train.config import TrainConfig
from rayhpc.tune.sweep import run_sweep

MLFLOW_STATUS = {"finished": "FINISHED", "early-stopped": "KILLED"}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free loopback port (its store and artifacts in a temporary folder); its URI."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as probe:  # a test server: the port a loopback bind of the system's choosing got
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                             str(port), "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
                             "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()[-2000:]
            time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # its workers slow to stop on a loaded node: the tests are done, end them
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def plain_val_loss(model: torch.nn.Module, task) -> float:
    """The mlp task's validation MSE, computed here in plain PyTorch over the whole hold-out."""
    _, val = mlp_split(task)
    x, y = val.dataset.tensors[0][val.indices], val.dataset.tensors[1][val.indices]
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def load_trial(folder: Path, task) -> torch.nn.Module:
    """An exported (or uploaded) trial's folder as its model: the task's model(hp) with model.pt loaded."""
    hp = json.loads((folder / "hp.json").read_text())
    model = task.initial_model(hp)
    model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))
    return model.eval()


def test_a_packed_sweep_is_one_mlflow_run_per_trial_on_a_tracking_server(ray_address, tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    cfg = sweep(tmp_path, name="tracked", num_samples=16, epochs=4, scheduler="asha",
                tracking={"mlflow": mlflow_server, "log_checkpoint": "last"}, checkpoint={"keep_best": 1})
    table = run_sweep(cfg).set_index("trial_id")
    assert (table["pack_size"] > 1).all() and {"finished", "early-stopped"} <= set(table["status"])
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracked")
    runs = {r.data.tags["rayhpc.key"]: r for r in client.search_runs([experiment.experiment_id], max_results=100)}
    assert sorted(runs) == sorted(table.index)  # 16 runs, one per trial, pack members included
    for trial_id, row in table.iterrows():
        run = runs[trial_id]
        params = run.data.params
        assert float(params["lr"]) == row["config.lr"] and int(params["hidden"]) == row["config.hidden"]
        history = client.get_metric_history(run.info.run_id, "val_loss")
        assert [m.step for m in history] == list(range(1, row["iterations"] + 1)), trial_id
        assert history[-1].value == pytest.approx(row["val_loss"], rel=1e-6)
        assert run.data.metrics["best_val_loss"] == pytest.approx(row["best_val_loss"], rel=1e-6)
        assert (run.info.status, run.data.tags["rayhpc.status"]) == (MLFLOW_STATUS[row["status"]], row["status"])
        assert run.data.tags["rayhpc.node"] == row["node"]
    # each run's weights as its artifact (the last: a stopped member's as it stopped) give its table val_loss
    task = task_for(cfg.task, cfg.data)
    for status in ("finished", "early-stopped"):
        trial_id = table.index[table["status"] == status][0]
        got = Path(client.download_artifacts(runs[trial_id].info.run_id, "checkpoint", str(tmp_path)))
        assert plain_val_loss(load_trial(got, task), task) == pytest.approx(table.loc[trial_id, "val_loss"], rel=1e-4)
        shutil.rmtree(got)
    assert_kept_best(tmp_path / "tracked", best=1)
    assert_exports_best(tmp_path / "tracked", table, task, tmp_path / "best")


def assert_kept_best(sweep_dir: Path, best: int) -> None:
    """Each Tune trial kept its `best` checkpoints by the reported objective (Tune's result.json) and its latest."""
    ranked_apart = 0  # trials whose best checkpoint is not their latest: where keeping by score shows
    for trial_dir in (p for p in sweep_dir.iterdir() if (p / "result.json").exists()):
        reports = [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
        ranked = sorted(range(len(reports)), key=lambda i: reports[i]["val_loss"])
        want = {f"checkpoint_{i:06d}" for i in ranked[:best]} | {f"checkpoint_{len(reports) - 1:06d}"}
        assert {c.name for c in trial_dir.glob("checkpoint_*")} == want, trial_dir.name
        ranked_apart += len(want) > best
    assert ranked_apart > 0, "every trial's best checkpoint was its latest: the test shows nothing"


def assert_exports_best(sweep_dir: Path, table: pd.DataFrame, task, dest: Path) -> None:
    """`rayhpc export --best 3`: the three best trials by best_val_loss, each evaluating to its table val_loss."""
    out = subprocess.run([sys.executable, "-m", "rayhpc", "export", str(sweep_dir), str(dest), "--best", "3"],
                         capture_output=True, text=True, env=job_env(None), timeout=120)
    assert out.returncode == 0, out.stderr
    want = list(table.sort_values("best_val_loss").index[:3])
    assert [Path(line).name for line in out.stdout.split()] == want
    for trial_id in want:
        got = plain_val_loss(load_trial(dest / trial_id, task), task)
        assert got == pytest.approx(table.loc[trial_id, "val_loss"], rel=1e-4), trial_id
        metrics = json.loads((dest / trial_id / "metrics.json").read_text())
        assert metrics["trial_id"] == trial_id and metrics["val_loss"] == pytest.approx(table.loc[trial_id, "val_loss"])
    assert oct((dest / want[0]).stat().st_mode & 0o777) == "0o700"


def test_a_ddp_job_is_one_mlflow_run_in_a_file_store_and_keeps_its_best_checkpoint(ray_address, tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path}/mlruns"
    # lr 1.0: a validation loss that goes up and down, so the best epoch is not the last
    proc = run_job("train_mlp.py", "--num-workers", "2", "--epochs", "4", "--lr", "1.0", "--storage-path", str(tmp_path),
                   "--name", "ddp", "--mlflow", store, "--keep-best", "1", "--log-checkpoint", "best",
                   env={"RAY_ADDRESS": ray_address})
    assert proc.returncode == 0, proc.stderr[-3000:]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    epochs = pd.read_parquet(tmp_path / "ddp" / "metrics.parquet").query("kind == 'epoch'")
    history = client.get_metric_history(runs[0].info.run_id, "val_loss")
    assert [m.step for m in history] == list(epochs["global_step"])
    assert [m.value for m in history] == pytest.approx(list(epochs["val_loss"]), rel=1e-6)
    assert runs[0].data.params["num_workers"] == "2" and runs[0].data.tags["rayhpc.kind"] == "train"
    # Ray Train kept the best epoch's checkpoint by val_loss, and the latest
    kept = [c for c in (tmp_path / "ddp").glob("checkpoint_*") if c.is_dir()]
    steps = {json.loads((c / "progress.json").read_text())["global_step"] for c in kept}
    best, last = int(epochs.loc[epochs["val_loss"].idxmin(), "global_step"]), int(epochs["global_step"].iloc[-1])
    assert best != last and steps == {best, last}
    # its best weights as the run's artifact: they evaluate to the best epoch's val_loss
    got = Path(client.download_artifacts(runs[0].info.run_id, "checkpoint", str(tmp_path)))
    task = task_for("mlp", validate(TrainConfig, {}).data)
    assert plain_val_loss(load_trial(got, task), task) == pytest.approx(epochs["val_loss"].min(), rel=1e-4)


def test_wandb_offline_runs_are_written_with_no_network_one_per_trial(tmp_path):
    require("root (a network namespace with loopback only)", os.geteuid() == 0 and shutil.which("unshare") is not None)
    job = (f"ip link set lo up && exec {sys.executable} {ROOT / 'jobs' / 'tune_mlp.py'} --num-samples 6 --epochs 3 "
           f"--pack 3 --storage-path {tmp_path} --name offline --wandb lab-project")
    proc = subprocess.run(["unshare", "--net", "sh", "-c", job], capture_output=True, text=True, env=job_env(None),
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_parquet(tmp_path / "offline" / "results.parquet").set_index("trial_id")
    folders = sorted((tmp_path / "offline" / "wandb").glob("offline-run-*"))
    runs = {run["config"]["rayhpc"]["key"]: run for run in map(offline_run, folders)}
    assert sorted(runs) == sorted(table.index)
    for trial_id, row in table.iterrows():
        run = runs[trial_id]
        assert (run["project"], run["group"]) == ("lab-project", "offline")
        assert run["config"]["lr"] == row["config.lr"] and run["config"]["hidden"] == row["config.hidden"]
        steps = [h["_step"] for h in run["history"] if "val_loss" in h]
        assert steps == [1, 2, 3]
        assert run["history"][-1]["val_loss"] == pytest.approx(row["val_loss"], rel=1e-6)
        assert run["summary"]["status"] == row["status"] and run["exit_code"] == 0
    sync = subprocess.run(["unshare", "--net", sys.executable, "-m", "rayhpc", "sync", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, env=job_env(None), timeout=120)
    assert sync.returncode == 0 and f"{len(table)} offline W&B run(s)" in sync.stdout, sync.stderr
