"""The task interface: what a user writes so that every job trains their model on their data.

A task is any object with `model`, `data` and `loss` methods (duck-typed, as Ray Tune
trainables and Lightning modules are); subclassing `Task` is optional and only supplies
the defaults below. Name it on the command line as `--task FILE.py:NAME` or
`--task package.module:NAME`; NAME is a class (instantiated with no arguments) or an
instance.

    class Regression(Task):
        hparams = {"width": 64}                        # searchable like lr; types from the defaults

        def model(self, hp):
            return nn.Sequential(nn.Linear(8, hp["width"]), nn.ReLU(), nn.Linear(hp["width"], 1))

        def data(self, hp):
            return TensorDataset(x_train, y_train), TensorDataset(x_val, y_val)

        def loss(self, model, batch):
            x, y = batch
            return F.mse_loss(model(x), y)

`hp` is a dict: the platform's hyperparameters (lr, batch_size, optimizer, momentum,
weight_decay, seed) and the task's own (`hparams`), each with its trial's value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset


class Task:
    """Defaults for the optional parts of a task; subclass it or write the three methods on any class."""

    #: the task's own hyperparameters and their defaults: a dict (types from the defaults)
    #: or a pydantic model class (types and bounds from its fields)
    hparams: Any = {}
    #: which reported value a sweep optimises, and "min" or "max": "val_loss" or "val_<metric>"
    objective: tuple[str, str] = ("val_loss", "min")
    #: share of `train` held out for validation when `data()` returns no validation set
    #: (the job's `data.val_fraction` overrides it); None: no validation then
    val_fraction: float | None = None
    #: a sweep's search space when the sweep file gives none (same form as `space:` in YAML)
    space: dict | None = None

    def model(self, hp: dict) -> nn.Module:
        """A fresh model for a trial with hyperparameters `hp` (the platform seeds torch first)."""
        raise NotImplementedError

    def data(self, hp: dict) -> tuple[Dataset, Dataset | None]:
        """(train, val): map-style datasets whose items the default collate batches; val may be None."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar training loss of `model` on one batch (a mean over the batch)."""
        raise NotImplementedError

    # Optional, so not defined here (its absence means "no metrics"):
    #   def metrics(self, model, batch) -> dict[str, torch.Tensor]
    # scalar means over the batch (accuracy, ...), averaged over the validation set and
    # reported as val_<name> beside val_loss.
    #
    # Optional too (absent: the job's `optim:` and `schedule:` sections, or the trial's hp):
    #   def optimizer(self, params, hp) -> torch.optim.Optimizer
    #   def scheduler(self, optimizer, hp) -> torch.optim.lr_scheduler.LRScheduler
    # the scheduler is stepped after every optimizer step and replayed to its step on resume;
    # a sweep then trains the trials one at a time (packs step only the platform's optimizers),
    # and the parameter-server job refuses such a task.
    #
    # Optional too (absent: the entries of the model's outermost ModuleLists, else the modules holding parameters):
    #   def blocks(self, model) -> list[nn.Module]
    # what activation checkpointing and compilation work on; and (absent: the modules holding parameters)
    #   def fsdp_units(self, model) -> list[nn.Module]
    # what FSDP2 shards one at a time (a unit sharing a parameter with a module outside it stays with the root).
