"""The Ray Tune function trainable: trains one pack of trials, checkpointing every epoch.

A pack is one trial or several trials trained together as a `PackedMLP`
(see `rayhpc.tune.plan`). Every member sees the same data order, drawn from
the sweep seed and the epoch number, so a trial restarted from its checkpoint
continues exactly as if it had never stopped.
"""

from __future__ import annotations

import logging
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rayhpc.data import Dataset, epoch_order
from rayhpc.models import MLP, PackedMLP
from rayhpc.tune.optim import packed_optimizer
from rayhpc.tune.space import HParams

STATE_FILE = "pack_state.pt"


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of a sweep shares."""

    epochs: int
    seed: int
    threads: int


def init_member(in_features: int, hidden: int, out_features: int, seed: int) -> MLP:
    """A trial's initial model: every trial of a sweep starts from the same seed."""
    torch.manual_seed(seed)
    return MLP(in_features, hidden, out_features)


def members_of(config: dict, packs: list[list[dict]] | None) -> list[dict]:
    """The trials a Tune config stands for: a planned pack, or one searcher-made config."""
    if "pack" in config and packs is not None:
        return packs[config["pack"]]
    return [HParams(**config).model_dump()]


def train_pack(config: dict, *, dataset: Dataset, packs: list[list[dict]] | None, settings: TrialSettings) -> None:
    from ray import tune

    entered = time.perf_counter()
    # Ray Train logs every persisted checkpoint at INFO; a sweep makes one per trial-epoch.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    torch.set_num_threads(settings.threads)
    device = _device()
    members = members_of(config, packs)
    state = _restore(tune.get_checkpoint()) or _fresh(members, dataset, settings)
    if state["epoch"] >= settings.epochs:
        # restored from its final checkpoint (the driver died before recording the end):
        # report the final metrics again instead of training anything twice
        tune.report(state["metrics"])
        return
    model = PackedMLP(dataset.in_features, [m["hidden"] for m in members], dataset.out_features)
    model.load_state_dict(state["model"])
    model.to(device)
    opt = packed_optimizer(members[0]["optimizer"], list(model.parameters()), members)
    if state["optim"] is not None:
        opt.load_state_dict(_to(state["optim"], device))
    data = [t.to(device) for t in (dataset.x_train, dataset.y_train, dataset.x_val, dataset.y_val)]
    resumed_from = state["epoch"]
    for epoch in range(state["epoch"], settings.epochs):
        train_loss = train_epoch(model, opt, data[0], data[1], members[0]["batch_size"], settings.seed, epoch)
        val_loss = evaluate(model, data[2], data[3])
        state["epoch"] = epoch + 1
        state["best"] = torch.minimum(state["best"], val_loss)
        seconds = state["seconds"] + time.perf_counter() - entered
        metrics = _metrics(val_loss, state["best"], train_loss, epoch + 1, seconds, resumed_from)
        with tempfile.TemporaryDirectory() as tmp:
            torch.save({**state, "seconds": seconds, "metrics": metrics, "model": model.state_dict(),
                        "optim": opt.state_dict()}, Path(tmp) / STATE_FILE)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))


def train_epoch(model: PackedMLP, opt, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int, epoch: int) -> torch.Tensor:
    """One pass over the training data; returns each member's mean batch loss."""
    order = epoch_order(x.shape[0], seed, epoch).to(x.device)
    total = torch.zeros(model.w1.shape[0], device=x.device)
    steps = 0
    for start in range(0, x.shape[0], batch_size):
        idx = order[start:start + batch_size]
        # mean over batch and outputs = F.mse_loss per member; summing the members' losses
        # gives each member exactly its own gradient
        loss = ((model(x[idx]) - y[idx]) ** 2).mean(dim=(1, 2))
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
        total += loss.detach()
        steps += 1
    return (total / steps).cpu()


@torch.no_grad()
def evaluate(model: PackedMLP, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean(dim=(1, 2)).cpu()


def _fresh(members: list[dict], dataset: Dataset, settings: TrialSettings) -> dict:
    inits = [init_member(dataset.in_features, m["hidden"], dataset.out_features, settings.seed) for m in members]
    return {"model": PackedMLP.from_members(inits).state_dict(), "optim": None, "epoch": 0,
            "best": torch.full((len(members),), float("inf")), "seconds": 0.0, "metrics": None}


def _restore(checkpoint) -> dict | None:
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        return torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True)


def _metrics(val: torch.Tensor, best: torch.Tensor, train: torch.Tensor, epoch: int, seconds: float, resumed_from: int) -> dict:
    per_member = {
        str(i): {"val_loss": float(val[i]), "best_val_loss": float(best[i]), "train_loss": float(train[i])}
        for i in range(len(val))
    }
    return {
        # the pack's best member drives Tune's own bookkeeping; a pack of one is a plain trial
        "val_loss": float(val.min()),
        "best_val_loss": float(best.min()),
        "epoch": epoch,
        "train_seconds": seconds,
        "resumed_from_epoch": resumed_from,
        "node": socket.gethostname(),
        "pack_size": len(val),
        "members": per_member,
    }


def _device() -> torch.device:
    import ray

    # Ray sets CUDA_VISIBLE_DEVICES per trial, so the trial's GPU is always index 0.
    if ray.get_gpu_ids() and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj
