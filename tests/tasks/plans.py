"""Models whose model-parallel plan or split cannot work, each found before any actor starts: a plan that names a
Conv2d, attention heads that tensor parallelism does not divide (no `tp_divisible`), and a pipeline
split its forward never calls. A forward that calls a module a pipeline split removes (timm's ViT calls its final
norm on every stage) is traced instead, and works."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import TensorDataset

WIDTH, HEAD_DIM = 48, 8  # 6 heads


class Attention(nn.Module):
    """Tensor-parallel aware as torchtitan's: each rank's heads are its share of the width (`view(..., -1, HEAD_DIM)`)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = (t.view(*x.shape[:2], -1, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(4, WIDTH, 1)
        self.blocks = nn.ModuleList([Attention(), Attention()])
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)  # on every stage: the split set it to None on the first


class Base:
    def model(self, hp):
        return Net()

    def data(self, hp):
        x = torch.randn(64, 5, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, torch.randn(64, 5, WIDTH, generator=torch.Generator().manual_seed(1))), None

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)

    def pipeline_split(self, model):
        return ["blocks.1"]

    def tp_plan(self, model):
        plan = {}
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                plan |= {f"{name}.qkv": ColwiseParallel(), f"{name}.out": RowwiseParallel()}
        return plan


class ConvPlan(Base):
    def tp_plan(self, model):
        return {**super().tp_plan(model), "stem": ColwiseParallel()}


class Heads(Base):
    """6 heads, which a plan over 4 ranks splits into 1.5 each."""


class NormOnEveryStage(Base):
    """The final norm called by the first stage too, which does not hold it."""


class NotOnMeta(NormOnEveryStage):
    """A forward that reads a value (`.item()`), which the meta device has none of: the dry run leaves it to the
    ranks."""

    def model(self, hp):
        return ReadsAValue()


class ReadsAValue(Net):
    def forward(self, x):
        assert x.abs().sum().item() >= 0
        return super().forward(x)


class NeverCalled(Base):
    """A split point the forward never calls: traced, the model is one stage, not two."""

    def model(self, hp):
        return WithASpare()

    def pipeline_split(self, model):
        return ["spare"]


class WithASpare(Net):
    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(WIDTH, WIDTH)
