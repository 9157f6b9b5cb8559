"""A small regression whose packed step is slower than its members' steps in turn (as a vmapped convolution on a
CPU can be): under vmap (a pack) the model's output has no value to read, and the loss then sleeps 50 ms."""

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class SlowPacked:
    def model(self, hp):
        return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def data(self, hp):
        x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x.sum(1, keepdim=True)), TensorDataset(x[:16], x[:16].sum(1, keepdim=True))

    def loss(self, model, batch):
        x, y = batch
        out = model(x)
        try:
            float(out.sum())  # a trial alone: a number
        except RuntimeError:  # a pack, under vmap: no value to give
            time.sleep(0.05)
        return F.mse_loss(out, y)
