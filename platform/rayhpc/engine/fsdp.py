"""FSDP2 for every job: `fully_shard` on each unit of a model, then on the root (torchtitan's recipe).

Units are all-gathered one at a time in forward and backward and freed after use, so a
rank holds one unit's whole parameters at a time. The last unit's backward runs right
after its forward, so it keeps its gathered weights in between (freeing them would only
all-gather them again; torchtitan does the same); on one rank every unit does. With bf16,
compute runs in bf16 while gradients are reduced in fp32, so the update matches fp32
training closely.
(`ray.train.torch.prepare_model(parallel_strategy="fsdp")` is FSDP1, which refuses CPUs.)
"""

from __future__ import annotations

import torch
from torch import nn


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules that hold parameters themselves (Linear, Conv2d, LayerNorm, ...), in order."""
    return [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]


def apply_fsdp(model: nn.Module, units: list[nn.Module], mesh=None, bf16: bool = False) -> nn.Module:
    """Shard each of `units`, then `model`, over `mesh` (a 1-D device mesh; 2-D: replicated over the first
    dim and sharded over the second, HSDP; None: the whole world)."""
    # FSDP2: about 0.7 s to import, only where a run shards
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    # on one rank the "shard" is the whole parameter: a group per unit saves no memory and costs each unit
    # its own gather, gradient reduction and hooks, so the model is one group (FSDP2 one worker: see
    # docs/benchmarks.md)
    shared = (mesh.size(mesh.ndim - 1) if mesh is not None else torch.distributed.get_world_size()) > 1
    for i, unit in enumerate(units if shared else []):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: kept gathered from forward to backward
    return model
