"""A small task with a hyperparameter, its own validation share and a metric, for tests that need a user's
task file outside the repository (they copy this file into a private folder first)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Line:
    hparams = {"width": 8}
    val_fraction = 0.25

    def model(self, hp):
        return nn.Sequential(nn.Linear(2, hp["width"]), nn.Tanh(), nn.Linear(hp["width"], 1))

    def data(self, hp):
        x = torch.randn(256, 2, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x @ torch.tensor([[1.5], [-0.5]])), None

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def metrics(self, model, batch):
        x, y = batch
        return {"abs_error": (model(x) - y).abs().mean()}
