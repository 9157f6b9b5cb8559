"""Every job's parallelisms on a model, one small function per step, in torchtitan's order: tensor parallelism,
then activation checkpointing and compilation of its blocks, then FSDP2 or DDP (`parallelize`). A data-parallel
run wraps the task's whole model; a model-parallel rank its pipeline stage (`rayhpc.parallel.worker`).

FSDP2 (`apply_fsdp`: `fully_shard` on each unit, then on the root): units are all-gathered one at a time in
forward and backward and freed after use, so a rank holds one unit's whole parameters at a time. The last
unit's backward runs right after its forward, so it keeps its gathered weights in between (freeing them would
only all-gather them again; torchtitan does the same); on one rank every unit does. With bf16, compute runs in
bf16 while gradients are reduced in fp32, so the update matches fp32 training closely.
(`ray.train.torch.prepare_model(parallel_strategy="fsdp")` is FSDP1, which refuses CPUs.)
"""

from __future__ import annotations

import collections
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

from rayhpc.private import OWN_TMPDIR_BASE, UnsafePath, own_dir

log = logging.getLogger(__name__)
# selective checkpointing keeps the outputs of these (the costly matmuls and attention) and recomputes the rest
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default}


def parallelize(model: nn.Module, task, options, strategy: str | None, device: torch.device | None = None, *,
                tp: tuple | None = None, mesh=None, units: list[nn.Module] | None = None, bf16: bool = False
                ) -> nn.Module:
    """`model` moved to `device` (None: where it is, a meta-device stage materialised after), tensor-parallel by
    `tp` ((mesh, plan): `parallelize_module`'s), its blocks checkpointed and compiled as `options` asks (`task`:
    the user's task object), then wrapped for `strategy`: "fsdp" (FSDP2 over `mesh`, the world where None; each
    of `units` sharded on its own, default `fsdp_units`), "ddp", or None (as it is)."""
    if device is not None:
        model.to(device)
    if tp is not None:
        # DTensor: about 0.7 s to import, only where a run shards
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, *tp)
    apply_options(model, task, options)
    if strategy == "fsdp":
        return apply_fsdp(model, fsdp_units(task, model) if units is None else units, mesh or world_mesh(device), bf16)
    return apply_ddp(model, device) if strategy == "ddp" else model


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


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules that hold parameters themselves (Linear, Conv2d, LayerNorm, ...), in order."""
    return [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]


def fsdp_units(task, model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one at a time: the task's `fsdp_units(model)` if it has one, else the modules
    that hold parameters."""
    hook = getattr(task, "fsdp_units", None)
    return list(hook(model)) if callable(hook) else default_units(model)


def untied(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """`units` less those holding a parameter that a module outside them holds too (GPT-2's `lm_head` and
    `wte`, one weight): those stay with the root's group, so each tied parameter is in one unit (FSDP2 refuses
    a parameter that two groups manage)."""
    holders = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return [u for u in units if all(holders[k] == n for k, n in collections.Counter(
        id(p) for _, p in u.named_parameters(remove_duplicate=False)).items())]


def apply_fsdp(model: nn.Module, units: list[nn.Module], mesh=None, bf16: bool = False) -> nn.Module:
    """Shard each of `units` (less those tied to a module outside them: `untied`), then `model`, over `mesh` (a
    1-D device mesh; 2-D: replicated over the first dim and sharded over the second, HSDP; None: the whole
    world)."""
    # FSDP2: about 0.7 s to import, only where a run shards
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    # on one rank the "shard" is the whole parameter: a group per unit saves no memory and costs each unit
    # its own gather, gradient reduction and hooks, so the model is one group (FSDP2 one worker: see
    # docs/benchmarks.md)
    shared = (mesh.size(mesh.ndim - 1) if mesh is not None else torch.distributed.get_world_size()) > 1
    units = untied(model, units) if shared else []
    for i, unit in enumerate(units):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: kept gathered from forward to backward
    return model


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


def full_state(module: nn.Module) -> dict:
    """Whole (unsharded) parameters by name; a collective over each parameter's mesh, so every
    rank holding a shard of the module must call it."""
    from torch.distributed.tensor import DTensor  # DTensor: about 0.7 s to import, only where a run shards

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in module.named_parameters()}
