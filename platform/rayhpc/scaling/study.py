"""Run the scaling study: one DDP training run per (mode, worker count), through `run_training`."""

from __future__ import annotations

import logging
import math

import pandas as pd

from rayhpc import cluster
from rayhpc.config import validate
from rayhpc.job import start_job
from rayhpc.scaling.config import ScalingConfig
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training

RESULTS_FILE, PLOT_FILE = "scaling.parquet", "scaling.png"
log = logging.getLogger(__name__)


def nodes_spanned(res: cluster.Resources, workers: int, cpus: float, gpu: bool) -> int:
    """Nodes that `workers` bundles take when packed (Ray Train's PACK placement): biggest nodes first."""
    left, nodes = workers, 0
    for fits in sorted(res.fits_per_node(cpus, 1.0 if gpu else 0.0), reverse=True):
        if fits > 0 and left > 0:
            left, nodes = left - fits, nodes + 1
    return nodes


MLP_VAL_FRACTION = 0.2  # the built-in MLP task's validation hold-out when data.val_fraction is unset


def sized_data(cfg: ScalingConfig, global_batch: int) -> dict:
    """The data section of one run: synthetic rows for `steps_per_epoch` steps of `global_batch` samples
    after the validation hold-out (as given when steps_per_epoch is unset or the data is a file)."""
    data = cfg.data.model_dump()
    if cfg.steps_per_epoch is None or cfg.data.path is not None:
        return data
    fraction = cfg.data.val_fraction or MLP_VAL_FRACTION
    train = cfg.steps_per_epoch * global_batch
    rows = math.ceil(train / (1 - fraction))
    while rows - round(rows * fraction) > train:  # the hold-out rounds (`rayhpc.task.batches.holdout`)
        rows -= 1
    return {**data, "synthetic": {**data["synthetic"], "num_samples": rows}}


def train_config(cfg: ScalingConfig, mode: str, n: int) -> TrainConfig:
    batch = {"global_batch_size": cfg.global_batch_size} if mode == "strong" else \
        {"batch_size_per_worker": cfg.batch_size_per_worker}
    global_batch = cfg.global_batch_size if mode == "strong" else cfg.batch_size_per_worker * n
    name = f"{mode}-{n}"
    done_before = (cfg.experiment_dir / name / f"{TrainConfig.kind}.yaml").exists()  # a resumed study keeps it
    return validate(TrainConfig, {
        "name": name, "storage_path": str(cfg.experiment_dir), "epochs": cfg.epochs, "address": cfg.address,
        "resume": cfg.resume and done_before, "compute": {**cfg.compute.model_dump(), "num_workers": n},
        "hparams": {"hidden": cfg.hidden, "depth": cfg.depth}, "data": sized_data(cfg, global_batch), **batch})


def run_scaling(cfg: ScalingConfig, explicit: set[str] = frozenset()) -> pd.DataFrame:
    """The study's table (also Parquet and a PNG plot under the study's folder)."""
    job = start_job(cfg, explicit, check=_check)
    cfg, res, rows = job.cfg, job.resources, []
    for (mode, n), train_cfg in _runs(cfg).items():
        log.info(f"--- {mode} scaling, {n} worker(s)")
        result = run_training(train_cfg)
        cpus = result.cfg.compute.cpus_per_worker
        epochs = result.metrics[result.metrics["kind"] == "epoch"]
        rows.append({"mode": mode, "workers": n, "nodes": nodes_spanned(res, n, cpus, cfg.compute.gpu),
                     "global_batch": int(epochs["global_batch_size"].iloc[0]),
                     "steps_per_epoch": int(epochs["global_step"].iloc[0]),
                     "samples_per_s": float(epochs["samples_per_s"].iloc[1:].median())})  # epoch 1 is warm-up
    table = add_speedup(pd.DataFrame(rows))
    cfg.make_dir()
    table.to_parquet(cfg.experiment_dir / RESULTS_FILE, index=False)
    plot(table, cfg.experiment_dir / PLOT_FILE)
    return table


def _runs(cfg: ScalingConfig) -> dict[tuple[str, int], TrainConfig]:
    return {(mode, n): train_config(cfg, mode, n) for mode in cfg.modes for n in cfg.workers}


def _check(cfg: ScalingConfig, res: cluster.Resources) -> None:
    """Every run's config is valid, and the largest run can be placed (before Ray starts)."""
    _runs(cfg)
    n = max(cfg.workers)
    cpus = cfg.compute.cpus_per_worker or cluster.default_cpus_per_worker(res, n, cfg.compute.gpu)
    cluster.check_workers(res, n, cpus, cfg.compute.gpu, key="workers (--workers)")


def add_speedup(table: pd.DataFrame) -> pd.DataFrame:
    """Speedup over the smallest worker count of each mode, and efficiency = speedup / (n / n0)."""
    table = table.copy()
    for mode, rows in table.groupby("mode"):
        base = rows.loc[rows["workers"].idxmin()]
        table.loc[rows.index, "speedup"] = rows["samples_per_s"] / base["samples_per_s"]
        table.loc[rows.index, "efficiency"] = table.loc[rows.index, "speedup"] / (rows["workers"] / base["workers"])
    return table


def format_table(table: pd.DataFrame) -> str:
    shown = table.assign(nodes=[f"{n}{' *' if n > 1 else ''}" for n in table["nodes"]])
    return (shown.to_string(index=False, float_format=lambda v: f"{v:,.2f}")
            + "\n(samples/s: median over epochs after the first; * = the workers spanned several nodes)")


def plot(table: pd.DataFrame, path) -> None:
    """Throughput and efficiency against workers, per mode; a dashed line where runs left one node."""
    import matplotlib  # plots only: about 0.5 s to import

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt  # plots only: about 0.5 s to import

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for mode, rows in table.groupby("mode"):
        left.plot(rows["workers"], rows["samples_per_s"], marker="o", label=f"{mode} scaling")
        right.plot(rows["workers"], rows["efficiency"], marker="o", label=f"{mode} scaling")
    right.axhline(1.0, color="grey", lw=0.8)
    multi = table[table["nodes"] > 1]["workers"]
    for ax in (left, right):
        if len(multi):
            ax.axvline(multi.min() - 0.5, color="red", ls="--", lw=1, label="several nodes from here")
        ax.set_xlabel("workers")
        ax.set_xticks(sorted(table["workers"].unique()))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("throughput (samples/s)")
    right.set_ylabel("efficiency (speedup / workers)")
    right.set_ylim(0, max(1.2, float(table["efficiency"].max()) * 1.1))
    fig.suptitle("DDP scaling study")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
