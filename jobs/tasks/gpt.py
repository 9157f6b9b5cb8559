"""A small decoder-only transformer (GPT) trained on bytes of text every Python install carries: the
source of a fixed, sorted list of standard-library modules (the corpus is the same everywhere for a
given Python version). Byte-level: a vocabulary of 256, nothing to download or tokenise.

    python jobs/train_mlp.py --task jobs/tasks/gpt.py:GPT --epochs 1 --num-workers 2
    python jobs/tune_mlp.py --task jobs/tasks/gpt.py:GPT --num-samples 4 --epochs 2

Beside `model`, `data` and `loss` it states how to split itself for model parallelism, as
torchtitan's `parallelize_llama` does: `tp_plan` (Megatron-style: attention q/k/v column-wise and
its output row-wise, the MLP up column-wise and down row-wise) and `pipeline_split` (a stage may
begin at any block). Heads under tensor parallelism: q/k/v are split by whole heads, and the
attention infers its local head count from the width it receives (`view(..., -1, head_dim)`), so
`heads` must be divisible by `tp`.
"""

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

# sorted; found through the import system, so a module that became a package (zipfile in 3.12) is read too
MODULES = ("argparse", "ast", "calendar", "collections", "configparser", "csv", "dataclasses", "datetime",
           "difflib", "enum", "fractions", "functools", "gettext", "heapq", "inspect", "json.decoder",
           "json.encoder", "logging", "pathlib", "pickle", "pprint", "random", "shutil", "statistics", "string",
           "subprocess", "tarfile", "textwrap", "threading", "typing", "zipfile")
VAL_SHARE = 0.1  # the corpus's last tenth is the validation text


def corpus() -> bytes:
    """The standard-library source files of MODULES, in order, as one byte string."""
    return b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in MODULES)


class Windows(Dataset):
    """Consecutive, non-overlapping windows of `block` bytes: inputs, and the same bytes shifted by one."""

    def __init__(self, data: torch.Tensor, block: int):
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int):
        start = i * self.block
        chunk = self.data[start:start + self.block + 1].long()
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1, not the head count: under tensor parallelism q, k and v hold heads / tp whole heads
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteGPT(nn.Module):
    """Token and position embeddings, `layers` pre-norm blocks, a final norm and the byte head.
    A pipeline stage keeps some of these and has the others set to None (torchtitan's manual split),
    so `forward` runs whatever part it holds: embeddings take bytes, later stages take activations."""

    def __init__(self, block: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(256, dim), nn.Embedding(block, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None:
            x = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


class GPT:
    """A byte-level GPT on standard-library source; reports bits per byte beside the loss."""

    hparams = {"block": 64, "dim": 64, "heads": 4, "layers": 2, "corpus_bytes": 1_000_000}
    space = {"lr": {"loguniform": [3e-4, 3e-3]}, "dim": {"choice": [32, 64]}}

    def data(self, hp):
        text = torch.frombuffer(bytearray(corpus()[:hp["corpus_bytes"]]), dtype=torch.uint8)
        cut = int(len(text) * (1 - VAL_SHARE))
        return Windows(text[:cut], hp["block"]), Windows(text[cut:], hp["block"])

    def model(self, hp):
        return ByteGPT(hp["block"], hp["dim"], hp["heads"], hp["layers"])

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def metrics(self, model, batch):
        return {"bits_per_byte": self.loss(model, batch) / math.log(2)}

    def tokens_per_sample(self, hp) -> int:
        """Each sample predicts `block` next bytes: the jobs report tokens/s from it."""
        return hp["block"]

    def tp_divisible(self, hp) -> dict:
        """Tensor parallelism splits q, k and v by whole heads."""
        return {"heads": hp["heads"]}

    def tp_plan(self, model) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {}
        for name in model.blocks:
            plan.update({f"blocks.{name}.attn.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
            plan[f"blocks.{name}.attn.wo"] = RowwiseParallel()
            plan[f"blocks.{name}.mlp.up"] = ColwiseParallel()
            plan[f"blocks.{name}.mlp.down"] = RowwiseParallel()
        return plan

    def pipeline_split(self, model) -> list[str]:
        """Where a stage may begin: at any block after the first (the embeddings go with the first
        stage, the norm and head with the last)."""
        return [f"blocks.{name}" for name in list(model.blocks)[1:]]
