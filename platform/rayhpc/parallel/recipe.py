"""What every rank of a model-parallel run needs to build, split and train the model: the built-in
`model:` section (an MLP or a transformer stack) or the user's task (`--task FILE.py:NAME` with
`tp_plan` and `pipeline_split`, see `rayhpc.parallel.plan`). Made once in the driver, checked there,
and shipped to the ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.plan import check_divisible, check_tp_plan, choose_stage_starts, units


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
    hp: dict  # the platform's hyperparameters (lr, optimizer, seed...) and a task's own
    task: Any = None  # rayhpc.task.LoadedTask, or None for the built-in model section
    in_features: int = 0  # the built-in MLP's widths, from the data
    out_features: int = 0

    def build(self) -> nn.Module:
        """The whole model, initialised from torch's current RNG state (seed it first)."""
        if self.task is not None:
            return self.task.obj.model(self.hp)
        return self.cfg.model.build(self.in_features, self.out_features)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of a (micro)batch's output; the pipeline schedule averages over microbatches."""
        if self.task is not None:
            return self.task.obj.loss(_Returns(output), (None, target))
        return nn.functional.mse_loss(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict:
        """The task's own metrics of a batch's output (`metrics(model, batch)`, e.g. bits per byte); none
        for the built-in model."""
        return self.task.metrics(_Returns(output), (None, target)) if self.task is not None else {}

    def tp_plan(self, stage: nn.Module) -> dict:
        """The TP plan of this stage's modules (a task's plan is checked on the whole model, up front)."""
        from rayhpc.parallel.tp import mlp_plan, transformer_plan

        if self.task is None:
            return mlp_plan(stage) if self.cfg.model.kind == "mlp" else transformer_plan(stage)
        present = dict(stage.named_modules())
        return {path: style for path, style in self.task.obj.tp_plan(stage).items() if path in present}

    def split_points(self, model: nn.Module) -> list[str]:
        """Where a stage may begin: the task's `pipeline_split`, or each built-in Linear or block after the first."""
        if self.task is not None:
            return list(self.task.obj.pipeline_split(model))
        layers = units(model)
        return [u for u in layers[1:] if any(True for _ in model.get_submodule(u).parameters())]

    def stage_starts(self, model: nn.Module) -> list[str]:
        """Where pipeline stages 1, 2, ... begin (none without pipeline parallelism)."""
        cfg = self.cfg
        if cfg.n_stages == 1:
            return []
        label = f"pp (--pp) {cfg.pp} x stages_per_rank {cfg.per_rank_stages}" if cfg.per_rank_stages > 1 else None
        return choose_stage_starts(model, self.split_points(model), cfg.n_stages, label=label)

    def tokens(self, samples_per_s: float) -> str:
        """", N tokens/s" for a task that says how many tokens a sample holds, else ""."""
        per_sample = self.task.tokens_per_sample(self.hp) if self.task is not None else None
        return f", {samples_per_s * per_sample:,.0f} tokens/s" if per_sample else ""

    def check(self) -> None:
        """Every plan error, before any actor starts: built on the meta device (shapes only)."""
        with torch.device("meta"):
            model = self.build()
        if self.task is not None and self.cfg.tp > 1:
            check_tp_plan(model, self.task.obj.tp_plan(model), self.cfg.tp)
            divisible = getattr(self.task.obj, "tp_divisible", None)
            check_divisible(divisible(self.hp) if divisible else {}, self.cfg.tp)
        self.stage_starts(model)
