"""The training options every runner takes: the optimizer, the learning-rate schedule, gradient
clipping and accumulation, and the one optimizer step that applies them.

All of them are hyperparameters (`rayhpc.task.hparams.PlatformHParams`), so a training run
sets them from its `optim:`/`schedule:` sections and a sweep can search them. The schedule
is a function of the optimizer steps taken so far, which every checkpoint records: a resumed
run sets the same learning rate as the uninterrupted one without saving scheduler state.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, Callable

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
    cls = optimizer_class(hp["optimizer"])
    return cls(params, **optimizer_kwargs(hp, cls))


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


def split_batch(batch: Any, parts: int) -> list:
    """`batch` as `parts` micro-batches of near-equal size along the first dimension of every tensor
    (tensors, or tuples, lists and dicts of them); fewer where the batch has fewer samples."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, min(parts, batch.shape[0])))
    if isinstance(batch, dict):
        split = {k: split_batch(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(len(next(iter(split.values()))))]
    if isinstance(batch, (list, tuple)):
        split = [split_batch(v, parts) for v in batch]
        return [type(batch)(v[i] for v in split) for i in range(len(split[0]))]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches")


def optimizer_step(model: torch.nn.Module, optimizer, loss_fn: Callable, batch: Any, hp: dict, step: int,
                   total_steps: int, size_of: Callable[[Any], int], scheduler=None) -> torch.Tensor:
    """One optimizer step on `batch`: the lr of the schedule (or of the task's own `scheduler`, stepped
    after it), the gradient over `accumulate` micro-batches (`accumulate_gradient`), clipped to
    `clip_grad_norm`. Returns the batch's mean loss (detached)."""
    if scheduler is None:
        set_lr(optimizer, hp, step, total_steps)
    optimizer.zero_grad(set_to_none=True)
    total = accumulate_gradient(model, loss_fn, batch, hp.get("accumulate", 1), size_of)
    if hp.get("clip_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp["clip_grad_norm"])
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return total


def accumulate_gradient(model: torch.nn.Module, loss_fn: Callable, batch: Any, parts: int,
                        size_of: Callable[[Any], int]) -> torch.Tensor:
    """Add to the parameters' `.grad` the gradient of `loss_fn` on `batch`, summed over `parts`
    micro-batches, each weighted by its share of the samples (for a loss that is a mean over samples, the
    whole batch's gradient at a micro-batch's memory); returns the batch's mean loss (detached). Under
    DDP, only the last micro-batch all-reduces the gradients."""
    micro = split_batch(batch, parts)
    total, n = torch.zeros((), device=_device_of(model)), size_of(batch)
    for i, part in enumerate(micro):
        last = i == len(micro) - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            loss = loss_fn(part)
            share = size_of(part) / n
            (loss * share).backward()
        total += loss.detach().float() * share
    return total


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device
