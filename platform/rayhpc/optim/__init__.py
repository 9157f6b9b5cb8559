"""The training options every runner takes: the optimizer and the learning-rate schedule (gradient
clipping and accumulation are `rayhpc.engine.train_step`'s).

All of them are hyperparameters (`rayhpc.task.hparams.PlatformHParams`), so a training run
sets them from its `optim:`/`schedule:` sections and a sweep can search them. The schedule
is a function of the optimizer steps taken so far, which every checkpoint records: a resumed
run sets the same learning rate as the uninterrupted one without saving scheduler state.
"""

from __future__ import annotations

import inspect
import math
import sys

import torch

DECAYS = ("constant", "cosine", "linear", "step")
STEP_DROPS = (0.5, 0.75)  # `step` decay: x0.1 at these shares of the steps after the warm-up


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """`sgd`, `adam`, `adamw`, or any other `torch.optim` optimizer by its class name, in any case (`rmsprop`)."""
    known = {n: c for n, c in vars(torch.optim).items()
             if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    by_lower = {n.lower(): c for n, c in known.items()}
    if name.lower() not in by_lower:
        raise ValueError(f"unknown optimizer {name!r}: expected sgd, adam, adamw or a torch.optim class "
                         f"({', '.join(sorted(known))})")
    return by_lower[name.lower()]


def optimizer_kwargs(hp: dict, cls: type) -> dict:
    """The trial's values for the arguments `cls` takes (SGD has no betas, Adam no momentum)."""
    accepted = inspect.signature(cls).parameters
    candidates = {"lr": hp["lr"], "weight_decay": hp.get("weight_decay", 0.0), "momentum": hp.get("momentum", 0.0),
                  "betas": (hp.get("beta1", 0.9), hp.get("beta2", 0.999)), "eps": hp.get("eps", 1e-8)}
    return {k: v for k, v in candidates.items() if k in accepted}


def make_optimizer(hp: dict, params) -> torch.optim.Optimizer:
    """The trial's optimizer over `params`, with its lr, weight decay, momentum, betas and eps."""
    cls, params = optimizer_class(hp["optimizer"]), list(params)
    kwargs = optimizer_kwargs(hp, cls)
    # torch steps CPU parameters one at a time; on DTensors (FSDP2, TP) each element-wise op of that loop
    # goes through DTensor's dispatch, where the multi-tensor form dispatches once per op for all of them
    # (the same values, bit for bit); not where plain tensors are mixed in (TP alone), which it refuses
    if "foreach" in inspect.signature(cls).parameters and params and all(_is_dtensor(p) for p in params):
        kwargs["foreach"] = True
    return cls(params, **kwargs)


def _is_dtensor(param) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: nothing was sharded (and a sweep
    return dtensor is not None and isinstance(param, dtensor.DTensor)  # does not pay for its import)


def warmup_steps(hp: dict, total_steps: int) -> int:
    """The warm-up's optimizer steps: `warmup_fraction` of `total_steps` (rounded), else `warmup_steps`."""
    fraction = hp.get("warmup_fraction")
    return round(fraction * total_steps) if fraction is not None else hp.get("warmup_steps", 0)


def step_plan(per_epoch: int, epochs: int | None, steps: int | None) -> tuple[int, int]:
    """(optimizer steps in all, epochs to run) of a run of `steps` steps, else of `epochs` epochs of
    `per_epoch` steps; `steps` take as many epochs as they need, the last one cut short."""
    total = steps or epochs * per_epoch
    return total, math.ceil(total / per_epoch)


def lr_factor(hp: dict, step: int, total_steps: int) -> float:
    """The share of `lr` used by optimizer step `step` (0-based) of `total_steps`: a linear warm-up over
    `warmup_steps` ((step + 1) / (warmup_steps + 1)), then `decay`: cosine or linear from 1 down to
    `min_lr_ratio` at the last step; `step`: x0.1 at half and at three quarters of the way, never below
    `min_lr_ratio`; or constant."""
    warmup, decay, floor = warmup_steps(hp, total_steps), hp.get("decay", "constant"), hp.get("min_lr_ratio", 0.0)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    if decay == "step":
        return max(floor, 0.1 ** sum(progress >= at for at in STEP_DROPS))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return floor + (1 - floor) * shape


def set_lr(optimizer, hp: dict, step: int, total_steps: int) -> float:
    """Every parameter group's lr for optimizer step `step`; returns it."""
    lr = hp["lr"] * lr_factor(hp, step, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
