"""Data-parallel wrappers for any task's model, one small function per strategy (torchtitan style)."""

from __future__ import annotations

import torch
from torch import nn

from rayhpc.fsdp import apply_fsdp, default_units


def parallelize(model: nn.Module, strategy: str, device: torch.device, bf16: bool) -> nn.Module:
    """Move `model` to `device` and wrap it for `strategy` ("ddp" or "fsdp")."""
    model.to(device)
    if strategy == "fsdp":
        return apply_fsdp(model, default_units(model), mesh=world_mesh(device), bf16=bf16)
    return apply_ddp(model, device)


def world_mesh(device: torch.device):
    """A 1-D mesh of every rank on the worker's own device type: `fully_shard` without a mesh picks
    the accelerator itself, which on a GPU node moves a CPU worker's parameters to cuda:0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DistributedDataParallel over the process group that is up (a single worker stays unwrapped):
    torch's own wrapper, so that Ray Train's workers and the platform's warm worker groups
    (`rayhpc.tune.warm`, outside any Ray Train session) wrap alike."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    if device.type == "cuda":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device], output_device=device)
    return nn.parallel.DistributedDataParallel(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
