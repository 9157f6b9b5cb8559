"""Pipeline parallelism: the model split by layer into stages, run by a torch.distributed.pipelining schedule.

With one stage per rank (GPipe, 1F1B) rank r runs stage r. The interleaved and zero-bubble schedules
give each rank several stages (virtual stages): the pipeline fills faster because each stage is
shorter. Looped placement (Interleaved1F1B, InterleavedZeroBubble): rank r holds stages r, r + p,
r + 2p...; V placement (ZBVZeroBubble, exactly 2 per rank): rank r holds stages r and 2p - 1 - r, so
rank 0 holds the first and the last stage.
"""

from __future__ import annotations

import torch
from torch import nn

# name: (torch.distributed.pipelining class, stage placement, stages per rank it allows)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop", "1"),
    "1f1b": ("Schedule1F1B", "loop", "1"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", "loop", "2 or more"),
    "interleavedzb": ("ScheduleInterleavedZeroBubble", "loop", "2 or more"),
    "zbv": ("ScheduleZBVZeroBubble", "v", "2"),
}

SPLIT_BACKWARD = ("interleavedzb", "zbv")  # the zero-bubble schedules: backward for inputs, then for weights


def default_stages_per_rank(schedule: str) -> int:
    return 1 if SCHEDULES[schedule][2] == "1" else 2


def allows(schedule: str, per_rank: int) -> bool:
    rule = SCHEDULES[schedule][2]
    return per_rank >= 2 if rule == "2 or more" else per_rank == int(rule)


def rank_stages(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The global stage indices that pipeline rank `pp_rank` holds, in the order the schedule takes them."""
    if SCHEDULES[schedule][1] == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def build_schedule(parts: list[nn.Module], stage_ids: list[int], n_stages: int, device: torch.device, group,
                   schedule: str, microbatches: int, loss_fn, inputs: list, outputs: list):
    """A pipelining schedule over this rank's stages, and the stages, each given an example of its inputs and
    outputs (a micro-batch's). The gradients are the sum over the microbatches of `loss_fn`'s (which scales them:
    `scale_grads=False`)."""
    import torch.distributed.pipelining as pipelining  # about 1 s to import, only for pipeline runs

    stages = [pipelining.PipelineStage(part, index, n_stages, device, input_args=given, output_args=made, group=group)
              for part, index, given, made in zip(parts, stage_ids, inputs, outputs)]
    cls = getattr(pipelining, SCHEDULES[schedule][0])
    single = SCHEDULES[schedule][2] == "1"  # PipelineScheduleSingle takes a stage, the others a list
    return cls(stages[0] if single else stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False), stages
