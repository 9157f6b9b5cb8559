"""Models: the seed documents' MLP, and a pack of such MLPs trained as one batched model."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """`Linear -> ReLU -> ... -> Linear`; at depth 2 the seed documents' two-layer MLP.

    Layers live in one `nn.Sequential` (`layers.0`, `layers.2`, ...) so that
    tensor-parallel plans and per-layer FSDP sharding can address them by name.
    """

    def __init__(self, in_features: int, hidden: int, out_features: int, depth: int = 2):
        super().__init__()
        if depth < 1:
            raise ValueError(f"MLP depth must be >= 1, got {depth}")
        widths = [in_features] + [hidden] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class PackedMLP(nn.Module):
    """P independent two-layer MLPs evaluated as one batched model.

    For small models the cost of a training step is almost all per-operation
    overhead, so P models in one `matmul`/`baddbmm` cost little more than one
    (on 2 CPU cores: 8 members of width 64 take 1.03x the time of one).
    Members may differ in hidden width: every member is padded to the widest
    and a 0/1 mask zeroes the padded units after the ReLU, so padded weights
    neither affect the output nor receive gradient from the loss. Each member
    computes exactly what `MLP(in, hidden_i, out)` with the same weights does.
    """

    def __init__(self, in_features: int, hiddens: list[int], out_features: int):
        super().__init__()
        p, width = len(hiddens), max(hiddens)
        self.hiddens = list(hiddens)
        self.w1 = nn.Parameter(torch.zeros(p, in_features, width))
        self.b1 = nn.Parameter(torch.zeros(p, 1, width))
        self.w2 = nn.Parameter(torch.zeros(p, width, out_features))
        self.b2 = nn.Parameter(torch.zeros(p, 1, out_features))
        mask = torch.zeros(p, 1, width)
        for i, h in enumerate(hiddens):
            mask[i, :, :h] = 1.0
        self.register_buffer("mask", mask)
        self.padded = any(h < width for h in hiddens)

    @classmethod
    def from_members(cls, members: list[MLP]) -> "PackedMLP":
        """Pack two-layer `MLP`s, copying their weights (so initialisation matches theirs)."""
        first, last = members[0].layers[0], members[0].layers[-1]
        packed = cls(first.in_features, [m.layers[0].out_features for m in members], last.out_features)
        with torch.no_grad():
            for i, m in enumerate(members):
                hidden, out = m.layers[0], m.layers[-1]
                h = hidden.out_features
                packed.w1[i, :, :h] = hidden.weight.T
                packed.b1[i, 0, :h] = hidden.bias
                packed.w2[i, :h, :] = out.weight.T
                packed.b2[i, 0, :] = out.bias
        return packed

    @torch.no_grad()
    def copy_member(self, dst: int, src: int) -> None:
        for t in (self.w1, self.b1, self.w2, self.b2, self.mask):
            t[dst] = t[src]
        self.hiddens[dst] = self.hiddens[src]

    @torch.no_grad()
    def keep(self, slots: list[int]) -> None:
        """Only the members at `slots` stay (new, smaller parameters: an optimizer must be given them)."""
        index = torch.tensor(slots, device=self.w1.device)
        for name in ("w1", "b1", "w2", "b2"):
            setattr(self, name, nn.Parameter(getattr(self, name).index_select(0, index)))
        self.mask = self.mask.index_select(0, index)
        self.hiddens = [self.hiddens[i] for i in slots]
        self.padded = any(h < self.w1.shape[2] for h in self.hiddens)

    def member(self, i: int) -> MLP:
        """Member `i` as a stand-alone `MLP` (a copy, on CPU)."""
        h = self.hiddens[i]
        m = MLP(self.w1.shape[1], h, self.w2.shape[2])
        with torch.no_grad():
            m.layers[0].weight.copy_(self.w1[i, :, :h].T)
            m.layers[0].bias.copy_(self.b1[i, 0, :h])
            m.layers[2].weight.copy_(self.w2[i, :h, :].T)
            m.layers[2].bias.copy_(self.b2[i, 0, :])
        return m.cpu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, in] -> [members, batch, out]."""
        h = torch.relu(torch.matmul(x, self.w1) + self.b1)
        if self.padded:
            h = h * self.mask
        return torch.baddbmm(self.b2, h, self.w2)
