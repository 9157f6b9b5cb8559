"""The training loop every job runs (torchtitan's `train()`): step-based, the epochs derived from the steps.

`fit` walks a run's optimizer steps, from the step it resumes at to its last, epoch by epoch: a run of
`steps` cuts its last epoch short. It owns what every job does alike: where a resumed run starts within
its epoch, the window of losses each report covers (a mid-epoch report the steps since the last, an epoch's
report the whole epoch; the loss weighted by the samples of each step, so a partial last batch counts for
what it holds), the mid-epoch cadence (a checkpoint, a metrics row or a
validation every K steps), the epoch's end, the best-so-far, and stopping. A runner says only where and
how things run (`Runner`): the Ray Train worker, a Tune trial's pack, an array task, the model-parallel
driver and a parameter-server worker each plug in their batches, their step (`rayhpc.engine.train_step`,
or a call to their ranks) and what their reports become.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterable, Iterator

import torch

from rayhpc.config import JobFailed
from rayhpc.optim import step_plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's steps (`total`, epochs of `per_epoch`) and its mid-epoch cadence, each every K steps (None:
    never; an epoch's end is always a report, a checkpoint where the job keeps them, and a validation)."""

    per_epoch: int
    total: int
    checkpoint_every: int | None = None
    metrics_every: int | None = None
    eval_every: int | None = None

    @classmethod
    def of(cls, per_epoch: int, epochs: int | None, steps: int | None, **every: int | None) -> Plan:
        """`steps` steps, else `epochs` epochs, of `per_epoch` steps each."""
        return cls(per_epoch, step_plan(per_epoch, epochs, steps)[0], **every)

    @property
    def epochs(self) -> int:
        return math.ceil(self.total / self.per_epoch)

    def span(self, epoch: int) -> range:
        """Epoch `epoch`'s global steps (the last epoch cut short at `total`)."""
        return range(epoch * self.per_epoch, min(self.total, (epoch + 1) * self.per_epoch))

    def due(self, step: int) -> Due:
        """What is due after global step `step` (0-based) when it is not its epoch's last."""
        done = step + 1
        return Due(*(bool(every) and done % every == 0
                     for every in (self.checkpoint_every, self.metrics_every, self.eval_every)))


@dataclasses.dataclass(frozen=True)
class Due:
    checkpoint: bool = False
    metrics: bool = False
    evaluate: bool = False

    def __bool__(self) -> bool:
        return self.checkpoint or self.metrics or self.evaluate


@dataclasses.dataclass
class Window:
    """Steps and what they took: those since the last report, or a whole epoch's. The loss sum stays where the
    losses are (a device, and one value per pack member where a pack trains): reading it every step would make
    the host wait for the GPU every step."""

    loss_sum: Any = 0.0  # each step's loss x its samples
    samples: int = 0
    steps: int = 0
    data_seconds: float = 0.0  # host time spent waiting for the next batch
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor | float, samples: int, waited: float = 0.0) -> None:
        self.loss_sum = self.loss_sum + loss * samples
        self.samples += samples
        self.steps += 1
        self.data_seconds += waited

    @property
    def loss(self):
        """The mean loss over the window's samples."""
        return self.loss_sum / max(self.samples, 1)


def _timed(batches: Iterable) -> Iterator[tuple[Any, float]]:
    """(batch, the seconds it took to arrive) for each of `batches`."""
    it = iter(batches)
    while True:
        asked = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch, time.perf_counter() - asked


class Diverged(JobFailed):
    """The run's loss stopped being finite: the job ends there, before it reports or saves that step (exit 1)."""


# what every line of a diverged run says after naming where (its loss here, its val_loss in `metrics_row`)
DIVERGED_FIX = ("the run diverged; lower optim.lr (--lr), clip the gradients (optim.clip_grad_norm) or warm up "
                "(schedule.warmup_steps), and resume from its last checkpoint or start again")


class LossWatch:
    """The first step whose loss was not finite, and the last finite loss before it. Kept on the loss's device,
    step by step: reading the loss each step would make the host wait for the GPU each step; it is read where
    a report is due, which it then precedes (`fit`)."""

    def __init__(self):
        self.first_bad: torch.Tensor | None = None  # that step (0-based; inf: none yet)
        self.last: torch.Tensor | None = None  # [the last finite loss, its step] before it

    def add(self, step: int, loss) -> None:
        loss = torch.as_tensor(loss).detach().float()
        if self.first_bad is None:
            self.first_bad = torch.full((), math.inf, device=loss.device)
            self.last = torch.full((2,), math.nan, device=loss.device)
        finite = torch.isfinite(loss).all()
        clean = torch.isinf(self.first_bad)  # every step so far finite
        loss = loss.reshape(())
        self.last = torch.where(finite & clean, torch.stack([loss, torch.full_like(loss, step)]), self.last)
        self.first_bad = torch.where(~finite & clean, float(step), self.first_bad)

    def diverged(self) -> Diverged | None:
        """Where a step's loss was not finite: the error that ends the run, naming that step (1-based, as the
        metrics rows count them) and the last finite loss."""
        if self.first_bad is None or math.isinf(first := float(self.first_bad)):
            return None
        loss, at = self.last.tolist()
        before = "no finite loss before" if math.isnan(loss) else \
            f"its last finite loss {loss:.6g} at step {at + 1:.0f}"
        return Diverged(f"the loss is not finite (nan or inf) at optimizer step {first + 1:.0f}, {before}: "
                        f"{DIVERGED_FIX}")


class Runner:
    """Where and how a job's steps run; `fit` decides when each is called. A runner gives `batches` and `step`;
    one that reports nothing mid-epoch, or nothing at an epoch's end, keeps these defaults."""

    watch_loss = True  # whether `fit` ends the run where its loss (a scalar) stops being finite (`LossWatch`)

    def batches(self, epoch: int, steps: range) -> Iterable[Any]:
        """The batches of global steps `steps` of epoch `epoch` (a resumed run's first epoch skips those done)."""
        raise NotImplementedError

    def step(self, step: int, batch: Any) -> tuple[Any, int]:
        """Global step `step` on `batch`: (its loss, detached; the samples it took)."""
        raise NotImplementedError

    def mid_epoch(self, step: int, due: Due, window: Window, epoch: Window) -> bool:
        """What `due` asks after global step `step`; whether it reported `window` (a fresh one starts).
        `epoch`: the epoch's steps so far (a resumed epoch's: since the resume)."""
        return False

    def end_epoch(self, epoch: int, window: Window) -> bool:
        """Epoch `epoch` (0-based) ended, its steps in `window` (a resumed epoch's: those since the resume);
        whether to stop."""
        return False


def fit(plan: Plan, runner: Runner, start: int = 0, stop: int | None = None) -> int:
    """Run `runner` from global step `start` to `stop` (default: the plan's last); the epochs run to their end,
    or fewer where `end_epoch` stopped the run."""
    stop = plan.total if stop is None else min(stop, plan.total)
    epochs = math.ceil(stop / plan.per_epoch)
    watch = LossWatch() if runner.watch_loss else None
    # a run restored from its last checkpoint has nothing left: its last epoch ended and was reported
    for epoch in range(start // plan.per_epoch if start < stop else epochs, epochs):
        span = plan.span(epoch)
        steps = range(max(start, span.start), min(stop, span.stop))
        # the epoch's steps (a resumed epoch's: from the resume), and those since a mid-epoch report if any
        whole, since = Window(), None
        # zip asks `steps` first: no batch is drawn past the last step
        for step, (batch, waited) in zip(steps, _timed(runner.batches(epoch, steps))):
            loss, samples = runner.step(step, batch)
            if watch is not None:
                watch.add(step, loss)
            for window in (whole, since) if since is not None else (whole,):
                window.add(loss, samples, waited)
            if step + 1 < span.stop and (due := plan.due(step)):
                _check(watch)  # nothing reported or saved of a diverged run's steps
                if runner.mid_epoch(step, due, since or whole, whole):
                    since = Window()
        _check(watch)
        if steps.stop < span.stop:  # a run cut short mid-epoch (a worker's share of its epoch)
            return epoch
        if runner.end_epoch(epoch, whole):
            return epoch + 1
    return epochs


def _check(watch: LossWatch | None) -> None:
    if watch is not None and (error := watch.diverged()) is not None:
        raise error


class Best:
    """The best validation loss so far and the best of the task's objective (`objective`: name, "min" or
    "max"), per value: scalars, or one per pack member (tensors, compared element by element)."""

    def __init__(self, objective: tuple[str, str], so_far: dict | None = None):
        self.modes = {objective[0]: objective[1], "val_loss": "min"}  # a loss is never better higher
        self.so_far = dict(so_far or {})

    def update(self, values: dict) -> dict:
        """Take `values` in; `best_<name>` of every value seen so far (the objective's first, in every job)."""
        for name, mode in self.modes.items():
            if name in values:
                self.so_far[name] = _better(self.so_far.get(name), values[name], mode)
        return {f"best_{name}": self.so_far[name] for name in self.modes if name in self.so_far}


def _better(old, new, mode: str):
    """The better of `old` and `new`; a NaN is never better (a diverged pack member keeps its best before)."""
    if old is None or (not isinstance(old, torch.Tensor) and math.isnan(old)):
        return new
    if isinstance(new, torch.Tensor):
        return torch.fmin(old, new) if mode == "min" else torch.fmax(old, new)
    # a NaN `new` loses either way: min and max keep the first where no comparison holds
    return min(old, new) if mode == "min" else max(old, new)
