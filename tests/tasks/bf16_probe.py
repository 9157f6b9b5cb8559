"""A task whose validation metric says how bf16 reached its model: the last module multiplies by a parameter
element by element, which autocast leaves to type promotion (a bf16 activation times an fp32 parameter is
fp32), while FSDP's mixed-precision policy casts the parameter itself (the product is bf16)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Scale(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2), Scale(2))

    def forward(self, x):
        return self.layers(x)


class BF16Probe:
    val_fraction = 0.25

    def model(self, hp):
        return Probe()

    def pipeline_split(self, model):
        """A second stage may begin at the second Linear: it holds that Linear and the probe."""
        return ["layers.2"]

    def data(self, hp):
        x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x[:, :2] - x[:, 2:]), None

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def metrics(self, model, batch):
        x, _ = batch
        return {"bf16_output": torch.tensor(float(model(x).dtype == torch.bfloat16))}
