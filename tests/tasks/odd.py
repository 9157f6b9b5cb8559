"""Tasks that test packing's limits: BatchNorm (packable: running statistics stay per member), a branch on
each member's own weights and `.item()` in the loss (neither runs under vmap)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

X = torch.randn(128, 4, generator=torch.Generator().manual_seed(0))


class Base:
    val_fraction = 0.25

    def data(self, hp):
        return TensorDataset(X, X.sum(1, keepdim=True)), None

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)


class Norm(Base):
    def model(self, hp):
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


class Branchy(Base):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            h = self.a(x)
            return h if h.mean() > 0 else self.b(x)  # a branch on each member's own weights

    def model(self, hp):
        return self.Model()


class ItemLoss(Base):
    def model(self, hp):
        return nn.Linear(4, 1)

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y) * (2.0 if model.weight.sum().item() > 0 else 1.0)
