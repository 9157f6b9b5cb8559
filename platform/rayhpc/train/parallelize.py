"""Data-parallel wrappers for the MLP, one small function per strategy (torchtitan style)."""

from __future__ import annotations

import torch
from torch import nn


def parallelize(model: nn.Module, strategy: str, device: torch.device, bf16: bool) -> nn.Module:
    """Move `model` to `device` and wrap it for `strategy` ("ddp" or "fsdp")."""
    model.to(device)
    if strategy == "fsdp":
        return apply_fsdp(model, bf16)
    return apply_ddp(model)


def apply_ddp(model: nn.Module) -> nn.Module:
    """DistributedDataParallel through Ray Train (it picks device_ids; a single worker stays unwrapped)."""
    from ray.train.torch import prepare_model

    return prepare_model(model, move_to_device=False, parallel_strategy="ddp")


def apply_fsdp(model: nn.Module, bf16: bool) -> nn.Module:
    """FSDP2: shard every Linear layer as its own unit, then the root.

    Per-layer units let FSDP all-gather one layer's parameters at a time and
    free them after use. With bf16, compute runs in bf16 while gradients are
    reduced in fp32, so the update matches fp32 training closely.
    (`ray.train.torch.prepare_model(parallel_strategy="fsdp")` is FSDP1, which
    refuses CPUs.)
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    linears = [layer for layer in model.modules() if isinstance(layer, nn.Linear)]
    for i, layer in enumerate(linears):
        # the last layer's backward runs right after its forward: freeing its
        # gathered weights would only all-gather them again (torchtitan does the same)
        fully_shard(layer, mp_policy=policy, reshard_after_forward=i < len(linears) - 1)
    fully_shard(model, mp_policy=policy)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
