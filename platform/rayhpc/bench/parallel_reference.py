"""The same training as a model-parallel run, in one process on the unsharded model: what
tests compare every parallel layout against."""

from __future__ import annotations

import torch

from rayhpc.data import step_indices
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.trainer import make_recipe
from rayhpc.task.hparams import make_optimizer


def reference_run(cfg: ParallelConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(loss per step, final weights by name): same seed, same batches, same optimizer, whole batch at once."""
    recipe, (x, y) = make_recipe(cfg)
    torch.manual_seed(cfg.seed)
    model = recipe.build()
    optimizer = make_optimizer(recipe.hp, model.parameters())
    losses = []
    for step in range(cfg.steps):
        idx = step_indices(len(x), cfg.batch_size, cfg.seed, step)
        optimizer.zero_grad()
        loss = recipe.loss(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
