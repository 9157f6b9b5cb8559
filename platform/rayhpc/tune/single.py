"""One trial alone, as a pack of one (`rayhpc.tune.trainable.run_pack`, the sweep's own trainable): each task of
`rayhpc submit --array`, the study's array tasks (`rayhpc.tune.study_array`) and the sweep benchmark's baseline.

An array task is what researchers run without Ray; it takes the same data order, batches, options,
checkpoints and reports as a trial of the Ray sweep, so the two ways compare on one cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Callable

import torch

from rayhpc.config import check_trusted_job, load_yaml, validate
from rayhpc.devices import cuda_device
from rayhpc.task import task_for
from rayhpc.task.load import LoadedTask
from rayhpc.tracking.runs import job_run
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.plan import load_plan
from rayhpc.tune.trainable import Reports, TrialSettings, member_values, run_pack


def train_alone(task: LoadedTask, hp: dict, cfg: SweepConfig, *, folder: Path | None = None,
                then: Callable[[dict, int], bool | None] | None = None, device: torch.device | None = None,
                threads: int = 1) -> dict:
    """Train the trial `hp` of the sweep `cfg` alone (its length, data, precision and model options), on `device`
    (default: the CPU) with `threads` torch threads; returns its last values (`train_loss`, `val_loss`,
    `val_<metric>`, the best of each), `iterations` (epochs trained), `resumed_from_epoch` (0: a fresh start),
    `train_seconds` and `model` (None where its final checkpoint was all there was to read).

    `then(values, epoch)` runs after each epoch (an array task's tracked run, a study's ASHA), and training stops
    early where it returns True. With `folder` (this user's), each epoch's end is checkpointed there (the latest
    kept) and a run that finds one goes on from it: a requeued array task resumes where it stopped."""
    last: dict = {}

    def report(metrics: dict) -> bool:
        last.update(metrics)
        return then is not None and bool(then(member_values(metrics["members"], 0), metrics["epoch"]))

    objective = cfg.objectives[0] if cfg.objectives else task.objective
    trial = run_pack({"pack": 0}, task, [[hp]], TrialSettings.of(cfg, task, objective, threads),
                     Reports(folder, report, device or torch.device("cpu")))
    return {**member_values(last["members"], 0), "iterations": last["epoch"], "train_seconds": last["train_seconds"],
            "resumed_from_epoch": last["resumed_from_epoch"], "model": trial.pack.model if trial is not None else None}


def task_device(gpus: float | None) -> torch.device:
    """The array task's device: the GPU Slurm gave it (`--gpus-per-task`, so it is index 0 of
    CUDA_VISIBLE_DEVICES) where the sweep asks for GPUs, else the CPU."""
    if not gpus:
        return torch.device("cpu")
    return cuda_device(f"gpus_per_trial {gpus:g}: array task")


def main(argv=None) -> int:
    """`python -m rayhpc.tune.single --config SWEEP.yaml --index I --out DIR [--task SPEC]`: one array task."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", required=True, help="the sweep's saved sweep.yaml (random or grid search)")
    parser.add_argument("--index", type=int, required=True, help="trial number, 0-based")
    parser.add_argument("--out", required=True, help="folder for the trial's JSON result")
    parser.add_argument("--task", help="the task, where not the sweep's own (a copy shipped with the job)")
    args = parser.parse_args(argv)
    # one thread per CPU the task was given (Slurm's --cpus-per-task); more threads than
    # cores makes small torch ops many times slower when tasks share a node
    threads = int(os.environ.get("SLURM_CPUS_PER_TASK", "1"))
    check_trusted_job(Path(args.config).parent)  # the sweep, its plan and its copied task file are the user's
    cfg = validate(SweepConfig, load_yaml(args.config))
    task = task_for(args.task or cfg.task, cfg.data)
    (hp,) = load_plan(Path(args.config).parent)[args.index]  # the trials the submission drew
    cfg = cfg.model_copy(update={"storage_path": Path(args.config).parent.parent})  # the sweep's, wherever run
    out, name = Path(args.out), f"trial_{args.index:05d}"
    if (out / f"{name}.json").exists():  # a requeued array's finished task: its result stands
        return 0
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_trusted_job(out)  # where the task's checkpoints are read back from
    with job_run(cfg, {**cfg.defaults(task.hp_model), **hp}, "array trial", key=f"{args.index:05d}") as run:
        result = train_alone(task, hp, cfg, folder=out / name, then=lambda values, epoch: run.log(epoch, values),
                             device=task_device(cfg.gpus_per_trial), threads=threads)
    row = {"index": args.index, "config": hp, "node": socket.gethostname(),
           **{k: v for k, v in result.items() if k != "model"}}
    (out / f"{name}.json").write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    from rayhpc.entry import run_main

    run_main(main)  # bad input: one `error:` line in the task's log, exit 2
