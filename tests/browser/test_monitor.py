"""Monitoring during a real sweep on the shared local Ray: the metrics endpoint, a real
Prometheus with the shipped scrape config, the dashboard's token check (HTTP API and a real
headless Chromium), and `rayhpc status` reading the sweep from the cluster."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from helpers import require, scrape
from rayhpc.monitor.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("RAYHPC_TEST_ARTIFACTS", ROOT / "test-artifacts"))
SWEEP = "monitored"
# a user's task with a validation metric: the synthetic teacher task, its mean absolute error as the metric
TASK = """
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from rayhpc.data import SyntheticTask, synthetic_tensors


class Regression:
    val_fraction = 0.2

    def model(self, hp):
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def data(self, hp):
        return TensorDataset(*synthetic_tensors(SyntheticTask())), None

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def metrics(self, model, batch):
        x, y = batch
        return {"abs_error": (model(x) - y).abs().mean()}
"""


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("task") / "regression.py"
    path.write_text(TASK)
    return f"{path}:Regression"


def token() -> str:
    """The token of the suite's local Ray (each cluster the platform starts has its own, in its folder)."""
    from rayhpc.cluster import local_token

    return local_token().read_text().strip()




def iterations(cluster: dict) -> dict[str, float]:
    return {s.labels["trial_id"]: s.value for s in scrape(cluster).get("rayhpc_trial_iterations", [])
            if s.labels["sweep"] == SWEEP}


def test_training_workers_export_loss_throughput_and_step_time_per_rank(ray_cluster, task, tmp_path):
    """First in this module: the training job needs the CPUs that the module's sweep takes later."""
    job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "train_mlp.py"), "--address", ray_cluster["gcs_address"],
                            "--task", task, "--name", "watched", "--num-workers", "2", "--epochs", "1000",
                            "--metrics-every-steps", "5", "--storage-path", str(tmp_path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    try:
        deadline, ranks, metric = time.monotonic() + 150, {}, {}
        while len(ranks) < 2 or len(metric) < 2:
            assert job.poll() is None, "the training job ended early"
            assert time.monotonic() < deadline, f"no per-rank training metrics within 150 s: {ranks} {metric}"
            time.sleep(2)
            samples = scrape(ray_cluster)
            ranks = {s.labels["rank"]: s for s in samples.get("rayhpc_train_samples_per_second", [])
                     if s.labels["run"] == "watched"}
            # the task's validation metric, after each epoch, on every rank
            metric = {s.labels["rank"]: s.value for s in samples.get("rayhpc_train_val_metric", [])
                      if s.labels["run"] == "watched" and s.labels["metric"] == "abs_error"}
        loss = next(s.value for s in samples["rayhpc_train_loss"] if s.labels["run"] == "watched"
                    and s.labels["rank"] == "0")
        # every rank validates the whole split with the same weights: each rank's metric is one of rank 0's
        assert_each_was_recorded([("loss", loss), *(("abs_error", v) for v in metric.values())],
                                 lambda: recorded_by_the_run(tmp_path / "watched" / "metrics.parquet"), rel_tol=1e-6,
                                 timeout_s=20, what="exported values the run never recorded")
    finally:
        job.send_signal(signal.SIGINT)
        job.wait(timeout=60)
    assert set(ranks) == {"0", "1"} and all(s.value > 0 for s in ranks.values())
    for name in ("rayhpc_train_loss", "rayhpc_train_step_seconds"):
        mine = {s.labels["rank"]: s.value for s in samples[name] if s.labels["run"] == "watched"}
        assert set(mine) == {"0", "1"} and all(v > 0 for v in mine.values()), (name, mine)
    assert "rayhpc_gpu_memory_allocated_bytes" not in samples  # only where there is a GPU


def recorded_by_the_run(path: Path) -> dict[str, list[float]]:
    """The run's own record (rank 0's reports, in its metrics.parquet) of its loss and validation metric."""
    table = pd.read_parquet(path) if path.exists() else pd.DataFrame()
    # read again until it holds them: the first rows written may be step rows, before any validation's column
    return {"loss": table.get("loss", pd.Series(dtype=float)).dropna().tolist(),
            "abs_error": table.get("val_abs_error", pd.Series(dtype=float)).dropna().tolist()}


def assert_each_was_recorded(exported: list, read_recorded, rel_tol: float, timeout_s: float, what: str) -> None:
    """Each (key, value) in `exported` is one of the values `read_recorded()` lists under its key; the
    record is read again for up to `timeout_s`, as it may trail the gauges by a report."""
    deadline = time.monotonic() + timeout_s
    while True:
        recorded = read_recorded()
        missing = [(key, value) for key, value in exported
                   if not any(math.isclose(value, r, rel_tol=rel_tol) for r in recorded.get(key, []))]
        if not missing:
            return
        assert time.monotonic() < deadline, f"{what}: {missing}; recorded (last 3): " \
            f"{ {k: v[-3:] for k, v in recorded.items()} }"
        time.sleep(1)


@pytest.fixture(scope="module")
def sweep(ray_cluster, task, tmp_path_factory):
    """A sweep of a task with a metric, running on the shared cluster for the whole module (stopped like
    Ctrl-C at the end)."""
    out = tmp_path_factory.mktemp("monitor")
    log = open(out / "sweep.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--address", ray_cluster["gcs_address"],
                             "--task", task, "--name", SWEEP, "--num-samples", "4", "--epochs", "100000",
                             "--storage-path", str(out)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(iterations(ray_cluster)) < 4:  # every trial has reported at least once
        assert proc.poll() is None, (out / "sweep.log").read_text()
        assert time.monotonic() < deadline, "no trial metrics within 120 s:\n" + (out / "sweep.log").read_text()
        time.sleep(1)
    yield out
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_the_metrics_endpoint_has_the_platforms_metrics_and_they_move(ray_cluster, sweep):
    before, deadline = iterations(ray_cluster), time.monotonic() + 40
    while True:  # Ray's agents export every 10 s
        time.sleep(2)
        after = iterations(ray_cluster)
        if all(after[t] > before[t] for t in before):
            break
        assert time.monotonic() < deadline, f"trial iterations did not move in 40 s: {before} -> {after}"
    samples = scrape(ray_cluster)
    for name in ("rayhpc_trial_val_loss", "rayhpc_trial_best_val_loss", "rayhpc_trial_iterations",
                 "rayhpc_trial_val_metric"):
        mine = [s for s in samples[name] if s.labels["sweep"] == SWEEP]
        # the message names each series by the labels that tell series apart (a CI run once saw 6 here)
        common = set.intersection(*(set(s.labels.items()) for s in mine)) if mine else set()
        assert len(mine) == 4 and {s.labels["node"] for s in mine} == {socket.gethostname()}, "; ".join(
            [name] + [str(dict(sorted(set(s.labels.items()) - common)) | {"value": s.value}) for s in mine])
        assert all(set(METRICS[name][1]) <= set(s.labels) for s in mine)
    assert_series_are_reported_values(samples, ray_cluster)
    assert {s.labels["metric"] for s in samples["rayhpc_trial_val_metric"] if s.labels["sweep"] == SWEEP} == \
        {"abs_error"}
    states = {s.labels["state"]: s.value for s in samples["rayhpc_trials"] if s.labels["sweep"] == SWEEP}
    assert states["running"] == 4 and states["error"] == 0, states


# each per-trial series and the value of Tune's own result (result.json) it must be one of
REPORTED = {"rayhpc_trial_val_loss": "val_loss", "rayhpc_trial_best_val_loss": "best_val_loss",
            "rayhpc_trial_iterations": "epoch", "rayhpc_trial_val_metric": "val_abs_error"}


def reported(cluster: dict) -> dict[tuple[str, str], list[float]]:
    """Every value each trial of the sweep reported so far, by (results-table trial id, key), read from the
    result.json lines Tune's own logger writes on the driver (in the cluster's session folder), not
    through the platform's metrics code: a packed trial reports its members under "members"."""
    found: dict[tuple[str, str], list[float]] = {}
    for path in Path(cluster["session_dir"]).glob(f"artifacts/*/{SWEEP}/driver_artifacts/*/result.json"):
        for line in path.read_text().splitlines():
            try:
                result = json.loads(line)
            except ValueError:
                continue  # a line being written
            members = result.get("members")  # each name's values, one per member
            n = len(members["val_loss"]) if members else 1
            for j in range(n):
                values = {k: v[j] for k, v in members.items()} if members else result
                trial = result["trial_id"] if n == 1 else f"{result['trial_id']}-{j}"
                for key in REPORTED.values():
                    value = result["epoch"] if key == "epoch" else values.get(key)
                    if value is not None:
                        found.setdefault((trial, key), []).append(value)
    return found


def assert_series_are_reported_values(samples: dict, cluster: dict) -> None:
    """Each exported series holds a value its trial reported (a gauge set to anything else, or to another
    trial's value, fails); Tune's result file may trail the gauges by a moment."""
    exported = [((s.labels["trial_id"], REPORTED[name]), s.value) for name in REPORTED for s in samples[name]
                if s.labels["sweep"] == SWEEP]
    assert_each_was_recorded(exported, lambda: reported(cluster), rel_tol=1e-9, timeout_s=30,
                             what="series whose value their trial never reported")


def test_prometheus_scrapes_the_trial_loss_with_the_shipped_config(ray_cluster, sweep, tmp_path):
    """The shipped config beside a `targets/` folder, where the cluster's service-discovery file is linked
    as the README says (the config reads no shared path itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    require("Prometheus (apt-get install prometheus)", shutil.which("prometheus") is not None)
    config = tmp_path / "prometheus.yml"
    shutil.copy(ROOT / "cluster_configs" / "monitoring" / "prometheus.yml", config)
    (tmp_path / "targets").mkdir()
    discovery = Path(ray_cluster["session_dir"]).parent / "prom_metrics_service_discovery.json"
    (tmp_path / "targets" / "local.json").symlink_to(discovery)
    server = subprocess.Popen([shutil.which("prometheus") or "prometheus", f"--config.file={config}",
                               f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    query = urllib.parse.urlencode({"query": f'rayhpc_trial_val_loss{{sweep="{SWEEP}"}}'})
    try:
        deadline, series = time.monotonic() + 90, []
        while len(series) < 4:
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, f"Prometheus has no trial-loss series after 90 s: {series}"
            time.sleep(2)
            try:
                answer = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=5))
            except (urllib.error.URLError, ConnectionError):
                continue  # not listening yet
            series = answer["data"]["result"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert {s["metric"]["__name__"] for s in series} == {"rayhpc_trial_val_loss"}  # renamed from ray_rayhpc_*
    assert all(0 < float(s["value"][1]) < 1 for s in series)


def dashboard_status(url: str, bearer: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {bearer}"} if bearer else {})
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_dashboard_api_answers_with_the_token_and_refuses_without(ray_cluster, sweep):
    url = f"http://{ray_cluster['webui_url']}/api/jobs/"
    assert ray_cluster["webui_url"].startswith("127.0.0.1:")  # the head's loopback
    assert dashboard_status(url, None) == 401
    assert dashboard_status(url, "not-the-token") == 403
    assert dashboard_status(url, token()) == 200


def test_status_reads_the_running_sweep_from_the_cluster(ray_cluster, sweep):
    proc = subprocess.run([str(Path(sys.executable).with_name("rayhpc")), "status", "--address", ray_cluster["gcs_address"]],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"cluster {ray_cluster['gcs_address']}: 1 node(s); in use: 2/2 CPU" in out, out
    assert "tune_mlp.py" in out and f"sweep {SWEEP}: 4 trials (4 running)" in out, out
    rows = [line.split() for line in out.splitlines()[out.splitlines().index(f"sweep {SWEEP}: 4 trials (4 running)") + 2:]]
    assert len(rows) == 4 and all(r[1] == "running" and int(r[-3]) > 0 for r in rows), out


def test_a_browser_signs_in_with_the_token_and_sees_the_node(ray_cluster, sweep):
    from playwright.sync_api import sync_playwright

    require("Chromium (apt-get install chromium)", shutil.which("chromium") is not None)

    url = f"http://{ray_cluster['webui_url']}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        # Debian's Chromium; --no-sandbox because CI runs as root
        browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)
        # what the docs tell users: paste the cluster's token (the file the job's first line names) into the box
        page.get_by_placeholder("Enter your authentication token").fill(token())
        page.keyboard.press("Enter")
        page.get_by_text("Authentication Token Required").wait_for(state="hidden", timeout=30_000)
        page.goto(f"{url}/#/cluster")
        page.get_by_text(ray_cluster["node_ip_address"]).first.wait_for(timeout=60_000)
        assert page.get_by_text(socket.gethostname(), exact=True).count() >= 1  # the node's row
        page.screenshot(path=str(ARTIFACTS / "dashboard-cluster.png"), full_page=True)
        browser.close()
    assert (ARTIFACTS / "dashboard-cluster.png").stat().st_size > 10_000


def test_the_grafana_dashboard_plots_every_platform_metric_and_nothing_else():
    dashboard = json.loads((ROOT / "cluster_configs" / "monitoring" / "grafana-rayhpc.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    plotted = {expr.split("{")[0] for expr in exprs}
    assert plotted == set(METRICS), plotted ^ set(METRICS)


def test_a_trial_that_has_not_reported_gets_no_series():
    """The trial table as the sweep builds it (pandas makes a missing node NaN in a string column):
    only the trial that reported, with its node, may get gauges; a CI run once saw 6 iteration
    series for 4 trials, two of them labelled node="nan" from before those trials reported."""
    from types import SimpleNamespace

    from rayhpc.monitor.metrics import reported_rows
    from rayhpc.tune.results import results_table

    def trial(trial_id, last_result):
        return SimpleNamespace(trial_id=trial_id, config={"lr": 0.1}, last_result=last_result, status="RUNNING")

    reported = trial("a", {"epoch": 3, "val_loss": 0.5, "node": "node7", "train_seconds": 1.0})
    table = results_table([reported, trial("b", {})], None, 10, ["lr"], ["val_loss"])
    assert [(r["trial_id"], r["node"], r["iterations"]) for r in reported_rows(table)] == [("a", "node7", 3)]


def test_a_large_sweep_exports_series_for_its_running_and_best_trials_and_quantiles_for_all(ray_cluster):
    """200 trials, 5 of them running: per-trial series for those 5 and the 20 best only (not 200), and
    the quantiles of every trial's best objective, scraped from the node's real endpoint."""
    import numpy as np
    import pandas as pd

    from rayhpc.monitor.metrics import QUANTILES, SERIES_BEST, SweepMetrics

    rng = np.random.default_rng(0)
    best = rng.uniform(0.01, 1.0, 200)
    table = pd.DataFrame({"trial_id": [f"t{i:03d}" for i in range(200)],
                          "status": ["running"] * 5 + ["finished"] * 195, "val_loss": best + 0.01,
                          "best_val_loss": best, "iterations": 10, "node": "node1"})
    SweepMetrics("large").record(table)
    expected = {f"t{i:03d}" for i in range(5)} | set(table.sort_values("best_val_loss")["trial_id"][:SERIES_BEST])
    deadline = time.monotonic() + 40
    while not [s for s in scrape(ray_cluster).get("rayhpc_sweep_best_objective", []) if s.labels["sweep"] == "large"]:
        assert time.monotonic() < deadline, "no series of the large sweep within 40 s (Ray's agents export every 10 s)"
        time.sleep(2)
    samples = scrape(ray_cluster)
    series = {s.labels["trial_id"] for s in samples["rayhpc_trial_best_val_loss"] if s.labels["sweep"] == "large"}
    assert series == expected and len(series) <= 5 + SERIES_BEST, sorted(series ^ expected)
    quantiles = {float(s.labels["quantile"]): s.value for s in samples["rayhpc_sweep_best_objective"]
                 if s.labels["sweep"] == "large" and s.labels["objective"] == "val_loss"}
    assert sorted(quantiles) == list(QUANTILES)
    np.testing.assert_allclose([quantiles[q] for q in QUANTILES], np.quantile(best, QUANTILES), rtol=1e-6)
    states = {s.labels["state"]: s.value for s in samples["rayhpc_trials"] if s.labels["sweep"] == "large"}
    assert states["running"] == 5 and states["finished"] == 195
