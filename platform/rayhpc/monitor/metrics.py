"""The platform's metrics, recorded with `ray.util.metrics` and exported by Ray's own
Prometheus endpoint on every node (`ray start --metrics-export-port`; Ray lists the
endpoints in `prom_metrics_service_discovery.json` under its temp dir).

Ray prefixes every application metric with its fixed namespace, so `rayhpc_trial_val_loss`
is served as `ray_rayhpc_trial_val_loss`; the shipped scrape config
(`cluster_configs/monitoring/prometheus.yml`) renames it back to `rayhpc_*`.
Names carry their unit (`_seconds`, `_bytes`, `_per_second`), labels say whose value it is.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

# name -> (description, label names); the single list the Grafana dashboard test checks against
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "rayhpc_trial_val_loss": ("Validation loss of a trial at its latest epoch (the task's loss)", ("sweep", "trial_id", "node")),
    "rayhpc_trial_best_val_loss": ("Best validation loss of a trial so far", ("sweep", "trial_id", "node")),
    "rayhpc_trial_iterations": ("Epochs a trial has finished", ("sweep", "trial_id", "node")),
    "rayhpc_trial_val_metric": ("A task's validation metric of a trial at its latest epoch (e.g. accuracy)",
                                ("sweep", "trial_id", "node", "metric")),
    "rayhpc_trials": ("Trials of a sweep by state (pending, running, finished, early-stopped, diverged, error)",
                      ("sweep", "state")),
    "rayhpc_sweep_best_objective": ("Quantiles (0, 0.1, 0.5, 0.9, 1) of the best objective value (e.g. val_loss) "
                                    "over every trial of a sweep that reported one", ("sweep", "objective", "quantile")),
    "rayhpc_train_loss": ("Training loss over all ranks since the last report", ("run", "rank", "node")),
    "rayhpc_train_samples_per_second": ("Training samples this worker processed per second", ("run", "rank", "node")),
    "rayhpc_train_step_seconds": ("Mean time of one training step on this worker", ("run", "rank", "node")),
    "rayhpc_gpu_memory_allocated_bytes": ("GPU memory held by this worker's tensors", ("run", "rank", "node")),
    "rayhpc_train_val_metric": ("A task's validation metric at the latest epoch (e.g. accuracy)",
                                ("run", "rank", "node", "metric")),
    "rayhpc_ps_pull_seconds": ("Time a parameter-server worker's latest pull of every shard took (waits included)",
                               ("run", "worker", "node")),
    "rayhpc_ps_push_seconds": ("Time a parameter-server worker's latest push of its gradients took",
                               ("run", "worker", "node")),
    "rayhpc_ps_staleness_steps": ("Steps a parameter-server worker was ahead of the slowest worker at its latest pull",
                                  ("run", "worker", "node")),
    "rayhpc_ps_server_wait_seconds": ("How long the latest pull waited at this server (sync step or staleness bound)",
                                      ("run", "server", "node")),
    "rayhpc_ps_server_apply_seconds": ("Time this parameter server took to take in the latest gradient",
                                       ("run", "server", "node")),
    "rayhpc_ps_server_updates": ("Optimizer steps this parameter server has applied", ("run", "server", "node")),
}
TRIAL_STATES = ("pending", "running", "finished", "early-stopped", "diverged", "error")
# per-trial series: for every running trial and the SERIES_BEST best by the objective; every other trial
# is in the aggregates (`rayhpc_trials`, `rayhpc_sweep_best_objective`). A series no longer recorded ages
# out of Ray's exporter (Ray 2.60 keeps a gauge value for a TTL after its last record), so at 10,000
# trials Prometheus holds about (running + 20) x 3 series rather than 30,000.
SERIES_BEST = 20
QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


class _Gauges:
    """Gauges made on first use, in the process that records them (they do not pickle)."""

    def __init__(self, names: tuple[str, ...]):
        self._names, self._gauges = names, None

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        if self._gauges is None:
            from ray.util.metrics import Gauge  # Ray: only where a cluster is used (config checks and --help stay fast)

            self._gauges = {n: Gauge(n, description=METRICS[n][0], tag_keys=METRICS[n][1]) for n in self._names}
        self._gauges[name].set(float(value), tags=tags)

    def __getstate__(self):
        return {"_names": self._names, "_gauges": None}


def reported_rows(table) -> list[dict]:
    """The rows of trials that have reported, so their node is known: a trial gets no series before
    that, as its labels must never change. A missing node is None or, in a pandas string column
    (pandas 3), NaN, which is truthy: a check for falsy values let a "nan" series through, left
    behind (Ray keeps a gauge's last value for a while) once the trial reported its real node."""
    return [row for row in table.to_dict("records") if isinstance(row["node"], str) and row["node"]]


class SweepMetrics:
    """Per-trial and per-state gauges of one sweep, set by the driver from its trial table."""

    def __init__(self, sweep: str, objective: tuple[str, str] = ("val_loss", "min")):
        self.sweep, self.objective = sweep, objective
        self._gauges = _Gauges(("rayhpc_trial_val_loss", "rayhpc_trial_best_val_loss", "rayhpc_trial_iterations",
                                "rayhpc_trial_val_metric", "rayhpc_trials", "rayhpc_sweep_best_objective"))

    def record(self, table) -> None:
        """`table`: the sweep's results table (`rayhpc.tune.results.results_table`)."""
        metrics = [c for c in table.columns if c.startswith("val_") and c != "val_loss"]
        for row in self.series_rows(table):
            tags = {"sweep": self.sweep, "trial_id": str(row["trial_id"]), "node": str(row["node"])}
            values = [("rayhpc_trial_val_loss", row["val_loss"], tags),
                      ("rayhpc_trial_best_val_loss", row["best_val_loss"], tags),
                      ("rayhpc_trial_iterations", row["iterations"], tags)]
            values += [("rayhpc_trial_val_metric", row[c], {**tags, "metric": c.removeprefix("val_")}) for c in metrics]
            for name, value, labels in values:
                if value == value:  # NaN: nothing reported yet
                    self._gauges.set(name, value, labels)
        counts = table["status"].value_counts() if len(table) else {}
        for state in TRIAL_STATES:
            self._gauges.set("rayhpc_trials", counts.get(state, 0), {"sweep": self.sweep, "state": state})
        best = table[f"best_{self.objective[0]}"].dropna() if len(table) else []
        for q in QUANTILES if len(best) else ():
            self._gauges.set("rayhpc_sweep_best_objective", best.quantile(q),
                             {"sweep": self.sweep, "objective": self.objective[0], "quantile": f"{q:g}"})

    def series_rows(self, table) -> list[dict]:
        """The rows that get per-trial series: running trials and the `SERIES_BEST` best that reported."""
        column, mode = f"best_{self.objective[0]}", self.objective[1]
        reported = table[table["node"].map(lambda n: isinstance(n, str) and bool(n))] if len(table) else table
        if len(reported) <= SERIES_BEST:
            return reported_rows(reported)
        best = reported[column].dropna().sort_values(ascending=mode == "min").index[:SERIES_BEST]
        return reported_rows(reported[(reported["status"] == "running") | reported.index.isin(best)])


@dataclass
class WorkerMetrics:
    """The gauges of one training worker (one rank)."""

    run: str
    rank: int

    def __post_init__(self):
        self._gauges = _Gauges(("rayhpc_train_loss", "rayhpc_train_samples_per_second", "rayhpc_train_step_seconds",
                                "rayhpc_gpu_memory_allocated_bytes", "rayhpc_train_val_metric"))
        self._tags = {"run": self.run, "rank": str(self.rank), "node": socket.gethostname()}

    def record(self, loss: float | None, samples_per_second: float, step_seconds: float, device=None,
               val_metrics: dict[str, float] | None = None) -> None:
        """`loss`: None where this rank does not compute it (a pipeline stage before the last);
        `val_metrics`: the task's validation metrics (`val_<name>`) when this report has them."""
        if loss is not None:
            self._gauges.set("rayhpc_train_loss", loss, self._tags)
        self._gauges.set("rayhpc_train_samples_per_second", samples_per_second, self._tags)
        self._gauges.set("rayhpc_train_step_seconds", step_seconds, self._tags)
        for name, value in (val_metrics or {}).items():
            self._gauges.set("rayhpc_train_val_metric", value, {**self._tags, "metric": name.removeprefix("val_")})
        if device is not None and device.type == "cuda":
            import torch  # torch: about 1.5 s to import, only where something trains

            self._gauges.set("rayhpc_gpu_memory_allocated_bytes", torch.cuda.memory_allocated(device), self._tags)


class PSMetrics:
    """The gauges of one parameter-server worker or server (`role`: "worker" or "server")."""

    def __init__(self, run: str, role: str, index: int):
        names = (("rayhpc_ps_pull_seconds", "rayhpc_ps_push_seconds", "rayhpc_ps_staleness_steps") if role == "worker"
                 else ("rayhpc_ps_server_wait_seconds", "rayhpc_ps_server_apply_seconds", "rayhpc_ps_server_updates"))
        self._gauges, self._names = _Gauges(names), names
        self._tags = {"run": run, role: str(index), "node": socket.gethostname()}

    def set_worker(self, pull_seconds: float, push_seconds: float, staleness: int) -> None:
        for name, value in zip(self._names, (pull_seconds, push_seconds, staleness)):
            self._gauges.set(name, value, self._tags)

    def set_server(self, wait_seconds: float, apply_seconds: float, updates: int) -> None:
        self.set_worker(wait_seconds, apply_seconds, updates)  # the same three-gauge write, the server's names
