"""Compose the parallelisms on one rank's share of the model, in torchtitan's order:
keep this rank's pipeline stage, then TP inside the stage, activation checkpointing and compilation of its
blocks, then FSDP2 over the data-parallel ranks (sharded over fsdp, replicated over dp)."""

from __future__ import annotations

from torch import nn

from rayhpc.engine.fsdp import apply_fsdp
from rayhpc.engine.parallelize import apply_options
from rayhpc.parallel.mesh import Degrees
from rayhpc.parallel.plan import keep_stage, units
from rayhpc.parallel.pp import SPLIT_BACKWARD


def parallelize(model: nn.Module, mesh, degrees: Degrees, stage_id: int | None, recipe) -> nn.Module:
    """Pipeline stage `stage_id` of `model` (in place; None: the whole model), tensor-parallel over
    mesh["tp"], sharded over mesh["fsdp"] and replicated over mesh["dp"].

    Parameter names stay those of the whole model (`layers.4.weight`, `blocks.2.attn.wq.weight`),
    so gathered weights and checkpoints line up with an unsharded run.
    """
    stage = keep_stage(model, recipe.stage_starts(model), stage_id) if stage_id is not None else model
    if degrees.tp > 1:
        apply_tp(stage, mesh["tp"], recipe.tp_plan(stage))
    apply_options(stage, recipe.task.obj, recipe.cfg)  # activation checkpointing, then compile, of its blocks
    if degrees.fsdp_applies:  # gradients averaged over the data-parallel ranks
        # the zero-bubble schedules compute weight gradients in a pass of their own, outside autograd's
        # hooks, and with nested FSDP units (torch 2.13) the result differed from one process (measured);
        # with the stage as one unit it is equal: FSDP then gathers a whole stage at once there
        nested = recipe.cfg.parallelism.schedule not in SPLIT_BACKWARD
        # a 2-D mesh is FSDP2's HSDP: replicate over its first dim, shard over its second
        data_mesh = mesh["dp", "fsdp"] if degrees.dp > 1 else mesh["fsdp"]
        # bf16 by FSDP's mixed-precision policy, as in every job that shards with FSDP (the forward then
        # runs without autocast: `rayhpc.precision.autocast`)
        apply_fsdp(stage, shard_units(stage) if nested else [], mesh=data_mesh, bf16=recipe.cfg.precision == "bf16")
    return stage


def apply_tp(stage: nn.Module, tp_mesh, plan: dict) -> nn.Module:
    # DTensor: about 0.7 s to import, only where a run shards
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(stage, tp_mesh, plan)


def shard_units(stage: nn.Module) -> list[nn.Module]:
    """FSDP2 units of a stage: each pipeline unit that holds parameters (a Linear, a block, an embedding),
    so only one unit's parameters are gathered at a time; TP-sharded ones become 2-D (dp x tp) DTensors."""
    found = [stage.get_submodule(u) for u in units(stage)]  # a stage's removed units are not its children
    return [m for m in found if any(True for _ in m.parameters())]


def full_state(module: nn.Module) -> dict:
    """Whole (unsharded) parameters by name; a collective over each parameter's mesh, so every
    rank holding a shard of the stage must call it."""
    from torch.distributed.tensor import DTensor  # DTensor: about 0.7 s to import, only where a run shards

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in module.named_parameters()}
