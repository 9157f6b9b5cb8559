"""The sweep's results table: one row per trial, kept up to date in `results.parquet`."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd
from ray.tune import Callback

from rayhpc.tune.trainable import members_of

RESULTS_FILE = "results.parquet"
_STATUS = {"TERMINATED": "finished", "ERROR": "error", "RUNNING": "running", "PENDING": "pending", "PAUSED": "pending"}


def value_columns(metric_names: tuple[str, ...], objective: tuple[str, str]) -> list[str]:
    """The reported values that become columns: losses, the task's metrics, the best objective."""
    columns = ["val_loss", "best_val_loss", *(f"val_{m}" for m in metric_names)]
    return columns + ([f"best_{objective[0]}"] if f"best_{objective[0]}" not in columns else [])


def trial_rows(trial, packs: list[list[dict]] | None, epochs: int, searched: list[str],
               columns: list[str]) -> list[dict]:
    """One row per member of a Tune trial (a pack of one is a plain trial)."""
    members = members_of(trial.config, packs)
    last = trial.last_result or {}
    per_member = last.get("members", {})
    iterations = int(last.get("epoch", 0))
    status = _STATUS.get(trial.status, trial.status.lower())
    if status == "finished" and iterations < epochs:
        status = "early-stopped"
    error = _error_line(trial) if status == "error" else None
    rows = []
    for j, hp in enumerate(members):
        # a trial of one member may report its metrics at the top level (Tune over Train does)
        m = per_member.get(str(j)) or (last if len(members) == 1 else {})
        stopped = m.get("stopped_epoch")  # ASHA stopped this member of a pack
        rows.append({
            "trial_id": trial.trial_id if len(members) == 1 else f"{trial.trial_id}-{j}",
            "status": "early-stopped" if stopped else status,
            **{f"config.{p}": m.get(f"config.{p}", hp[p]) for p in searched},  # PBT reports changed ones
            **{c: m.get(c, math.nan) for c in columns},
            "iterations": stopped or iterations,
            "train_seconds": last.get("train_seconds", math.nan),
            "node": last.get("node"),
            "pack_size": len(members),
            "error": error,
        })
    return rows


def results_table(trials, packs, epochs: int, searched: list[str], columns: list[str]) -> pd.DataFrame:
    rows = [row for t in trials for row in trial_rows(t, packs, epochs, searched, columns)]
    return pd.DataFrame(rows)


def write_results(table: pd.DataFrame, exp_dir: Path) -> Path:
    path = exp_dir / RESULTS_FILE
    tmp = path.with_suffix(".parquet.tmp")
    table.to_parquet(tmp, index=False)
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def _error_line(trial) -> str | None:
    """The last line of the trial's error trace (the exception and its message)."""
    try:
        text = Path(trial.error_file).read_text() if trial.error_file else ""
    except OSError:
        return "error (trace unavailable)"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


class ResultsRecorder(Callback):
    """Keeps the latest view of every trial and rewrites `results.parquet` as trials end.

    Writing is throttled, so a sweep of thousands of trials does not spend its
    driver on Parquet; the final table is written once more at the end.
    """

    def __init__(self, exp_dir: Path, packs, epochs: int, searched: list[str], info, min_interval_s: float = 5.0):
        """`info`: the task's `TaskInfo` (its metric names and objective make columns)."""
        self.exp_dir, self.packs, self.epochs, self.searched = exp_dir, packs, epochs, searched
        self.objective = info.objective
        self.columns = value_columns(info.metric_names, info.objective)
        self.min_interval_s = min_interval_s
        self.trials: list = []
        self._last_write = -math.inf
        self._dirty = False

    def table(self) -> pd.DataFrame:
        return results_table(self.trials, self.packs, self.epochs, self.searched, self.columns)

    def write(self) -> Path:
        self._dirty = False
        self._last_write = time.monotonic()
        return write_results(self.table(), self.exp_dir)

    def on_step_end(self, iteration, trials, **info):
        self.trials = trials
        if self._dirty and time.monotonic() - self._last_write >= self.min_interval_s:
            self.write()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.trials, self._dirty = trials, True

    def on_trial_error(self, iteration, trials, trial, **info):
        self.trials, self._dirty = trials, True

    def on_experiment_end(self, trials, **info):
        self.trials = trials
        self.write()


def format_best(table: pd.DataFrame, objective: tuple[str, str] = ("val_loss", "min"), k: int = 5) -> str:
    """The `k` best trials by their objective (name, "min" or "max"), as a printable table."""
    column = f"best_{objective[0]}"
    done = table.dropna(subset=[column]).sort_values(column, ascending=objective[1] == "min").head(k)
    if done.empty:
        return f"no trial reported {column.removeprefix('best_')}"
    values = [c for c in table.columns if c.startswith(("val_", "best_"))]
    cols = ["trial_id", "status", *[c for c in table.columns if c.startswith("config.")], *values,
            "iterations", "train_seconds", "node"]
    shown = done[cols].rename(columns=lambda c: c.removeprefix("config."))
    return f"best {len(done)} of {len(table)} trials by {column}:\n" + shown.to_string(
        index=False, float_format=lambda v: f"{v:.4g}")
