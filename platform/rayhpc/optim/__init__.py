"""The training options every runner takes: the optimizer and the learning-rate schedule (gradient
clipping and accumulation are `rayhpc.engine.train_step`'s).

They take the typed sections (`rayhpc.config.Optim`, `Schedule`), whose defaults are the only ones; a
trial's flat hyperparameters become those sections once (`Optim.of(hp)`), where a runner is made. The
schedule is a function of the optimizer steps taken so far, which every checkpoint records: a resumed
run sets the same learning rate as the uninterrupted one without saving scheduler state.
"""

from __future__ import annotations

import inspect
import math
import sys

import torch

from rayhpc.config import Optim, Schedule, optimizer_class

DECAYS = ("constant", "cosine", "linear", "step")
STEP_DROPS = (0.5, 0.75)  # `step` decay: x0.1 at these shares of the steps after the warm-up


def optimizer_kwargs(optim: Optim, cls: type) -> dict:
    """The section's values for the arguments `cls` takes (SGD has no betas, Adam no momentum)."""
    accepted = inspect.signature(cls).parameters
    candidates = {"lr": optim.lr, "weight_decay": optim.weight_decay, "momentum": optim.momentum,
                  "betas": (optim.beta1, optim.beta2), "eps": optim.eps}
    return {k: v for k, v in candidates.items() if k in accepted}


def make_optimizer(optim: Optim, params) -> torch.optim.Optimizer:
    """The section's optimizer over `params`, with its lr, weight decay, momentum, betas and eps."""
    cls, params = optimizer_class(optim.optimizer), list(params)
    kwargs = optimizer_kwargs(optim, cls)
    # torch steps CPU parameters one at a time; on DTensors (FSDP2, TP) each element-wise op of that loop
    # goes through DTensor's dispatch, where the multi-tensor form dispatches once per op for all of them
    # (the same values, bit for bit); not where plain tensors are mixed in (TP alone), which it refuses
    if "foreach" in inspect.signature(cls).parameters and params and all(_is_dtensor(p) for p in params):
        kwargs["foreach"] = True
    return cls(params, **kwargs)


def _is_dtensor(param) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: nothing was sharded (and a sweep
    return dtensor is not None and isinstance(param, dtensor.DTensor)  # does not pay for its import)


def warmup_steps(schedule: Schedule, total_steps: int) -> int:
    """The warm-up's optimizer steps: `warmup_fraction` of `total_steps` (rounded), else `warmup_steps`."""
    fraction = schedule.warmup_fraction
    return round(fraction * total_steps) if fraction is not None else schedule.warmup_steps


def step_plan(per_epoch: int, epochs: int | None, steps: int | None) -> tuple[int, int]:
    """(optimizer steps in all, epochs to run) of a run of `steps` steps, else of `epochs` epochs of
    `per_epoch` steps; `steps` take as many epochs as they need, the last one cut short."""
    total = steps or epochs * per_epoch
    return total, math.ceil(total / per_epoch)


def lr_factor(schedule: Schedule, step: int, total_steps: int) -> float:
    """The share of `lr` used by optimizer step `step` (0-based) of `total_steps`: a linear warm-up over
    `warmup_steps` ((step + 1) / (warmup_steps + 1)), then `decay`: cosine or linear from 1 down to
    `min_lr_ratio` at the last step; `step`: x0.1 at half and at three quarters of the way, never below
    `min_lr_ratio`; or constant."""
    warmup, decay, floor = warmup_steps(schedule, total_steps), schedule.decay, schedule.min_lr_ratio
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    if decay == "step":
        return max(floor, 0.1 ** sum(progress >= at for at in STEP_DROPS))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return floor + (1 - floor) * shape


def set_lr(optimizer, lr: float, schedule: Schedule, step: int, total_steps: int) -> float:
    """Every parameter group's lr for optimizer step `step`: the peak `lr` times the schedule's share; returns it."""
    lr = lr * lr_factor(schedule, step, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
