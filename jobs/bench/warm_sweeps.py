"""The distributed-trials row of `jobs/bench_sweep.py --distributed`: a sweep of trials of N workers on
warm worker groups.

Its columns: the sweep's wall (from `run_sweep` to its table), the trials' summed in-trial training
seconds (`train_seconds`: the epochs' training windows, without validation, checkpoints or
start-up), wall / (that sum / slots), and where the rest went: the first trial of each slot
(start-up included) and, for every later trial, its overhead inside the trial (its span minus its
training) and the gap before it (from the slot's previous trial ending to it starting).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from ray.tune import Callback

from rayhpc.tune.config import SweepConfig


class TrialTimes(Callback):
    """Unix times each trial started and ended, seen by the sweep's driver."""

    def __init__(self):
        self.start: dict[str, float] = {}
        self.end: dict[str, float] = {}

    def on_trial_start(self, iteration, trials, trial, **info):
        self.start.setdefault(trial.trial_id, time.time())

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.end[trial.trial_id] = time.time()


def distributed_row(runner: str, trials: int, epochs: int, workers: int, storage: Path) -> dict:
    from rayhpc.tune.sweep import run_sweep

    cfg = SweepConfig(name=runner, storage_path=storage, num_samples=trials, epochs=epochs, workers_per_trial=workers)
    times = TrialTimes()
    began = time.time()
    table = run_sweep(cfg, callbacks=(times,))
    wall = time.time() - began
    train = dict(zip(table["trial_id"], table["train_seconds"]))
    order = sorted(times.end, key=times.end.get)
    slots = max(1, max(sum(times.start[t] <= times.start[u] < times.end[t] for u in order) for t in order))
    first, later = order[:slots], order[slots:]
    inside = [times.end[t] - times.start[t] - train[t] for t in later]
    gaps = [times.start[t] - max((times.end[u] for u in order if times.end[u] <= times.start[t]), default=began)
            for t in later]
    return {"runner": runner, "trials": len(table), "slots": slots, "wall": wall, "train": sum(train.values()),
            "first": statistics.mean(times.end[t] - began - train[t] for t in first),
            "inside": statistics.mean(inside) if inside else float("nan"),
            "gap": statistics.mean(gaps) if gaps else float("nan"),
            "finished": int((table["status"] == "finished").sum()), "best": float(table["best_val_loss"].min())}


HEADER = (f"{'path':8s} {'trials':>6s} {'slots':>5s} {'wall':>7s} {'in-trial':>9s} {'wall/(in-trial/slots)':>22s} "
          f"{'first trial overhead':>21s} {'later: in trial + gap = overhead':>33s} {'best val_loss':>14s}")


def print_row(r: dict) -> None:
    ratio = r["wall"] / (r["train"] / r["slots"])
    later = f"{r['inside']:.2f}s + {r['gap']:.2f}s = {r['inside'] + r['gap']:.2f}s"
    print(f"{r['runner']:8s} {r['finished']:>6d} {r['slots']:>5d} {r['wall']:6.1f}s {r['train']:8.1f}s {ratio:21.2f}x "
          f"{r['first']:20.1f}s {later:>33s} {r['best']:14.5f}", flush=True)
