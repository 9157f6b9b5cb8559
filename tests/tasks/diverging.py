"""A task whose loss leaves float32's range at a known step: one weight w, starting at 1, and the loss w^2 on
every batch (the data only sets the steps). SGD at lr 500.5 multiplies w by 1 - 2 x 500.5 = -1000 each step,
so step t's loss is 1e6^t: finite up to 1e36, inf at the eighth step. At a small lr it converges, as any task."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Diverging:
    val_fraction = 0.2

    def model(self, hp):
        model = nn.Linear(1, 1, bias=False)
        nn.init.ones_(model.weight)
        return model

    def data(self, hp):
        ones = torch.ones(40, 1)  # 32 to train on, 8 to validate
        return TensorDataset(ones, ones), None

    def loss(self, model, batch):
        x, _ = batch
        return model(x).pow(2).mean()  # x is 1: w^2
