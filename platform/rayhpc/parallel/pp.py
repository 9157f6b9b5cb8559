"""Pipeline parallelism: the model split by layer into stages, run by a torch.distributed.pipelining schedule."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

SCHEDULES = ("gpipe", "1f1b")


def units(model: nn.Module) -> list[list[str]]:
    """The model's layers as splittable units: a Linear with the ReLU after it, or a whole block."""
    out: list[list[str]] = []
    for name, layer in model.layers.named_children():
        if isinstance(layer, nn.ReLU) and out:
            out[-1].append(name)
        else:
            out.append([name])
    return out


def stage_ranges(n_units: int, stages: int) -> list[range]:
    """Contiguous, near-equal runs of units per stage (earlier stages get the extra unit)."""
    bounds = [round(i * n_units / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class Stage(nn.Module):
    """One pipeline stage: the model's own layers for this stage, under their original names,
    so parameter names (`layers.4.weight`) are the same as in the whole model."""

    def __init__(self, layers: OrderedDict):
        super().__init__()
        self.layers = nn.Sequential(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def split_stage(model: nn.Module, stage: int, stages: int) -> Stage:
    """Stage `stage` of `stages`, holding the model's layers (not copies)."""
    groups = units(model)
    names = [n for i in stage_ranges(len(groups), stages)[stage] for n in groups[i]]
    children = dict(model.layers.named_children())
    return Stage(OrderedDict((n, children[n]) for n in names))


def build_schedule(stage_module: nn.Module, stage: int, stages: int, device: torch.device, group,
                   schedule: str, microbatches: int, loss_fn):
    """A pipelining schedule over this rank's stage (gradients averaged over microbatches)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pipe_stage = PipelineStage(stage_module, stage, stages, device, group=group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return cls(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn)
