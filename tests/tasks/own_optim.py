"""A task that brings its own optimizer and learning-rate scheduler (RMSprop, halved every 3 steps by
torch's StepLR, whose lr depends on the lr before it: a resumed run must replay it), for the tests
that every runner steps them."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class OwnOptim:
    hparams = {"width": 8}

    def model(self, hp):
        return nn.Sequential(nn.Linear(2, hp["width"]), nn.Tanh(), nn.Linear(hp["width"], 1))

    def data(self, hp):
        x = torch.randn(256, 2, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, torch.sin(x @ torch.tensor([[1.5], [-0.5]]))), None

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def optimizer(self, params, hp):
        return torch.optim.RMSprop(params, lr=hp["lr"], alpha=0.9)

    def scheduler(self, optimizer, hp):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
