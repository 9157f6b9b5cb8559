"""One trial trained the plain PyTorch way: `nn.Module` + `torch.optim`, one process.

This is what a Slurm array task does today, so it runs each task of `rayhpc submit
--array` and is the baseline of the sweep benchmark. It takes the same data order
and batches as every other path (`rayhpc.task.batches`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Callable

import torch

from rayhpc.config import ModelOptions, Optim, Schedule, check_trusted_job, load_yaml, validate
from rayhpc.data import DataConfig
from rayhpc.devices import cuda_device
from rayhpc.engine import Module, checkpoint, train_step
from rayhpc.engine.loop import Best, Plan, Runner, fit
from rayhpc.engine.parallelize import apply_options
from rayhpc.engine.step import batch_size_of
from rayhpc.precision import autocast, set_matmul_precision
from rayhpc.task import task_for
from rayhpc.task.batches import Batches, eval_batch, evaluate, loader_workers
from rayhpc.task.load import LoadedTask
from rayhpc.tracking.runs import job_run
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.plan import load_plan


def train_single(task: LoadedTask, hp: dict, epochs: int | None, data: DataConfig = DataConfig(),
                 on_epoch: Callable | None = None, device: torch.device = torch.device("cpu"),
                 precision: str = "tf32", steps: int | None = None, options: ModelOptions = ModelOptions(),
                 checkpoints: Path | None = None) -> dict:
    """Train one trial for `epochs` (or `steps`, the last epoch cut short) in `precision`, its blocks
    checkpointed and compiled as `options` asks; returns its final model, its last values (`train_loss`,
    `val_loss`, `val_<metric>`), the best of each, and its time.

    `data` is the sweep's `data:` section (the validation hold-out); `on_epoch(epoch, values,
    model)` runs after each epoch (the plain Ray Tune baseline reports and checkpoints there; a study's
    array task asks ASHA there), and training stops early where it returns True. With `checkpoints` (a
    folder of this user's), each epoch's end is checkpointed there (the latest kept) and a run that finds
    one goes on from it: a requeued array task resumes where it stopped.
    """
    entered = time.perf_counter()
    set_matmul_precision(precision)
    train, val = task.split_data(hp, data)
    model = task.initial_model(hp).to(device)
    apply_options(model, task.obj, options)
    opt = task.optimizer(model.parameters(), hp)
    latest = checkpoint.latest_checkpoint(checkpoints) if checkpoints is not None else None
    start = checkpoint.load_progress(latest).global_step if latest is not None else 0
    scheduler = task.scheduler(opt, hp, start)
    workers = loader_workers(device, int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
    train_batches = Batches(train, device, workers)
    val_batches = Batches(val, device, workers) if val is not None else None
    plan = Plan.of(math.ceil(len(train) / hp["batch_size"]), epochs, steps)
    trained = Module(model, opt, lambda part: _loss(task, model, part, precision, device), Optim.of(hp),
                     Schedule.of(hp), scheduler)
    runner = _Single(task, hp, trained, plan, train_batches, val_batches, precision, on_epoch, device, checkpoints)
    if latest is not None:
        runner.restore(latest)
    epochs = fit(plan, runner, start)
    return {"model": model, **runner.values, **runner.best, "iterations": epochs,
            "train_seconds": time.perf_counter() - entered}


@dataclasses.dataclass
class _Single(Runner):
    """One process's trial for `rayhpc.engine.fit`: the last epoch's values and the best so far, kept here."""

    task: LoadedTask
    hp: dict
    trained: Module
    plan: Plan
    train: Batches
    val: Batches | None
    precision: str
    on_epoch: Callable | None
    device: torch.device
    checkpoints: Path | None
    values: dict = dataclasses.field(default_factory=dict)
    best: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.tracker = Best(self.task.objective)

    def batches(self, epoch: int, steps: range):
        return self.train.steps(self.hp["seed"], epoch, steps, self.plan.per_epoch, self.hp["batch_size"])

    def step(self, step: int, batch) -> tuple[torch.Tensor, int]:
        loss = train_step(self.trained, batch, self.hp["accumulate"], step, self.plan.total)
        return loss, batch_size_of(batch)

    def end_epoch(self, epoch: int, window) -> bool:
        self.values = {"train_loss": float(window.loss)}
        if self.val is not None:
            with autocast(self.precision, self.val.device):
                self.values.update(evaluate(self.task, self.trained.model,
                                            self.val.all(eval_batch(self.hp["batch_size"]))))
        self.best = self.tracker.update(self.values)
        if self.checkpoints is not None:
            self.save(epoch, self.plan.span(epoch).stop)
        return self.on_epoch is not None and bool(self.on_epoch(epoch + 1, self.values, self.trained.model))

    def save(self, epoch: int, step: int) -> None:
        """The state after epoch `epoch` (global step `step`), its values and best so far as the extra state;
        then the older checkpoints go."""
        checkpoint.save(self.checkpoints / f"checkpoint_{step:06d}", [(self.trained.model, self.trained.optimizer)],
                        checkpoint.Progress(epoch=epoch + 1, global_step=step), sharded=False, device=self.device,
                        extra={"values": self.values, "best": self.tracker.so_far})
        checkpoint.prune(self.checkpoints, 1)

    def restore(self, folder: Path) -> None:
        _, saved = checkpoint.load(folder, [(self.trained.model, self.trained.optimizer)], sharded=False,
                                   device=self.device)
        self.values, self.tracker.so_far = saved["values"], saved["best"]
        self.best = self.tracker.update({})


def _loss(task: LoadedTask, model, batch, precision: str, device: torch.device) -> torch.Tensor:
    with autocast(precision, device):
        return task.loss(model, batch)


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
    torch.set_num_threads(int(os.environ.get("SLURM_CPUS_PER_TASK", "1")))
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
        result = train_single(task, hp, cfg.epochs, cfg.data, on_epoch=lambda e, values, _m: run.log(e, values),
                              device=task_device(cfg.gpus_per_trial), precision=cfg.precision, steps=cfg.steps,
                              options=cfg, checkpoints=out / name)
    row = {"index": args.index, "config": hp, "node": socket.gethostname(),
           **{k: v for k, v in result.items() if k != "model"}}
    (out / f"{name}.json").write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    from rayhpc.entry import run_main

    run_main(main)  # bad input: one `error:` line in the task's log, exit 2
