"""Pipeline parallelism: the model split by layer into stages, run by a torch.distributed.pipelining schedule."""

from __future__ import annotations

import torch
from torch import nn

SCHEDULES = ("gpipe", "1f1b")


def stage_ranges(n_units: int, stages: int) -> list[range]:
    """Contiguous, near-equal runs of units per stage (earlier stages get the extra unit)."""
    bounds = [round(i * n_units / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def build_schedule(stage_module: nn.Module, stage: int, stages: int, device: torch.device, group,
                   schedule: str, microbatches: int, loss_fn):
    """A pipelining schedule over this rank's stage (gradients averaged over microbatches)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pipe_stage = PipelineStage(stage_module, stage, stages, device, group=group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return cls(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn)
