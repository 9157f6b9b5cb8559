"""Optimizers for a pack of trials: one hyperparameter value per member.

`torch.optim` takes one learning rate per parameter group, but a pack's
parameters are stacked tensors `[members, ...]` whose members were sampled
with different learning rates, weight decays, momenta and betas. These step every
member exactly as `torch.optim.SGD` / `Adam` / `AdamW` (defaults otherwise) would
step the member's own model, each with its own learning-rate schedule (`scale_lr`)
and gradient clipping (`clip_`, each member's norm its own); tests check that with
`assert_close`.
"""

from __future__ import annotations

import math

import torch

from rayhpc.config import Optim

PACKED = ("sgd", "adam", "adamw")  # the optimizers packs step; other torch.optim classes train unpacked


class PackedOptimizer:
    """Base: per-member hyperparameters stored as `[members]` tensors, broadcast per parameter."""

    def __init__(self, params: list[torch.nn.Parameter], max_norm: list[float | None] | None = None,
                 **per_member: list[float]):
        self.params = list(params)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        members = len(per_member["lr"])
        limits = [math.inf if m is None else m for m in (max_norm or [None] * members)]
        self.clipping = any(m < math.inf for m in limits)
        # on the parameters' device once: a host-to-device copy per parameter per step would stall a GPU
        per_member = {**per_member, "max_norm": limits, "lr_scale": [1.0] * members}  # lr_scale: the schedule's
        self.hyper = {k: torch.tensor(v, dtype=torch.float32, device=self.device) for k, v in per_member.items()}
        self.factors: list[float] | None = [1.0] * members  # what lr_scale holds
        self._pinned = None
        self.state: dict[str, list[torch.Tensor]] = {}
        self.steps = 0

    def _h(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Hyperparameter `name` shaped to broadcast over a `[members, ...]` tensor (a view: no copy)."""
        return self.hyper[name].view(-1, *([1] * (like.dim() - 1)))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def scale_lr(self, factors: list[float]) -> None:
        """Each member's share of its lr for the coming step (its schedule, `rayhpc.optim.lr_factor`): copied
        to the device only when it changes, from pinned memory without waiting (no host sync)."""
        if factors == self.factors:
            return
        self.factors = list(factors)
        self._pinned = torch.tensor(factors, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        self.hyper["lr_scale"] = self._pinned.to(self.device, non_blocking=True)  # _pinned lives until it is read

    def _lr(self, like: torch.Tensor) -> torch.Tensor:
        return self._h("lr", like) * self._h("lr_scale", like)

    @torch.no_grad()
    def clip_(self) -> None:
        """`torch.nn.utils.clip_grad_norm_` for every member with a limit (`max_norm`), over its own slice of
        every gradient: scaled by min(1, max_norm / (norm + 1e-6)), on the device."""
        if not self.clipping:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads]).norm(dim=0)  # [members]
        coef = (self.hyper["max_norm"] / (norms + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))

    def state_dict(self) -> dict:
        return {"steps": self.steps, "state": self.state, "hyper": self.hyper}

    @torch.no_grad()
    def copy_member(self, dst: int, src: int) -> None:
        """Member `dst` takes `src`'s optimizer state and hyperparameters (PBT's exploit)."""
        for tensors in self.state.values():
            for t in tensors:
                if t is not None:
                    t[dst] = t[src]
        for v in self.hyper.values():
            v[dst] = v[src]

    def set_member(self, member: int, values: dict[str, float]) -> None:
        """New hyperparameter values for one member (PBT's explore)."""
        for name, value in values.items():
            self.hyper[name][member] = value

    def keep(self, slots: list[int], params: list[torch.Tensor]) -> None:
        """Only the members at `slots` go on, stepping `params` (the repacked pack's): every per-member
        tensor (state, hyperparameters) is cut to them, so each survivor steps on as before."""
        index = torch.tensor(slots, device=self.device)
        self.params = list(params)
        self.state = {k: [t.index_select(0, index) if t is not None else None for t in ts] for k, ts in self.state.items()}
        self.hyper = {k: v.index_select(0, index) for k, v in self.hyper.items()}
        self.factors = None

    def load_state_dict(self, sd: dict) -> None:
        self.steps, self.state, self.factors = sd["steps"], sd["state"], None
        self.hyper = {k: v.to(self.device) for k, v in sd["hyper"].items()}


class PackedSGD(PackedOptimizer):
    """`torch.optim.SGD(lr, momentum, weight_decay)` per member (no dampening or Nesterov)."""

    def __init__(self, params, lr: list[float], momentum: list[float], weight_decay: list[float],
                 max_norm: list[float | None] | None = None):
        super().__init__(params, max_norm, lr=lr, momentum=momentum, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self) -> None:
        bufs = self.state.setdefault("momentum_buffer", [])
        for i, p in enumerate(self.params):
            if len(bufs) <= i:
                bufs.append(None)
            if p.grad is None:  # a frozen parameter: torch.optim skips it too
                continue
            d_p = p.grad + self._h("weight_decay", p) * p
            if bufs[i] is None:
                bufs[i] = d_p.clone()  # torch starts the buffer at the first gradient
            else:
                bufs[i].mul_(self._h("momentum", p)).add_(d_p)
            # members with momentum 0 use the raw gradient, as torch does
            d_p = torch.where(self._h("momentum", p) > 0, bufs[i], d_p)
            p.sub_(self._lr(p) * d_p)
        self.steps += 1


class PackedAdam(PackedOptimizer):
    """`torch.optim.Adam(lr, betas, eps, weight_decay)` per member; with `decoupled`, `AdamW`'s
    decoupled weight decay instead of the L2 term."""

    def __init__(self, params, lr: list[float], weight_decay: list[float], beta1: list[float] | None = None,
                 beta2: list[float] | None = None, eps: list[float] | None = None, decoupled: bool = False,
                 max_norm: list[float | None] | None = None):
        n = len(lr)
        super().__init__(params, max_norm, lr=lr, weight_decay=weight_decay, beta1=beta1 or [0.9] * n,
                         beta2=beta2 or [0.999] * n, eps=eps or [1e-8] * n)  # torch's defaults
        self.decoupled = decoupled

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        m = self.state.setdefault("exp_avg", [torch.zeros_like(p) for p in self.params])
        v = self.state.setdefault("exp_avg_sq", [torch.zeros_like(p) for p in self.params])
        for i, p in enumerate(self.params):
            if p.grad is None:  # a frozen parameter: torch.optim skips it too
                continue
            beta1, beta2, lr = self._h("beta1", p), self._h("beta2", p), self._lr(p)
            if self.decoupled:
                p.mul_(1 - lr * self._h("weight_decay", p))
                grad = p.grad
            else:
                grad = p.grad + self._h("weight_decay", p) * p
            m[i].lerp_(grad, 1 - beta1)
            v[i].mul_(beta2).add_((1 - beta2) * grad * grad)
            bias1, bias2_sqrt = 1 - beta1**self.steps, (1 - beta2**self.steps).sqrt()
            denom = (v[i].sqrt() / bias2_sqrt).add_(self._h("eps", p))
            p.sub_((m[i] / denom) * (lr / bias1))


def packed_optimizer(kind: str, params, members: list[dict]) -> PackedOptimizer:
    """The optimizer `kind` (one of `PACKED`) with each member's own `optim:` values."""
    optims = [Optim.of(m) for m in members]
    per = {k: [getattr(o, k) for o in optims] for k in ("lr", "weight_decay", "momentum", "beta1", "beta2", "eps")}
    max_norm = [o.clip_grad_norm for o in optims]
    if kind.lower() == "sgd":
        return PackedSGD(params, lr=per["lr"], momentum=per["momentum"], weight_decay=per["weight_decay"],
                         max_norm=max_norm)
    if kind.lower() in ("adam", "adamw"):
        return PackedAdam(params, **{k: per[k] for k in ("lr", "weight_decay", "beta1", "beta2", "eps")},
                          decoupled=kind.lower() == "adamw", max_norm=max_norm)
    raise ValueError(f"optimizer {kind!r}: packs step {', '.join(PACKED)}; others train unpacked")
