"""The same training as a model-parallel run, in one process on the unsharded model: what
tests compare every parallel layout against."""

from __future__ import annotations

import torch

from rayhpc.data import step_indices
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.trainer import make_recipe
from rayhpc.task.hparams import PlatformHParams


def reference_run(cfg: ParallelConfig) -> tuple[list[float], dict[str, torch.Tensor], dict[str, float] | None]:
    """(loss per step, final weights by name, final validation loss and task metrics or None): same seed,
    same batches, same optimizer, whole batch at once."""
    recipe, data = make_recipe(cfg)
    x, y = data["train"]
    torch.manual_seed(cfg.seed)
    model = recipe.build()
    optimizer = plain_optimizer(cfg, model.parameters())
    losses = []
    for step in range(cfg.steps):
        idx = step_indices(len(x), cfg.batch_size, cfg.seed, step)
        optimizer.zero_grad()
        loss = recipe.loss(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, weights, validation(recipe, model, data["val"])


def plain_optimizer(cfg: ParallelConfig, params) -> torch.optim.Optimizer:
    """The optimizer the user chose, made here from the config itself (not from the run's recipe), so a
    run that trained with another optimizer, or without its state, differs from this reference."""
    defaults = PlatformHParams()  # momentum and weight decay: not part of a model-parallel config
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=defaults.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=defaults.momentum, weight_decay=defaults.weight_decay)


@torch.no_grad()
def validation(recipe, model, val) -> dict[str, float] | None:
    """Mean loss and task metrics over the whole batches of the validation data."""
    if val is None:
        return None
    xv, yv = val
    batch = recipe.cfg.batch_size
    sums: dict[str, float] = {}
    for start in range(0, len(xv) - batch + 1, batch):
        output = model(xv[start:start + batch])
        scores = {"val_loss": recipe.loss(output, yv[start:start + batch]),
                  **recipe.metrics(output, yv[start:start + batch])}
        for name, value in scores.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return {name: value / (len(xv) // batch) for name, value in sums.items()}
