"""What every rank of a model-parallel run needs to build, split and train the model: the task (the
built-in MLP, or `--task FILE.py:NAME`) with its `tp_plan` and `pipeline_split` (see
`rayhpc.parallel.plan`). Made once in the driver, checked there, and shipped to the ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayhpc.config import ConfigError
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.plan import check_divisible, check_tp_plan, choose_stage_starts, keep_stage


class _Returns(nn.Module):
    """A stand-in model that returns a pipeline's last-stage output, so a task's `loss(model, batch)`
    and `metrics(model, batch)` can score it: `loss(_Returns(output), (None, target))` is the task's
    loss of that output."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output

    def forward(self, _inputs) -> torch.Tensor:
        return self.output


@dataclass
class Recipe:
    cfg: ParallelConfig
    hp: dict  # the platform's hyperparameters (lr, optimizer, seed...) and the task's own
    task: Any  # rayhpc.task.LoadedTask: the built-in MLP unless --task names another

    def build(self) -> nn.Module:
        """The whole model, initialised from torch's current RNG state (seed it first)."""
        return self.task.obj.model(self.hp)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of a (micro)batch's output; the pipeline schedule averages over microbatches."""
        return self.task.obj.loss(_Returns(output), (None, target))

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict:
        """The task's own metrics of a batch's output (`metrics(model, batch)`, e.g. bits per byte)."""
        return self.task.metrics(_Returns(output), (None, target))

    def hook(self, name: str, needed_for: str):
        """The task's `name` method, which `needed_for` requires."""
        method = getattr(self.task.obj, name, None)
        if method is None:
            raise ConfigError(f"task {self.task.where()}: has no {name}(model), which {needed_for} needs")
        return method

    def tp_plan(self, stage: nn.Module) -> dict:
        """The task's TP plan of this stage's modules (a stage may start anywhere: the plan is asked of it)."""
        present = dict(stage.named_modules())
        plan = self.hook("tp_plan", f"tensor parallelism (--tp {self.cfg.parallelism.tp})")(stage)
        return {path: style for path, style in plan.items() if path in present}

    def stage_starts(self, model: nn.Module) -> list[str]:
        """Where pipeline stages 1, 2, ... begin (none without pipeline parallelism)."""
        p = self.cfg.parallelism
        if p.n_stages == 1:
            return []
        points = list(self.hook("pipeline_split", f"pipeline parallelism (--pp {p.pp})")(model))
        label = f"parallelism.pp (--pp) {p.pp}" + (f" x stages_per_rank {p.per_rank_stages}"
                                                    if p.per_rank_stages > 1 else "")
        return choose_stage_starts(model, points, p.n_stages, label=label)

    def tokens(self, samples_per_s: float) -> str:
        """", N tokens/s" for a task that says how many tokens a sample holds, else ""."""
        per_sample = self.task.tokens_per_sample(self.hp)
        return f", {samples_per_s * per_sample:,.0f} tokens/s" if per_sample else ""

    def check(self) -> None:
        """Every plan error, before any actor starts: each stage built on the meta device (shapes only) and
        its TP plan checked."""
        tp = self.cfg.parallelism.tp
        with torch.device("meta"):
            starts = self.stage_starts(self.build())
        if tp == 1:
            return
        divisible = getattr(self.task.obj, "tp_divisible", None)
        check_divisible(divisible(self.hp) if divisible else {}, tp)
        for stage_id in range(len(starts) + 1):
            with torch.device("meta"):
                stage = keep_stage(self.build(), starts, stage_id)
            check_tp_plan(stage, self.tp_plan(stage), tp)
