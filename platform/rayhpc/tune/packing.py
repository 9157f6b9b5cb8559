"""Trial packing for any task: P trials of one model trained as one batched computation.

Small models spend almost all of a step on per-operation overhead, so P members in one
batched kernel cost little more than one. Members of a pack take the same batches (the
same batch size, seed and data), and each has its own initialisation, learning rate,
momentum and weight decay (`rayhpc.tune.optim` steps each as `torch.optim` would).

- `FuncPack`, for any task: the members' parameters stacked with
  `torch.func.stack_module_state`, the task's own loss run on each member with
  `functional_call` under `vmap`. The members must be the same module apart from
  parameter values, so they also share every hyperparameter that `model()` reads.
  Dropout draws one mask for all members (`randomness="same"`): every trial of a sweep
  starts from the same seed, so each member alone would have drawn that mask too.
- `PaddedMLPPack`, for the built-in two-layer MLP: members of different hidden widths
  in one `PackedMLP`, the narrower ones zero-padded and masked.
- `SinglePack`, a pack of one: the plain model and `torch.optim`.

A task that cannot run under `vmap` (data-dependent control flow, `.item()` in the loss,
BatchNorm statistics that would mix members) is found by `packing_problem`, which trains
two members one step packed and alone and compares them; such a sweep runs unpacked.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Iterable

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from rayhpc.config import ModelOptions
from rayhpc.engine.parallelize import apply_options
from rayhpc.models import MLP, PackedMLP
from rayhpc.task.batches import evaluate, named_scores, score_sums
from rayhpc.task.check import TaskInfo
from rayhpc.task.load import LoadedTask, one_line
from rayhpc.task.mlp import MLPTask
from rayhpc.tune.optim import PACKED, packed_optimizer

PACK_KEYS = ("batch_size", "optimizer", "seed", "accumulate")  # members step together on one data order


def padded_mlp(task: LoadedTask, hp: dict) -> bool:
    return isinstance(task.obj, MLPTask) and hp["depth"] == 2


def shared_keys(task: LoadedTask, info: TaskInfo, hp: dict) -> set[str]:
    """What members of one pack must share: the data order, the optimiser kind, and every
    hyperparameter that `model()` or `data()` reads (the padded MLP lets `hidden` differ)."""
    shared = set(PACK_KEYS) | set(info.reads)
    if padded_mlp(task, hp):
        shared.discard("hidden")
    return shared


def pack_key(task: LoadedTask, info: TaskInfo, hp: dict) -> tuple:
    if hp["optimizer"].lower() not in PACKED:  # torch.optim's own, one trial at a time
        return ("unpacked", id(hp))
    return tuple(sorted((k, repr(hp[k])) for k in shared_keys(task, info, hp) if k in hp))


class _Apply(nn.Module):
    """`fn(model, batch)` as a module holding `model`, so that `functional_call` can run the task's
    own loss (which may use any attribute of the model) with one member's parameters."""

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, batch):
        return self.fn(self.model, batch)


class SinglePack:
    """One trial: the task's own model, loss and metrics and a `torch.optim` optimiser (or the task's own
    optimizer and scheduler), no vmap (so any task runs, packable or not)."""

    size = 1

    def __init__(self, task: LoadedTask, model: nn.Module):
        self.task, self.model = task, model
        self.has_metrics = task.has_metrics

    def optimizer(self, members: list[dict]):
        return self.task.optimizer(self.model.parameters(), members[0])

    def scheduler(self, opt, hp: dict, step: int):
        """The task's own LR scheduler of `opt`, or None; made at the first step this process runs (a
        resumed trial's step, once its optimizer is restored)."""
        if not hasattr(self, "_scheduler"):
            self._scheduler = self.task.scheduler(opt, hp, step)
        return self._scheduler

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def losses(self, batch) -> torch.Tensor:
        return self.task.loss(self.model, batch).reshape(1)

    def evaluate(self, batches: Iterable) -> dict[str, torch.Tensor]:
        return {k: torch.tensor([v]) for k, v in evaluate(self.task, self.model, batches).items()}

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def member(self, i: int) -> nn.Module:
        return copy.deepcopy(self.model)


class FuncPack:
    """Members of one architecture as stacked parameters, run with `vmap(functional_call)`."""

    def __init__(self, task: LoadedTask, models: list[nn.Module]):
        self.size = len(models)
        self.params, self.buffers = stack_module_state(models)
        base = copy.deepcopy(models[0])  # structure only: functional_call supplies every tensor
        self.loss_fn, self.metrics_fn = _Apply(base, task.loss), _Apply(base, task.metrics)
        self.has_metrics = task.has_metrics
        self._losses = vmap(self._member_loss, in_dims=(0, 0, None), randomness="same")
        self._own_losses = vmap(self._member_loss, in_dims=(0, 0, 0), randomness="same")  # a batch per member
        self._evals = vmap(self._member_eval, in_dims=(0, 0, None), randomness="same")

    def _state(self, params: dict, buffers: dict) -> dict:
        return {**{f"model.{k}": v for k, v in params.items()}, **{f"model.{k}": v for k, v in buffers.items()}}

    def _member_loss(self, params, buffers, batch):
        return functional_call(self.loss_fn, self._state(params, buffers), (batch,))

    def _member_eval(self, params, buffers, batch):
        state = self._state(params, buffers)
        loss = functional_call(self.loss_fn, state, (batch,))
        metrics = functional_call(self.metrics_fn, state, (batch,)) if self.has_metrics else {}
        return loss, metrics

    def parameters(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def optimizer(self, members: list[dict]):
        return packed_optimizer(members[0]["optimizer"], self.parameters(), members)

    def train(self, mode: bool = True) -> None:
        self.loss_fn.train(mode)

    def losses(self, batch, stacked: bool = False) -> torch.Tensor:
        """Each member's loss on `batch` (`stacked`: on its own batch, `batch` member first): [members].
        Summed, their backward gives each its own gradient."""
        return (self._own_losses if stacked else self._losses)(self.params, self.buffers, batch)

    def evaluate(self, batches: Iterable) -> dict[str, torch.Tensor]:
        """`val_loss` and `val_<metric>` of each member (in eval mode), averaged over the samples of `batches`."""
        sums, n = score_sums(lambda b: named_scores(*self._evals(self.params, self.buffers, b)), batches,
                             [self.loss_fn])
        return {name: (s / n).float() for name, s in sums.items()}

    def state_dict(self) -> dict:
        return {"params": {k: v.detach() for k, v in self.params.items()}, "buffers": dict(self.buffers)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for part in ("params", "buffers"):
            for k, v in getattr(self, part).items():
                v.copy_(state[part][k])

    @torch.no_grad()
    def copy_member(self, dst: int, src: int) -> None:
        """Member `dst` becomes a copy of member `src` (weights and buffers: PBT's exploit)."""
        for t in [*self.params.values(), *self.buffers.values()]:
            t[dst] = t[src]

    @torch.no_grad()
    def keep(self, slots: list[int]) -> None:
        """Only the members at `slots` stay in the pack (the others stopped): it computes just them."""
        index = torch.tensor(slots, device=next(iter(self.params.values())).device)
        self.params = {k: v.detach().index_select(0, index).requires_grad_(v.requires_grad)
                       for k, v in self.params.items()}
        self.buffers = {k: v.index_select(0, index) for k, v in self.buffers.items()}
        self.size = len(slots)

    def member(self, i: int) -> nn.Module:
        """Member `i` as a stand-alone module (a copy)."""
        module = copy.deepcopy(self.loss_fn.model)
        state = {k: v[i] for k, v in {**self.params, **self.buffers}.items()}
        saved = module.state_dict().keys()  # not the non-persistent buffers (RoPE's in a transformers model)
        module.load_state_dict({k: v for k, v in state.items() if k in saved})
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name not in saved:
                    buffer.copy_(state[name])
        return module


class PaddedMLPPack:
    """The built-in task's two-layer MLPs of different widths in one `PackedMLP` (MSE loss, as the task's)."""

    has_metrics = False

    def __init__(self, models: list[MLP]):
        self.size = len(models)
        self.model = PackedMLP.from_members(models)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def optimizer(self, members: list[dict]):
        return packed_optimizer(members[0]["optimizer"], self.parameters(), members)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def losses(self, batch, stacked: bool = False) -> torch.Tensor:
        x, y = batch  # x: [batch, in], or [members, batch, in] stacked (matmul batches over the members either way)
        # mean over batch and outputs = F.mse_loss of each member
        return ((self.model(x) - y) ** 2).mean(dim=(1, 2))

    def evaluate(self, batches: Iterable) -> dict[str, torch.Tensor]:
        sums, n = score_sums(lambda b: {"val_loss": self.losses(b)}, batches, [self.model])
        return {name: (s / n).float() for name, s in sums.items()}

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def member(self, i: int) -> MLP:
        return self.model.member(i)

    def keep(self, slots: list[int]) -> None:
        """Only the members at `slots` stay in the pack (the others stopped): it computes just them."""
        self.model.keep(slots)
        self.size = len(slots)

    def copy_member(self, dst: int, src: int) -> None:
        """Member `dst` becomes a copy of member `src`, its width included (PBT's exploit)."""
        self.model.copy_member(dst, src)

    def to(self, device) -> "PaddedMLPPack":
        self.model.to(device)
        return self


def make_pack(task: LoadedTask, members: list[dict], device: torch.device, options: ModelOptions = ModelOptions()):
    """The members' initial models as one pack on `device` (a pack of one is the plain model, its blocks
    checkpointed and compiled as `options` asks)."""
    models = [task.initial_model(hp) for hp in members]
    if len(models) == 1:
        apply_options(models[0], task.obj, options)
        return SinglePack(task, models[0].to(device))
    if padded_mlp(task, members[0]):
        return PaddedMLPPack(models).to(device)
    return FuncPack(task, [m.to(device) for m in models])


def packing_problem(task: LoadedTask, hp: dict, batch: Any) -> str | None:
    """Why this task's trials cannot be packed, or None: two members with different initialisations,
    one training step and one evaluation each, packed and alone, must agree; a pack steps only the
    platform's optimizers and schedule."""
    if own := task.own_optimizer:
        return f"it brings its own {own}"
    try:
        models = [task.initial_model({**hp, "seed": hp["seed"] + i}) for i in range(2)]
        alone = [_alone(task, copy.deepcopy(m), batch) for m in models]
        pack = FuncPack(task, [copy.deepcopy(m) for m in models])
        torch.manual_seed(0)
        losses = pack.losses(batch)
        losses.sum().backward()
        evaluated = pack.evaluate([batch])
    except Exception as exc:  # noqa: BLE001 - whatever vmap refuses in the user's code
        return f"vmap: {one_line(exc)}"
    for i, (loss, grads, buffers, metrics) in enumerate(alone):
        packed = {"loss": losses[i], **{f"grad of {k}": _grad(p)[i] for k, p in pack.params.items() if p.requires_grad},
                  **{f"buffer {k}": b[i] for k, b in pack.buffers.items()},
                  **{f"metric {k}": v[i] for k, v in evaluated.items() if k != "val_loss"}}
        for name, want in {"loss": loss, **grads, **buffers, **metrics}.items():
            if not torch.allclose(packed[name].float(), want.float(), rtol=1e-4, atol=1e-5):
                return f"member {i}'s {name} differs packed and alone (vmap mixes members, e.g. BatchNorm statistics)"
    return None


def step_seconds(task: LoadedTask, hp: dict, batch: Any, members: int, threads: int) -> tuple[float, float]:
    """(seconds, seconds) of one training step (forward and backward) of `members` trials packed, and of the same
    trials one after another (one trial's step times `members`), on `batch` repeated to the trials' batch size, on
    this process's CPU with a trial's `threads`: each the fastest of its runs, the two taken in turn (a load that
    comes and goes slows both alike) after a warm-up, at least 3 of each and up to 100 within 0.2 s. Which is
    faster depends on the model: a vmapped convolution or attention on a CPU can cost more than the members' own
    in turn, where small matrix products gain."""
    runs = [make_pack(task, [{**hp, "seed": hp["seed"] + i} for i in range(n)], torch.device("cpu"))
            for n in (members, 1)]
    batch, before = _repeated(batch, hp["batch_size"]), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps = [lambda run=run: run.losses(batch).sum().backward() for run in runs]
        for step in steps:
            step()  # the first call pays for lazy set-up (vmap's, the allocator's)
        best, started = [math.inf, math.inf], time.perf_counter()
        for i in range(100):
            for j, step in enumerate(steps):
                began = time.perf_counter()
                step()
                best[j] = min(best[j], time.perf_counter() - began)
            if i >= 2 and time.perf_counter() - started > 0.2:
                break
    finally:
        torch.set_num_threads(before)
    return best[0], best[1] * members


def _repeated(batch: Any, samples: int) -> Any:
    """`batch` (tensors, in tuples, lists or dicts) repeated to `samples` samples."""
    if isinstance(batch, torch.Tensor):
        return batch.repeat(math.ceil(samples / len(batch)), *[1] * (batch.dim() - 1))[:samples]
    if isinstance(batch, dict):
        return {k: _repeated(v, samples) for k, v in batch.items()}
    return type(batch)(_repeated(v, samples) for v in batch) if isinstance(batch, (list, tuple)) else batch


def _alone(task: LoadedTask, model: nn.Module, batch) -> tuple:
    """(loss, grads, buffers after the step, metrics) of one member trained alone on `batch`."""
    torch.manual_seed(0)  # the packed forward draws its dropout masks from the same state
    loss = task.loss(model, batch)
    trained = {k: p for k, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(trained.values()), allow_unused=True)  # a branch may skip some
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(trained.values(), grads)]
    buffers = {f"buffer {k}": b.detach().clone() for k, b in model.named_buffers()}
    model.eval()
    with torch.no_grad():
        metrics = {f"metric val_{k}": torch.as_tensor(v) for k, v in task.metrics(model, batch).items()}
    return loss.detach(), {f"grad of {k}": g for k, g in zip(trained, grads)}, buffers, metrics


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def member_state_dict(state: dict, j: int) -> dict[str, torch.Tensor]:
    """Member `j`'s weights as its own model's state dict, from a pack's checkpoint state
    (`rayhpc.tune.trainable`): a member ASHA stopped as it left, else its slice of the pack."""
    size = len(state["best"]["val_loss"])
    part = state["retired"].get(j)
    if part is None:
        part = member_slice(state["model"], None if size == 1 else state["slots"].index(j))
    if size == 1:
        return part  # a pack of one is the plain model
    if "params" in part:  # FuncPack: stack_module_state's names are the model's own
        return {**part["params"], **part["buffers"]}
    h = int(part["mask"].sum())  # PaddedMLPPack: the member's own width of the padded one
    return {"layers.0.weight": part["w1"][:, :h].T.contiguous(), "layers.0.bias": part["b1"][0, :h].clone(),
            "layers.2.weight": part["w2"][:h, :].T.contiguous(), "layers.2.bias": part["b2"][0].clone()}


def member_slice(state, pos: int | None):
    """Member `pos`'s part of a pack's state dict (every tensor is stacked over members; None: a pack of
    one, whose tensors are the member's own)."""
    if isinstance(state, dict):
        return {k: member_slice(v, pos) for k, v in state.items()}
    return (state if pos is None else state[pos]).detach().cpu().clone()
