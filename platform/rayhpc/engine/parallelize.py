"""Data-parallel wrappers for any task's model, one small function per step (torchtitan's order:
activation checkpointing, then compilation, then FSDP2 or DDP)."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rayhpc.engine.fsdp import apply_fsdp, default_units
from rayhpc.private import OWN_TMPDIR_BASE, UnsafePath, own_dir

log = logging.getLogger(__name__)
# selective checkpointing keeps the outputs of these (the costly matmuls and attention) and recomputes the rest
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default}


def parallelize(model: nn.Module, strategy: str, device: torch.device, bf16: bool, task, options) -> nn.Module:
    """Move `model` to `device`, checkpoint and compile its blocks as `options` asks, and wrap it for `strategy`
    ("ddp" or "fsdp")."""
    model.to(device)
    apply_options(model, task, options)
    if strategy == "fsdp":
        return apply_fsdp(model, default_units(model), mesh=world_mesh(device), bf16=bf16)
    return apply_ddp(model, device)


def apply_options(model: nn.Module, task, options) -> None:
    """`options.activation_checkpointing`, then `options.compile` (`rayhpc.config.ModelOptions`), on the blocks
    of the task's `model` (`task`: the user's task object; `model`: a pipeline stage of it too)."""
    blocks = model_blocks(task, model)
    apply_ac(blocks, options.activation_checkpointing)
    apply_compile(model, blocks, options.compile)


def model_blocks(task, model: nn.Module) -> list[nn.Module]:
    """The blocks activation checkpointing and compilation work on: the task's `blocks(model)`, else the
    entries of the model's outermost `nn.ModuleList`s and `nn.ModuleDict`s (a transformer's layers), else
    the modules holding parameters."""
    if callable(getattr(task, "blocks", None)):
        return list(task.blocks(model))
    blocks: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and not any(name.startswith(f"{b}.") for b in blocks):
            children = module.named_children()
            blocks.update({f"{name}.{key}" if name else key: child for key, child in children})
    return list(blocks.values()) or default_units(model)


def apply_ac(blocks: list[nn.Module], mode: str) -> None:
    """`full`: each block keeps only its input and recomputes the rest in backward; `selective`: it also
    keeps the outputs of `SAVED_OPS`. The block's forward is replaced in place, so parameter names (and
    checkpoints) stay as they are."""
    if mode == "none":
        return
    context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls) if mode == "selective" else None
    for block in blocks:
        options = {"use_reentrant": False, **({"context_fn": context} if context else {})}
        block.forward = functools.partial(checkpoint, block.forward, **options)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_compile(model: nn.Module, blocks: list[nn.Module], mode: str) -> None:
    """`torch.compile` each block (`blocks`: repeated blocks compile once) or the whole model, in place."""
    if mode == "none":
        return
    private_compile_caches()
    for module in (blocks if mode == "blocks" else [model]):
        module.compile()


def private_compile_caches() -> None:
    """Before anything compiles: torch's compile caches are this user's alone. Inductor keeps its cache in
    `<tmp>/torchinductor_<user>` (unless TORCHINDUCTOR_CACHE_DIR says otherwise) and its precompiled headers
    there whatever that variable says, and it takes an existing folder as it finds it and an existing header
    as built: another user who makes the folder first plants headers that every compile includes.

    Each process the platform starts has a private TMPDIR (`rayhpc.private.private_tmpdir`), where torch
    looks for the folder. A link there leads to the node's `<tmp>/torchinductor_<user>` (where torch keeps it:
    its headers, about 25 s of one core to build, then serve every job of the user on the node), made 0700
    here or used where it is this user's alone (`own_dir`). Where another user holds that one, the caches stay
    in the private TMPDIR (built once per job), with a warning. Where torch looks outside a private TMPDIR (a
    worker of a cluster the platform did not start), the folder must pass `own_dir` (`UnsafePath` otherwise,
    naming it). TORCHINDUCTOR_CACHE_DIR, where set, passes the same check."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # read first: importing torch's cache module sets it
    # private: torch's default folder of its compile caches, `<tmp>/torchinductor_<user>`, no public API names it;
    # its precompiled headers go there too, fixed as its cache module is first imported (under the private TMPDIR
    # every process of the platform has by then)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if chosen and os.path.abspath(chosen) == default_cache_dir():
        chosen = None  # torch's own default, which it sets when its cache module is imported
    looked_up = {Path(default_cache_dir()), Path(chosen or default_cache_dir())}
    node: Path | None = Path(os.environ.get(OWN_TMPDIR_BASE) or tempfile.gettempdir()) / Path(default_cache_dir()).name
    try:
        own_dir(node)
    except UnsafePath as exc:
        if node in looked_up:
            raise
        log.warning(f"{exc}; the compile caches stay in this job's private temp folder (built once per job)")
        node = None
    for folder in looked_up - {node}:
        if node is not None and folder.is_symlink() and folder.resolve() == node.resolve():
            continue  # linked by an earlier call
        if node is not None and folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()  # empty: made by torch when its cache module was imported
        if node is not None and not os.path.lexists(folder) and str(folder) != chosen:
            folder.symlink_to(node)
        else:
            own_dir(folder)


def world_mesh(device: torch.device):
    """A 1-D mesh of every rank on the worker's own device type: `fully_shard` without a mesh picks
    the accelerator itself, which on a GPU node moves a CPU worker's parameters to cuda:0."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DistributedDataParallel over the process group that is up (a single worker stays unwrapped):
    torch's own wrapper, so that Ray Train's workers and the platform's warm worker groups
    (`rayhpc.tune.warm`, outside any Ray Train session) wrap alike."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    if device.type == "cuda":
        return nn.parallel.DistributedDataParallel(model, device_ids=[device], output_device=device)
    return nn.parallel.DistributedDataParallel(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
