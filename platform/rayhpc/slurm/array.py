"""A sweep as a Slurm array job: one trial per task, as researchers run them without Ray, writing
the same results.parquet as the Ray Tune sweep, so the two ways compare on one cluster.

    rayhpc submit --array --cluster cluster_configs/X.yaml -- --num-samples 16 --epochs 10
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd

from rayhpc.config import ConfigError, load_yaml, reconcile_resume, validate
from rayhpc.slurm.config import ClusterConfig
from rayhpc.slurm.render import setup_lines
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.results import write_results
from rayhpc.tune.space import sample_configs, searched

ARRAY_DIR = "array"  # per-task JSON results under the sweep folder


def check_array_sweep(cfg: SweepConfig, explicit: set[str]) -> tuple[SweepConfig, int]:
    """The sweep and its number of trials; what an array job cannot do is refused."""
    if cfg.search == "optuna":
        raise ConfigError("search (--search) optuna: an array job draws every config up front; use random or grid")
    if cfg.scheduler == "asha":
        raise ConfigError("scheduler (--scheduler) asha: array tasks cannot be stopped early; use fifo")
    if cfg.workers_per_trial > 1:
        raise ConfigError(f"workers_per_trial (--workers-per-trial) {cfg.workers_per_trial}: array tasks "
                          "train on one process; use the Ray sweep for distributed trials")
    cfg = reconcile_resume(cfg, explicit)
    return cfg, len(sample_configs(cfg.space, cfg.num_samples, cfg.search, cfg.seed))


def render_array(cluster: ClusterConfig, sweep: SweepConfig, n_trials: int) -> str:
    """The array job's script: `--array=0-(n-1)%K`, a `%A_%a` log per task, one trial per task."""
    s, q = cluster.slurm, shlex.quote
    limit = f"%{sweep.max_concurrent}" if sweep.max_concurrent else ""
    flags = [f"--job-name=rayhpc-{cluster.name}-array", f"--array=0-{n_trials - 1}{limit}", "--nodes=1",
             "--ntasks=1", f"--cpus-per-task={math.ceil(sweep.cpus_per_trial)}", f"--time={s.time}",
             f"--output={cluster.log_dir}/%x-%A_%a.log"]
    flags += [f"--{k}={getattr(s, k)}" for k in ("partition", "account", "qos") if getattr(s, k)]
    flags += [f"--gpus-per-task={math.ceil(sweep.gpus_per_trial)}"] if sweep.gpus_per_trial else []
    lines = ["#!/bin/bash", f"# rendered by `rayhpc submit --array` from cluster config {cluster.name!r}"]
    lines += [f"#SBATCH {flag}" for flag in flags + s.extra]
    lines += ["", "set -e", *setup_lines(cluster)]
    lines += [f"exec python -m rayhpc.tune.single --config {q(str(sweep.saved_file))} "
              f"--index \"$SLURM_ARRAY_TASK_ID\" --out {q(str(sweep.experiment_dir / ARRAY_DIR))}", ""]
    return "\n".join(lines)


def submit_array(cluster: ClusterConfig, sweep: SweepConfig, n_trials: int, dry_run: bool = False) -> str:
    """Submit the array and a job that collects its results once every task has ended."""
    text = render_array(cluster, sweep, n_trials)
    if dry_run:
        return text
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    sweep.save()  # the tasks read the sweep from its folder
    script = sweep.experiment_dir / "array.sbatch"
    script.write_text(text)
    array_id = _sbatch(["--parsable", str(script)])
    collect = f"{shlex.quote(sys.executable)} -m rayhpc.slurm.array {shlex.quote(str(sweep.experiment_dir))}"
    _sbatch(["--parsable", f"--dependency=afterany:{array_id}", f"--job-name=rayhpc-{cluster.name}-collect",
             f"--output={cluster.log_dir}/%x-%j.log", "--ntasks=1", f"--time={cluster.slurm.time}",
             *([f"--partition={cluster.slurm.partition}"] if cluster.slurm.partition else []), f"--wrap={collect}"])
    return array_id


def _sbatch(args: list[str]) -> str:
    proc = subprocess.run(["sbatch", *args], capture_output=True, text=True)
    if proc.returncode:
        raise ConfigError(f"sbatch: {proc.stderr.strip() or 'failed'}")
    return proc.stdout.strip().split(";")[0]


def collect(exp_dir: Path) -> pd.DataFrame:
    """results.parquet from the tasks' JSON files, with the Ray sweep's columns; a task that left
    no result is an `error` row."""
    cfg = validate(SweepConfig, load_yaml(exp_dir / "sweep.yaml"))
    configs = sample_configs(cfg.space, cfg.num_samples, cfg.search, cfg.seed)
    params = searched(cfg.space)
    rows = []
    for i, hp in enumerate(configs):
        path = exp_dir / ARRAY_DIR / f"trial_{i:05d}.json"
        done = json.loads(path.read_text()) if path.is_file() else {}
        rows.append({"trial_id": f"array_{i:05d}", "status": "finished" if done else "error",
                     **{f"config.{p}": hp[p] for p in params},
                     **{k: done.get(k, math.nan) for k in ("val_loss", "best_val_loss", "iterations",
                                                           "train_seconds")},
                     "node": done.get("node"), "pack_size": 1,
                     "error": None if done else f"task {i} wrote no result (see its %A_{i} log)"})
    table = pd.DataFrame(rows)
    write_results(table, exp_dir)
    return table


if __name__ == "__main__":
    table = collect(Path(sys.argv[1]))
    print(f"collected {int((table['status'] == 'finished').sum())} of {len(table)} trials into "
          f"{Path(sys.argv[1]) / 'results.parquet'}")
