"""Measure the pipeline bubble: the share of a step each rank spends idle, next to each schedule's
formula for p ranks, v stages per rank and m microbatches, with a stage's forward (F), backward for
inputs (B) and backward for weights (W) taking equal time (the zero-bubble paper's assumption):

    gpipe, 1f1b        (p - 1) / (m + p - 1)       1F1B holds fewer activations, same bubble
    interleaved1f1b    (p - 1) / (v m + p - 1)     shorter stages fill the pipeline v times faster
    interleavedzb      (p - 1) / (3 v m + p - 1)   ZB1P: W fills the bubble, a third of 1F1B's
    zbv                0                            ZB-V: zero when F = B = W
"""

from __future__ import annotations

import statistics
import time

import torch

from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.worker import RankRun, autocast, pipeline_schedule, replica_batch
from rayhpc.workers.group import WorkerContext, WorkerGroup

STAGE_WORK = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def bubble_formula(schedule: str, stages: int, microbatches: int, per_rank: int = 1) -> float:
    p, m, v = stages, microbatches, per_rank
    if schedule == "zbv":
        return 0.0
    fill = {"interleaved1f1b": v * m, "interleavedzb": 3 * v * m}.get(schedule, m)
    return (p - 1) / (fill + p - 1)


class BusyClock:
    """Seconds a rank's pipeline stages spend computing: each stage's forward, backward (for inputs, or
    whole) and backward-for-weights chunk calls, timed around the call. The schedules wait for received
    activations and gradients before these calls, so waiting is not counted as busy. (Module hooks
    would miss the weight-gradient pass the zero-bubble schedules run separately.)

    On a GPU the marks are CUDA events, so the time is the device's: the host only queues kernels
    and returns at once (host clocks would read a busy GPU stage as idle).
    """

    def __init__(self, stages: list, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()
        for stage in stages:
            for method, kind in STAGE_WORK.items():
                setattr(stage, method, self._timed(getattr(stage, method), kind))

    def reset(self) -> None:
        self.spans: list[tuple] = []  # (kind, start, end): perf_counter seconds, or CUDA events

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timed(self, call, kind: str):
        def timed(*args, **kwargs):
            start = self._mark()
            out = call(*args, **kwargs)
            self.spans.append((kind, start, self._mark()))
            return out
        return timed

    def busy(self) -> dict[str, float]:
        """Busy seconds since `reset` by kind (F, B, W; waits for the device)."""
        if self.cuda:
            torch.cuda.synchronize()
        found = dict.fromkeys(STAGE_WORK.values(), 0.0)
        for kind, start, end in self.spans:
            found[kind] += start.elapsed_time(end) / 1000 if self.cuda else end - start
        return found


def install_clock(ctx: WorkerContext) -> None:
    run: RankRun = ctx.state["run"]
    with autocast(run.cfg.precision, ctx.device, run.cfg.parallelism.fsdp_applies):
        stages = pipeline_schedule(run, replica_batch(run, 0)[0])[1]  # a forward of one micro-batch: every rank
    ctx.state["clock"] = BusyClock(stages, ctx.device)


def timed_pipeline_step(ctx: WorkerContext, step: int) -> tuple[int, dict[str, float], int, float]:
    """(pipeline rank, busy seconds by kind, chunks computed, step seconds) of one schedule step started
    on every rank at once."""
    import torch.distributed as dist

    run: RankRun = ctx.state["run"]
    clock: BusyClock = ctx.state["clock"]
    x, y = replica_batch(run, step)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    dist.barrier()
    clock.reset()
    started = time.perf_counter()
    for optimizer in run.optimizers:
        optimizer.zero_grad()
    with autocast(run.cfg.precision, ctx.device, run.cfg.parallelism.fsdp_applies):
        pipeline_schedule(run, x)[0].step(*((x,) if run.first_stage else ()), target=y if run.last_stage else None,
                          losses=[] if run.last_stage else None)
    busy = clock.busy()  # synchronises on a GPU: the step's wall ends when its kernels do
    return run.coords["pp"], busy, len(clock.spans), time.perf_counter() - started


def measure_bubble(group: WorkerGroup, cfg: ParallelConfig, data, warmup: int = 1) -> dict:
    """Idle fraction per pipeline rank (median over `cfg.steps` timed steps) of the layout `cfg`, on
    `group`, and the mean seconds per forward, input-backward and weight-backward chunk."""
    from rayhpc.parallel import worker
    from rayhpc.parallel.trainer import make_recipe

    group.run(worker.setup, make_recipe(cfg)[0], data)
    group.run(install_clock)
    for step in range(warmup):
        group.run(timed_pipeline_step, step)
    idle: dict[int, list[float]] = {}
    walls, work = [], {}
    for step in range(warmup, warmup + cfg.steps):
        outcomes = group.run(timed_pipeline_step, step)
        # the step ends when the last rank does: a rank that finishes its own part early
        # would look busier than it is against its own clock
        wall = max(o[3] for o in outcomes)
        walls.append(wall)
        for rank, busy, _, _ in outcomes:
            idle.setdefault(rank, []).append(1 - sum(busy.values()) / wall)
            for kind, seconds in busy.items():
                work[kind] = work.get(kind, 0.0) + seconds
    per_rank = {rank: statistics.median(v) for rank, v in sorted(idle.items())}
    p = cfg.parallelism
    chunks = cfg.steps * p.n_stages * p.n_microbatches  # each stage computes each microbatch once
    return {"idle": per_rank, "mean_idle": statistics.mean(per_rank.values()), "step_s": statistics.median(walls),
            "chunk_ms": {kind: 1e3 * seconds / chunks for kind, seconds in work.items()},
            "formula": bubble_formula(p.schedule, p.pp, p.n_microbatches, p.per_rank_stages)}
