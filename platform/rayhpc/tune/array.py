"""A sweep as a Slurm array job: one trial per task, as researchers run them without Ray, writing
the same results.parquet as the Ray Tune sweep, so the two ways compare on one cluster.

    rayhpc submit --array --cluster cluster_configs/X.yaml -- --num-samples 16 --epochs 10 [--task F.py:T]

The submission checks the sweep and its task like any job (no cluster is started), draws
every trial's hyperparameters into the sweep folder (`trials.json`), and ships a file task
with the job: the task file, and the modules beside it that it imports, are copied into
the sweep folder, which every node reads anyway (the tasks write their results there).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd

from rayhpc.config import ConfigError, reconcile_resume
from rayhpc.job import bind_task
from rayhpc.private import write_private
from rayhpc.slurm.config import ClusterConfig
from rayhpc.slurm.render import render_array, render_collect
from rayhpc.slurm.submit import log_dir, sbatch
from rayhpc.tune.config import SweepConfig, bind_sweep
from rayhpc.tune.plan import load_plan, save_plan
from rayhpc.tune.results import value_columns, write_results
from rayhpc.tune.space import searched

ARRAY_DIR = "array"  # per-task JSON results under the sweep folder
COLUMNS_FILE = "array.json"  # the results table's columns, for the collecting job
TASK_DIR = "task"  # the shipped copy of a file task


def prepare_array(cfg: SweepConfig, explicit: set[str]):
    """(the sweep, its task, every trial's hyperparameters, the columns); what an array job cannot do
    is refused, and the task is checked in this process, before anything is submitted."""
    if cfg.search == "optuna":
        raise ConfigError("search (--search) optuna: an array job draws every config up front; use random or grid")
    if cfg.scheduler in ("asha", "median", "hyperband"):
        raise ConfigError(f"scheduler (--scheduler) {cfg.scheduler}: array tasks cannot be stopped early; use fifo")
    if cfg.scheduler == "pbt":
        raise ConfigError("scheduler (--scheduler) pbt: array tasks train one trial each, apart; use fifo")
    if cfg.workers_per_trial > 1:
        raise ConfigError(f"workers_per_trial (--workers-per-trial) {cfg.workers_per_trial}: array tasks "
                          "train on one process; use the Ray sweep for distributed trials")
    ray_only = {"repeats (--repeats)": cfg.repeats if cfg.repeats > 1 else None,
                "objective (--objective)": ",".join(cfg.objective) if len(cfg.objective or []) > 1 else None,
                "constraints (--constraints)": ",".join(cfg.constraints or []) or None,
                "time_budget (--time-budget)": cfg.time_budget}
    for key, value in ray_only.items():
        if value is not None:
            raise ConfigError(f"{key} {value}: a feature of the Ray sweep (packs, its driver's clock, its table); "
                              "array tasks train one trial each, apart: leave it out, or drop --array")
    cfg, task, info, _ = bind_task(reconcile_resume(cfg, explicit), bind_sweep)
    columns = {"searched": searched(cfg.space), "values": value_columns(info.metric_names, info.objective)}
    return cfg, task, cfg.configs(task.hp_model), columns


def submit_array(cluster: ClusterConfig, sweep: SweepConfig, task, configs: list[dict], columns: dict,
                 dry_run: bool = False) -> str:
    """Submit the array and a job that collects its results once every task has ended."""
    exp_dir = sweep.experiment_dir
    text = render_array(cluster, sweep, len(configs), exp_dir / ARRAY_DIR, task.copied_spec(exp_dir / TASK_DIR))
    if dry_run:
        return text
    log_dir(cluster)
    sweep.save()  # the tasks read the sweep and their trials from its folder
    save_plan([[c] for c in configs], exp_dir)
    (exp_dir / COLUMNS_FILE).write_text(json.dumps(columns))
    task.copy_files(exp_dir / TASK_DIR)
    write_private(exp_dir / "array.sbatch", text)  # a record beside the results; Slurm reads it on stdin
    array_id = sbatch([], script=text)
    sbatch([], script=render_collect(cluster, array_id, exp_dir))
    return array_id


def collect(exp_dir: Path) -> pd.DataFrame:
    """results.parquet from the tasks' JSON files, with the Ray sweep's columns; a task that left
    no result is an `error` row."""
    columns = json.loads((exp_dir / COLUMNS_FILE).read_text())
    rows = []
    for i, (hp,) in enumerate(load_plan(exp_dir)):
        path = exp_dir / ARRAY_DIR / f"trial_{i:05d}.json"
        done = json.loads(path.read_text()) if path.is_file() else {}
        rows.append({"trial_id": f"array_{i:05d}", "status": "finished" if done else "error",
                     **{f"config.{p}": hp[p] for p in columns["searched"]},
                     **{k: done.get(k, math.nan) for k in (*columns["values"], "iterations", "train_seconds")},
                     "node": done.get("node"), "pack_size": 1,
                     "error": None if done else f"task {i} wrote no result (see its %A_{i} log)"})
    table = pd.DataFrame(rows)
    write_results(table, exp_dir)
    return table


if __name__ == "__main__":
    table = collect(Path(sys.argv[1]))
    print(f"collected {int((table['status'] == 'finished').sum())} of {len(table)} trials into "
          f"{Path(sys.argv[1]) / 'results.parquet'}")
