"""The sweep board: a small actor on the cluster holding a running sweep's trial table, so that
`rayhpc status --address ...` reads it from the cluster (from any machine with the token),
not from the driver's local files. It is owned by the sweep's driver and ends with it.
"""

from __future__ import annotations

import math
import time

import pandas as pd
import ray
from ray.tune import Callback

from rayhpc.monitor.metrics import SERIES_BEST, SweepMetrics

NAMESPACE = "rayhpc"
PREFIX = "sweep:"


class SweepBoard:
    """Actor: the latest trial table of one sweep."""

    def __init__(self, sweep: str):
        self.sweep, self.rows, self.counts, self.updated = sweep, [], {}, None

    def update(self, rows: list[dict], counts: dict[str, int]) -> None:
        """`rows`: the trials worth a line (running, and the best); `counts`: every trial, by state."""
        self.rows, self.counts, self.updated = rows, counts, time.time()

    def read(self) -> dict:
        return {"sweep": self.sweep, "rows": self.rows, "counts": self.counts, "updated": self.updated}


def open_board(sweep: str):
    """This sweep's board actor, created if absent (0 CPUs: it never takes a trial's slot). Named by the
    sweep and its driver's Ray job: two sweeps of one name (in two folders) on one cluster have a board each."""
    actor = ray.remote(num_cpus=0)(SweepBoard)
    name = f"{PREFIX}{sweep}:{ray.get_runtime_context().get_job_id()}"
    return actor.options(name=name, namespace=NAMESPACE, get_if_exists=True).remote(sweep)


def read_boards() -> list[dict]:
    """The tables of every sweep running on the connected cluster."""
    boards = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(PREFIX):
            try:
                boards.append(ray.get(ray.get_actor(entry["name"], namespace=NAMESPACE).read.remote(), timeout=10))
            except (ray.exceptions.RayActorError, ValueError, ray.exceptions.GetTimeoutError):
                continue  # its sweep ended while we looked
    return boards


class SweepMonitor(Callback):
    """Tune callback in the driver: every `interval_s`, the trial table goes to the sweep's
    Prometheus gauges and to its board."""

    def __init__(self, recorder, sweep: str, interval_s: float = 2.0):
        self.recorder, self.sweep, self.interval_s = recorder, sweep, interval_s
        self._metrics, self._board, self._last = SweepMetrics(sweep, recorder.objective), None, -math.inf

    def on_step_end(self, iteration, trials, **info):
        if time.monotonic() - self._last >= self.interval_s:
            self._publish(trials)

    def on_experiment_end(self, trials, **info):
        self._publish(trials)  # the final gauges
        if self._board is not None:  # the sweep is over: `rayhpc status` lists running sweeps only

            ray.kill(self._board)
            self._board = None

    def _publish(self, trials) -> None:
        self._last = time.monotonic()
        self.recorder.trials = trials
        table = self.recorder.table()
        if table.empty:
            return
        self._metrics.record(table)
        if self._board is None:
            self._board = open_board(self.sweep)
        # a board of every trial would be 10,000 rows at scale: it shows those with series, and counts
        shown = table if len(table) <= SERIES_BEST else pd.DataFrame(self._metrics.series_rows(table))
        self._board.update.remote(shown.to_dict("records"), table["status"].value_counts().to_dict())

    def __getstate__(self):  # pickled with the tuner for --resume: no actor handle, no gauges
        return {**self.__dict__, "_board": None, "_last": -math.inf}
