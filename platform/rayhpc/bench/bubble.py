"""Measure the pipeline bubble: the share of a step each stage spends idle, next to GPipe's
formula (p - 1) / (m + p - 1) for p stages and m microbatches (1F1B has the same bubble; it
holds fewer activations at once)."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.worker import RankRun, autocast, replica_batch
from rayhpc.workers.group import WorkerContext, WorkerGroup


def bubble_formula(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


class BusyClock:
    """Seconds a stage module spends in forward and backward, from module hooks.

    On a GPU the hooks record CUDA events, so the time is the device's: the host only queues
    kernels and returns at once (host clocks would read a busy GPU stage as idle). An event
    recorded at a forward's start fires when the stream reaches it, after the wait for the
    activations received from the previous stage, so waiting is not counted as busy.
    """

    def __init__(self, module: nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)
        module.register_full_backward_pre_hook(self._start)
        module.register_full_backward_hook(self._stop)

    def reset(self) -> None:
        self.spans: list[list] = []  # [start, end] marks: perf_counter seconds, or CUDA events

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, *_) -> None:
        self.spans.append([self._mark()])

    def _stop(self, *_) -> None:
        self.spans[-1].append(self._mark())

    def busy(self) -> float:
        """Busy seconds since `reset` (waits for the device)."""
        if not self.cuda:
            return sum(end - start for start, end in self.spans)
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.spans) / 1000


def install_clock(ctx: WorkerContext) -> None:
    ctx.state["clock"] = BusyClock(ctx.state["run"].module, ctx.device)


def timed_pipeline_step(ctx: WorkerContext, step: int) -> tuple[int, float, float]:
    """(stage, busy seconds, step seconds) of one schedule step started on every rank at once."""
    import torch.distributed as dist

    run: RankRun = ctx.state["run"]
    clock: BusyClock = ctx.state["clock"]
    x, y = replica_batch(run, step)
    # an input that needs its gradient makes the first stage's backward hook fire when its
    # backward ends (without one it fires at the start, and the stage would look idle)
    x = x.clone().requires_grad_(True)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    dist.barrier()
    clock.reset()
    started = time.perf_counter()
    run.optimizer.zero_grad()
    with autocast(run.cfg, ctx.device):
        run.schedule.step(*((x,) if run.first_stage else ()), target=y if run.last_stage else None,
                          losses=[] if run.last_stage else None)
    busy = clock.busy()  # synchronises on a GPU: the step's wall ends when its kernels do
    return run.coords["pp"], busy, time.perf_counter() - started


def measure_bubble(group: WorkerGroup, cfg: ParallelConfig, data, warmup: int = 1) -> dict:
    """Idle fraction per stage (median over `cfg.steps` timed steps) of the layout `cfg`, on `group`."""
    from rayhpc.parallel import worker
    from rayhpc.parallel.trainer import make_recipe

    group.run(worker.setup, make_recipe(cfg)[0], data)
    group.run(install_clock)
    for step in range(warmup):
        group.run(timed_pipeline_step, step)
    idle: dict[int, list[float]] = {}
    walls = []
    for step in range(warmup, warmup + cfg.steps):
        outcomes = group.run(timed_pipeline_step, step)
        # the step ends when the last rank does: the last stage finishes its own part early
        # and would look busier than it is against its own clock
        wall = max(o[2] for o in outcomes)
        walls.append(wall)
        for stage, busy, _ in outcomes:
            idle.setdefault(stage, []).append(1 - busy / wall)
    per_stage = {stage: statistics.median(v) for stage, v in sorted(idle.items())}
    return {"idle": per_stage, "mean_idle": statistics.mean(per_stage.values()),
            "step_s": statistics.median(walls), "formula": bubble_formula(cfg.pp, cfg.n_microbatches)}
