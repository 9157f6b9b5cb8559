"""Live progress of a sweep: one line whenever the picture changes (at most once a second)."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

from ray.tune import Callback

from rayhpc.tune.results import ResultsRecorder

log = logging.getLogger(__name__)


class ProgressPrinter(Callback):
    """Prints trial counts by state and the best trial so far, read from the results recorder."""

    def __init__(self, recorder: ResultsRecorder, min_interval_s: float = 1.0, heartbeat_s: float = 15.0):
        self.recorder = recorder
        self.min_interval_s, self.heartbeat_s = min_interval_s, heartbeat_s
        self.started = time.monotonic()
        self._last_line, self._last_time = "", -math.inf

    def setup(self, **info):
        self.started = time.monotonic()  # also when restored from a saved sweep

    def on_step_end(self, iteration, trials, **info):
        self.recorder.trials = trials
        now = time.monotonic()
        if now - self._last_time < self.min_interval_s:
            return
        line = self.summary()
        if line != self._last_line or now - self._last_time >= self.heartbeat_s:
            self._print(line, now)

    def on_experiment_end(self, trials, **info):
        self.recorder.trials = trials
        self._print(self.summary(), time.monotonic())

    def summary(self) -> str:
        table = self.recorder.table()
        if table.empty:
            return "waiting for trials"
        counts = Counter(table["status"])
        states = ", ".join(f"{counts[s]} {s}" for s in ("pending", "running", "finished", "early-stopped", "error")
                           + tuple(s for s in ("diverged", "interrupted") if counts[s]))
        line = f"{len(table)} trials: {states}"
        name, mode = self.recorder.objective
        done = table.dropna(subset=[f"best_{name}"])
        if not done.empty:
            column = done[f"best_{name}"]
            best = done.loc[column.idxmin() if mode == "min" else column.idxmax()]
            params = ", ".join(f"{c.removeprefix('config.')}={_fmt(best[c])}" for c in table.columns if c.startswith("config."))
            line += f" | best {name} {best[f'best_{name}']:.4g} ({params})"
        return line

    def _print(self, line: str, now: float) -> None:
        log.info(f"[{now - self.started:7.1f}s] {line}")
        self._last_line, self._last_time = line, now


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
