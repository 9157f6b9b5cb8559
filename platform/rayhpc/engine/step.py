"""One optimizer step, whatever is trained (torchtitan's `train_step`).

`train_step` splits the batch into `accumulate` micro-batches, adds each one's gradient weighted by its
share of the samples (for a loss that is a mean over samples: the whole batch's gradient at a
micro-batch's memory, also where an epoch's last batch does not split evenly), and returns the batch's
mean loss. What is trained says how its step begins, how a micro-batch's gradient is added and how the
step ends (`Trained`): `Module` here (a plain, DDP or FSDP2 module with its optimizer, or a gradient
sink without one), a pack's members (`rayhpc.tune.trainable.Members`) and a model-parallel rank's stages
(`rayhpc.parallel.worker.Stages`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Protocol

import torch

from rayhpc.config import Optim, Schedule
from rayhpc.optim import set_lr


class Trained(Protocol):
    def begin(self, step: int, total_steps: int) -> None:
        """Step `step`'s learning rate set, the gradients zeroed."""

    def backward(self, part: Any, share: float, last: bool) -> torch.Tensor:
        """Add `share` x the gradient of the loss on micro-batch `part` (`last`: the step's last); the loss
        (detached: a scalar, or one per pack member)."""

    def finish(self) -> None:
        """Clip, step the optimizer(s) and the task's own scheduler(s)."""


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return batch_size_of(batch[0])
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}")


def train_step(trained: Trained, batch: Any, accumulate: int, step: int, total_steps: int,
               size_of: Callable[[Any], int] = batch_size_of) -> torch.Tensor:
    """One optimizer step of `trained` on `batch` over `accumulate` micro-batches; the batch's mean loss."""
    trained.begin(step, total_steps)
    micro, n = split_batch(batch, accumulate), size_of(batch)
    total = 0
    for i, part in enumerate(micro):
        share = size_of(part) / n
        total = total + trained.backward(part, share, i == len(micro) - 1) * share
    trained.finish()
    return total


class Module:
    """A module (plain, DDP or FSDP2) and its optimizer: the `schedule`'s lr (or the task's own
    `scheduler`, stepped after the optimizer), the `optim` section's `clip_grad_norm` by `clip_grad_norm_`.
    Without an optimizer, a gradient sink: the step only leaves the gradient in `.grad` (a parameter-server
    worker pushes it; the servers clip and step)."""

    def __init__(self, model: torch.nn.Module, optimizer, loss_fn: Callable[[Any], torch.Tensor],
                 optim: Optim = Optim(), schedule: Schedule = Schedule(), scheduler=None):
        self.model, self.optimizer, self.loss_fn, self.scheduler = model, optimizer, loss_fn, scheduler
        self.optim, self.schedule = optim, schedule

    def begin(self, step: int, total_steps: int) -> None:
        if self.optimizer is None:
            self.model.zero_grad(set_to_none=True)
            return
        if self.scheduler is None:
            set_lr(self.optimizer, self.optim.lr, self.schedule, step, total_steps)
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, part: Any, share: float, last: bool) -> torch.Tensor:
        # DDP all-reduces the gradients once, with the last micro-batch's backward
        with contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync():
            loss = self.loss_fn(part)
            (loss * share).backward()
        return loss.detach().float()

    def finish(self) -> None:
        if self.optimizer is None:
            return
        if self.optim.clip_grad_norm:
            clip_grad_norm_(self.model.parameters(), self.optim.clip_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()


def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """torch's `clip_grad_norm_` for every job, over a model no rank may hold whole: the gradients' total
    norm by `torch.nn.utils.get_total_norm` for the plain ones and for each mesh's DTensors (TP and FSDP
    shards: their norm is a collective over that mesh; torch stacks norms of one mesh only), added over the
    pipeline ranks (`pp_group`), then torch's `clip_grads_with_norm_` on each group (the factor, a scalar,
    multiplies DTensor and plain gradients alike). Returns the total norm."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # never imported: no gradient is a DTensor
    sharded = dtensor.DTensor if dtensor is not None else ()
    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, sharded) else None
            groups.setdefault(key, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params]) for params in groups.values()]
    total = torch.nn.utils.get_total_norm([n.full_tensor() if isinstance(n, sharded) else n for n in norms])
    if pp_group is not None:
        squares = total ** 2
        torch.distributed.all_reduce(squares, group=pp_group)
        total = squares.sqrt()
    for params in groups.values():  # one call per group: torch's foreach multiply takes one kind of tensor
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


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
