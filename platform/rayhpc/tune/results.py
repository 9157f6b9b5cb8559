"""The sweep's results table: one row per trial. While the sweep runs, the rows of the trials that
ended go to `results.parts/` in batches, each file written once (a 10,000-trial sweep never rewrites
its whole table as trials end); when it ends, the whole table is written once as `results.parquet`
and the parts are removed. `read_results` reads whichever is there."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import pandas as pd
from ray.tune import Callback

from rayhpc import interrupt
from rayhpc.monitor.startup import mark
from rayhpc.private import replace_whole
from rayhpc.tune.objectives import MEASURED, mark_front
from rayhpc.tune.trainable import member_values, members_of

RESULTS_FILE = "results.parquet"
# before a sweep's first result: each phase ends at its key's time in a trial's first report (`trainable`)
TRIAL_PHASES = {"trial process": "trial_process_time", "trial set-up (Ray Tune, imports)": "trial_entered_time",
                "trial data and model": "trial_ready_time"}
SUMMARY_FILE = "summary.parquet"  # repeats: one row per configuration
# Student's t, 97.5% quantile, by degrees of freedom (1-30): the 95% interval of a mean of n runs is
# mean +- t(n-1) * std / sqrt(n); beyond 30 the normal's 1.96 is within 2%
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
PARTS_DIR = "results.parts"
_STATUS = {"TERMINATED": "finished", "ERROR": "error", "RUNNING": "running", "PENDING": "pending", "PAUSED": "pending"}


def value_columns(metric_names: tuple[str, ...], objective: tuple[str, str], named: tuple[str, ...] = ()) -> list[str]:
    """The reported values that become columns: losses, the task's metrics, the best objective, and the
    other values the objectives and constraints name (`named`: train_loss, measured ones)."""
    columns = ["val_loss", "best_val_loss", *(f"val_{m}" for m in metric_names)]
    columns += [f"best_{objective[0]}"] if f"best_{objective[0]}" not in columns else []
    return columns + [n for n in dict.fromkeys(named) if n not in columns]


def trial_rows(trial, packs: list[list[dict]] | None, epochs: int | None, searched: list[str],
               columns: list[str], interrupted: frozenset[str] = frozenset(), tune_status: str | None = None
               ) -> list[dict]:
    """One row per member of a Tune trial (a pack of one is a plain trial); `interrupted`: the trials a
    stop signal ended (Tune stops them as if they had finished; `--resume` runs them on); `tune_status`:
    the trial's Tune status where it is not set yet (Tune's callbacks hear of an end before it is)."""
    members = members_of(trial.config, packs)
    last = trial.last_result or {}
    per_member = last.get("members", {})
    iterations = int(last.get("epoch", 0))
    status = _STATUS.get(tune_status or trial.status, trial.status.lower())
    if status == "finished" and (trial.trial_id in interrupted or (epochs is not None and iterations < epochs)):
        status = "interrupted" if trial.trial_id in interrupted else "early-stopped"
    error = _error_line(trial) if status == "error" else None
    rows = []
    for j, hp in enumerate(members):
        # a trial of one member may report its metrics at the top level (Tune over Train does)
        m = member_values(per_member, j) if per_member else last if len(members) == 1 else {}
        stopped = m.get("stopped_epoch")  # ASHA stopped this member of a pack
        diverged = m.get("diverged_epoch")  # its loss or val_loss was not finite at the end of this epoch
        rows.append({
            "trial_id": trial.trial_id if len(members) == 1 else f"{trial.trial_id}-{j}",
            "status": "diverged" if diverged else "early-stopped" if stopped else status,
            # PBT reports changed ones; a conditional parameter whose condition did not hold has none
            **{f"config.{p}": m.get(f"config.{p}", hp.get(p)) for p in searched},
            **{c: m.get(c, math.nan) for c in columns},
            "iterations": diverged or stopped or iterations,
            "train_seconds": last.get("train_seconds", math.nan),
            "node": last.get("node"),
            "pack_size": len(members),
            "error": error,
        })
    return rows


def results_table(trials, packs, epochs: int, searched: list[str], columns: list[str],
                  interrupted: frozenset[str] = frozenset()) -> pd.DataFrame:
    rows = [row for t in trials for row in trial_rows(t, packs, epochs, searched, columns, interrupted)]
    return pd.DataFrame(rows)


def write_results(table: pd.DataFrame, exp_dir: Path, name: str = RESULTS_FILE) -> Path:
    return replace_whole(exp_dir / name, lambda tmp: table.to_parquet(tmp, index=False))


def read_results(exp_dir: Path) -> pd.DataFrame:
    """The sweep's table: `results.parquet` once the sweep has ended; while it runs, or after its driver
    was killed, the rows of the trials that ended so far (`results.parts/`; a trial written again by a
    resumed driver counts once)."""
    if (exp_dir / RESULTS_FILE).exists():
        return pd.read_parquet(exp_dir / RESULTS_FILE)
    parts = sorted((exp_dir / PARTS_DIR).glob("part-*.parquet"))
    if not parts:
        return pd.DataFrame()
    table = pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True)
    return table.drop_duplicates("trial_id", keep="last").reset_index(drop=True)


def _error_line(trial) -> str | None:
    """The last line of the trial's error trace (the exception and its message)."""
    try:
        text = Path(trial.error_file).read_text() if trial.error_file else ""
    except OSError:
        return "error (trace unavailable)"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


class ResultsRecorder(Callback):
    """Keeps the latest view of every trial; writes the rows of trials that ended to `results.parts/`
    (a part at most every `min_interval_s`, so a sweep of thousands of trials does not spend its
    driver on Parquet) and the whole table once at the end.

    The rows of a trial that ended are made once and kept: building the table, which the progress
    line and the monitor do every second or two, costs the running trials, not every trial."""

    def __init__(self, exp_dir: Path, packs, epochs: int, searched: list[str], info, objectives=None,
                 constraints=(), repeats: int = 1, min_interval_s: float = 5.0):
        """`info`: the task's `TaskInfo` (its metric names and objective make columns); `objectives`: every
        objective, (name, mode) (default: the task's), and `constraints` (`rayhpc.tune.objectives`): the
        table marks the Pareto front and the feasible trials; `repeats`: runs per configuration (a summary
        table of each configuration's mean is written beside)."""
        self.exp_dir, self.packs, self.epochs, self.searched = exp_dir, packs, epochs, searched
        self.objective = info.objective
        self.objectives, self.constraints = list(objectives or [info.objective]), list(constraints)
        self.repeats = repeats
        named = tuple(n for n, _ in self.objectives) + tuple(c.name for c in self.constraints)
        self.columns = value_columns(info.metric_names, info.objective, named)
        self.min_interval_s = min_interval_s
        self.trials: list = []
        self.kept: pd.DataFrame | None = None  # rows of a run before this one whose Tune state was lost: kept
        self.interrupted: frozenset[str] = frozenset()  # the trials a stop signal ended
        self._last_write = -math.inf
        self._reset()

    def _reset(self) -> None:
        self._ended: dict[str, list[dict]] = {}  # Tune trial id -> rows, for trials that ended
        self._ended_frame: pd.DataFrame | None = None
        self._pending: dict[str, list[dict]] = {}  # the rows of trials not started yet
        self._live: dict[str, tuple] = {}  # a running trial's id -> (its status, its last result, its rows)
        self._unwritten: list[str] = []  # ended since the last part

    def __getstate__(self):  # pickled with the tuner for --resume: rows are made again from the trials
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")} | {"_last_write": -math.inf}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def _rows(self, trial) -> list[dict]:
        return trial_rows(trial, self.packs, self.epochs, self.searched, self.columns, self.interrupted)

    def table(self) -> pd.DataFrame:
        """Every trial's rows: those of trials that ended as kept, the others made now; the Pareto front and
        the feasible trials marked (several objectives, constraints)."""
        return mark_front(self._table(), self.objectives, self.constraints)

    def _table(self) -> pd.DataFrame:
        live = []
        for trial in self.trials:
            if trial.trial_id in self._ended:
                continue
            if trial.status == "TERMINATED":  # an errored trial may be started again: it stays live
                self._live.pop(trial.trial_id, None)
                self._ended[trial.trial_id] = self._rows(trial)
                self._unwritten.append(trial.trial_id)
                self._ended_frame = None
            elif trial.status == "PENDING" and not trial.last_result:  # unchanged until it starts
                live += self._pending.get(trial.trial_id) or self._pending.setdefault(trial.trial_id, self._rows(trial))
            else:
                self._pending.pop(trial.trial_id, None)
                live += self._running_rows(trial)
        if self._ended_frame is None:
            self._ended_frame = self._with_kept(pd.DataFrame([row for rows in self._ended.values() for row in rows]))
        if not live:
            return self._ended_frame
        live = pd.DataFrame(live)
        return live if self._ended_frame.empty else pd.concat([self._ended_frame, live], ignore_index=True)

    def _running_rows(self, trial) -> list[dict]:
        """A running trial's rows, made again only when its status or last result changed: the progress line
        asks every second, a trial reports once an epoch (10,000 trials of 64-member packs: 157 trials' rows)."""
        status, result, rows = self._live.get(trial.trial_id, (None, None, None))
        if status != trial.status or result is not trial.last_result:
            rows = self._rows(trial)
            self._live[trial.trial_id] = trial.status, trial.last_result, rows
        return rows

    def _with_kept(self, table: pd.DataFrame) -> pd.DataFrame:
        if self.kept is None or self.kept.empty:
            return table
        return self.kept if table.empty else pd.concat([self.kept, table], ignore_index=True)

    def write_part(self) -> Path | None:
        """The rows of the trials that ended since the last part, as a new part (written once)."""
        self._table()
        if not self._unwritten:
            return None
        self._last_write = time.monotonic()  # the first trial to end is written at once, then in batches
        rows = [row for tid in self._unwritten for row in self._ended[tid]]
        self._unwritten = []
        parts = self.exp_dir / PARTS_DIR
        parts.mkdir(exist_ok=True)
        return write_results(pd.DataFrame(rows), parts, f"part-{time.time_ns()}.parquet")

    def write(self) -> Path:
        """The whole table, in the trials' order, once; the parts it replaces are removed."""
        table = self._with_kept(results_table(self.trials, self.packs, self.epochs, self.searched, self.columns,
                                              self.interrupted))
        path = write_results(mark_front(table, self.objectives, self.constraints), self.exp_dir)
        if self.repeats > 1:
            write_results(summarize(table, self.objective), self.exp_dir, SUMMARY_FILE)
        shutil.rmtree(self.exp_dir / PARTS_DIR, ignore_errors=True)
        return path

    def on_trial_result(self, iteration, trials, trial, result, **info):
        # start-up benchmarks: the time to a sweep's first result, through the first trial's own marks
        for phase, key in TRIAL_PHASES.items():
            if key in result:
                mark(phase, result[key])
        mark("first result")

    def on_step_end(self, iteration, trials, **info):
        self.trials = trials
        if time.monotonic() - self._last_write >= self.min_interval_s:
            self.write_part()

    def on_experiment_end(self, trials, **info):
        self.trials = trials
        if interrupt.received():  # the trials that had not ended a second ago were stopped by the signal
            self.interrupted = frozenset(t.trial_id for t in trials if t.trial_id not in self._ended)
        self.write()


def summarize(table: pd.DataFrame, objective: tuple[str, str]) -> pd.DataFrame:
    """One row per configuration of a sweep with repeats (its runs: the rows that differ only in
    `config.seed`): its finished runs (`runs`; early-stopped ones too: a configuration's runs stop together),
    the mean, standard deviation (n-1) and 95% interval (Student's t) of the objective's last value over them,
    and how many runs did not finish (`unfinished`: errored, interrupted or still running, whatever value they
    last reported, are left out); best first."""
    name = objective[0]
    keys = [c for c in table.columns if c.startswith("config.") and c != "config.seed"]
    rows = []
    for values, group in table.groupby(keys, dropna=False, sort=False):
        done = group.loc[group["status"].isin(["finished", "early-stopped"]), name].dropna()
        n, mean = len(done), done.mean() if len(done) else math.nan
        std = done.std(ddof=1) if n > 1 else math.nan
        t = T975[n - 2] if 1 < n <= len(T975) + 1 else 1.96
        half = t * std / math.sqrt(n) if n > 1 else math.nan
        rows.append({**dict(zip(keys, values if isinstance(values, tuple) else (values,))), "runs": n,
                     "unfinished": len(group) - n, f"{name}_mean": mean, f"{name}_std": std,
                     f"{name}_ci95_low": mean - half, f"{name}_ci95_high": mean + half})
    summary = pd.DataFrame(rows)
    return summary.sort_values(f"{name}_mean", ascending=objective[1] == "min").reset_index(drop=True)


def format_summary(summary: pd.DataFrame, k: int = 5) -> str:
    """The `k` best configurations of a summary table, as a printable table."""
    shown = summary.head(k).rename(columns=lambda c: c.removeprefix("config."))
    return (f"best {len(shown)} of {len(summary)} configurations by their mean:\n"
            + shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


def format_best(table: pd.DataFrame, objective: tuple[str, str] = ("val_loss", "min"), k: int = 5) -> str:
    """The `k` best trials by their objective (name, "min" or "max"), as a printable table; for several
    objectives, the trials on the Pareto front (the `pareto` column), best first by the first."""
    column = f"best_{objective[0]}"
    done = table.dropna(subset=[column]).sort_values(column, ascending=objective[1] == "min")
    if done.empty:
        return f"no trial reported {column.removeprefix('best_')}"
    front = "pareto" in table.columns
    done = done[done["pareto"].astype(bool)] if front else done.head(k)
    values = [c for c in table.columns if c.startswith(("val_", "best_")) or c in MEASURED]
    cols = ["trial_id", "status", *[c for c in table.columns if c.startswith("config.")], *values,
            *[c for c in ("feasible",) if c in table.columns], "iterations", "train_seconds", "node"]
    shown = done[cols].rename(columns=lambda c: c.removeprefix("config."))
    title = (f"Pareto front: {len(done)} of {len(table)} trials" if front
             else f"best {len(done)} of {len(table)} trials by {column}")
    return f"{title}:\n" + shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")
