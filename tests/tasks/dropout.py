"""A small regression with dropout, for tests where the random draws of training must match a
reference step for step (a trial that inherited another's RNG state would draw other masks).
`step_ms`: time each training step also sleeps, so that a test can act in the middle of an epoch."""

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Dropout:
    hparams = {"width": 16, "p": 0.25, "step_ms": 0.0}
    val_fraction = 0.25

    def model(self, hp):
        self.step_s = hp["step_ms"] / 1000
        return nn.Sequential(nn.Linear(3, hp["width"]), nn.Tanh(), nn.Dropout(hp["p"]), nn.Linear(hp["width"], 1))

    def data(self, hp):
        x = torch.randn(320, 3, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, torch.sin(x @ torch.tensor([[1.0], [-2.0], [0.5]]))), None

    def loss(self, model, batch):
        if model.training:
            time.sleep(self.step_s)
        x, y = batch
        return F.mse_loss(model(x), y)
