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
    "rayhpc_trial_val_loss": ("Validation loss of a trial at its latest epoch (MSE)", ("sweep", "trial_id", "node")),
    "rayhpc_trial_best_val_loss": ("Best validation loss of a trial so far (MSE)", ("sweep", "trial_id", "node")),
    "rayhpc_trial_iterations": ("Epochs a trial has finished", ("sweep", "trial_id", "node")),
    "rayhpc_trials": ("Trials of a sweep by state (pending, running, finished, early-stopped, error)",
                      ("sweep", "state")),
    "rayhpc_train_loss": ("Training loss over all ranks since the last report (MSE)", ("run", "rank", "node")),
    "rayhpc_train_samples_per_second": ("Training samples this worker processed per second", ("run", "rank", "node")),
    "rayhpc_train_step_seconds": ("Mean time of one training step on this worker", ("run", "rank", "node")),
    "rayhpc_gpu_memory_allocated_bytes": ("GPU memory held by this worker's tensors", ("run", "rank", "node")),
}
TRIAL_STATES = ("pending", "running", "finished", "early-stopped", "error")


class _Gauges:
    """Gauges made on first use, in the process that records them (they do not pickle)."""

    def __init__(self, names: tuple[str, ...]):
        self._names, self._gauges = names, None

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        if self._gauges is None:
            from ray.util.metrics import Gauge

            self._gauges = {n: Gauge(n, description=METRICS[n][0], tag_keys=METRICS[n][1]) for n in self._names}
        self._gauges[name].set(float(value), tags=tags)

    def __getstate__(self):
        return {"_names": self._names, "_gauges": None}


class SweepMetrics:
    """Per-trial and per-state gauges of one sweep, set by the driver from its trial table."""

    def __init__(self, sweep: str):
        self.sweep = sweep
        self._gauges = _Gauges(("rayhpc_trial_val_loss", "rayhpc_trial_best_val_loss", "rayhpc_trial_iterations",
                                "rayhpc_trials"))

    def record(self, table) -> None:
        """`table`: the sweep's results table (`rayhpc.tune.results.results_table`)."""
        for row in table.itertuples(index=False):
            if not row.node:  # not reported yet: no series until its node is known (labels never change)
                continue
            tags = {"sweep": self.sweep, "trial_id": str(row.trial_id), "node": str(row.node)}
            for name, value in (("rayhpc_trial_val_loss", row.val_loss),
                                ("rayhpc_trial_best_val_loss", row.best_val_loss),
                                ("rayhpc_trial_iterations", row.iterations)):
                if value == value:  # NaN: nothing reported yet
                    self._gauges.set(name, value, tags)
        counts = table["status"].value_counts() if len(table) else {}
        for state in TRIAL_STATES:
            self._gauges.set("rayhpc_trials", counts.get(state, 0), {"sweep": self.sweep, "state": state})


@dataclass
class WorkerMetrics:
    """The gauges of one training worker (one rank)."""

    run: str
    rank: int

    def __post_init__(self):
        self._gauges = _Gauges(("rayhpc_train_loss", "rayhpc_train_samples_per_second", "rayhpc_train_step_seconds",
                                "rayhpc_gpu_memory_allocated_bytes"))
        self._tags = {"run": self.run, "rank": str(self.rank), "node": socket.gethostname()}

    def record(self, loss: float | None, samples_per_second: float, step_seconds: float, device=None) -> None:
        """`loss`: None where this rank does not compute it (a pipeline stage before the last)."""
        if loss is not None:
            self._gauges.set("rayhpc_train_loss", loss, self._tags)
        self._gauges.set("rayhpc_train_samples_per_second", samples_per_second, self._tags)
        self._gauges.set("rayhpc_train_step_seconds", step_seconds, self._tags)
        if device is not None and device.type == "cuda":
            import torch

            self._gauges.set("rayhpc_gpu_memory_allocated_bytes", torch.cuda.memory_allocated(device), self._tags)
