"""Compose the parallelisms on one rank's share of the model, in torchtitan's order:
split by layer for PP, then TP inside the stage, then FSDP2 over the data-parallel replicas."""

from __future__ import annotations

from torch import nn

from rayhpc.fsdp import apply_fsdp
from rayhpc.parallel.mesh import Degrees
from rayhpc.parallel.pp import split_stage, units
from rayhpc.parallel.tp import apply_tp


def parallelize(model: nn.Module, mesh, degrees: Degrees, rank: int, model_kind: str) -> nn.Module:
    """This rank's stage of `model`, tensor-parallel over mesh["tp"] and sharded over mesh["dp"].

    Parameter names stay those of the whole model (`layers.4.weight`), so gathered
    weights and checkpoints line up with an unsharded run.
    """
    stage = split_stage(model, degrees.coords(rank)["pp"], degrees.pp)
    if degrees.tp > 1:
        apply_tp(stage, mesh["tp"], model_kind)
    if degrees.dp > 1:
        apply_fsdp(stage, shard_units(stage), mesh=mesh["dp"])  # gradients averaged over the replicas
    return stage


def shard_units(stage: nn.Module) -> list[nn.Module]:
    """FSDP2 units of a stage: each Linear (with its ReLU) or block, so only one unit's parameters are
    gathered at a time; TP-sharded parameters become 2-D (dp x tp) DTensors."""
    children = dict(stage.layers.named_children())
    return [children[names[0]] for names in units(stage)]


def full_state(module: nn.Module) -> dict:
    """Whole (unsharded) parameters by name; a collective over each parameter's mesh, so every
    rank holding a shard of the stage must call it."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in module.named_parameters()}
