"""What every rank of a model-parallel run executes (through `WorkerGroup.run`).

`setup` builds the model on the meta device (shapes, no memory), applies the
parallelisms, and materialises only this rank's shards on its device (torchtitan's
way): a GPU never holds the whole model. The shards are filled from the weights a
single-process run starts from (built from the seed in host memory, one parameter
moved at a time), so every layout starts from the same weights as the one-process
reference. It leaves the run in `ctx.state`; the other functions train, gather and
checkpoint it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import torch
from torch import nn

from rayhpc.data import step_indices
from rayhpc.monitor.metrics import WorkerMetrics
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.mesh import build_mesh
from rayhpc.parallel.parallelize import full_state, parallelize
from rayhpc.parallel.pp import build_schedule
from rayhpc.parallel.recipe import Recipe
from rayhpc.task.hparams import make_optimizer
from rayhpc.workers.group import WorkerContext


@dataclasses.dataclass
class RankRun:
    cfg: ParallelConfig
    coords: dict[str, int]
    module: nn.Module  # this rank's stage, TP/FSDP-sharded
    optimizer: torch.optim.Optimizer
    schedule: object | None  # the pipelining schedule when pp > 1
    x: torch.Tensor
    y: torch.Tensor
    recipe: Recipe

    @property
    def first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def last_stage(self) -> bool:
        return self.coords["pp"] == self.cfg.pp - 1


def setup(ctx: WorkerContext, recipe: Recipe, data) -> tuple[int, int]:
    """Build this rank's share of the model; returns (the model's parameters, this rank's share)."""
    import ray

    quiet_warnings()
    cfg = recipe.cfg
    x, y = ray.get(data) if isinstance(data, ray.ObjectRef) else data
    # TF32 matmuls for fp32 on GPUs (7-8x the plain fp32 peak on an H100); no effect on CPUs
    torch.backends.cuda.matmul.allow_tf32 = cfg.precision != "fp32"
    torch.backends.cudnn.allow_tf32 = cfg.precision != "fp32"
    torch.manual_seed(cfg.seed)
    initial = recipe.build()  # host memory: the one-process run's weights
    total = sum(p.numel() for p in initial.parameters())
    mesh = build_mesh(cfg.degrees, ctx.device.type)
    coords = cfg.degrees.coords(ctx.rank)
    with torch.device("meta"):
        model = recipe.build()
    module = parallelize(model, mesh, cfg.degrees, ctx.rank, recipe)
    module.to_empty(device=ctx.device)
    materialise(module, initial.state_dict())
    del initial
    schedule = None
    if cfg.pp > 1:
        schedule = build_schedule(module, coords["pp"], cfg.pp, ctx.device, mesh["pp"].get_group(),
                                  cfg.schedule, cfg.n_microbatches, recipe.loss)
    optimizer = make_optimizer(recipe.hp, module.parameters())  # its state shards like the parameters
    ctx.state["run"] = RankRun(cfg, coords, module, optimizer, schedule, x.to(ctx.device), y.to(ctx.device), recipe)
    ctx.state["gauges"] = WorkerMetrics(cfg.name, ctx.rank)
    return total, sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters())


@torch.no_grad()
def materialise(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Fill `module`'s parameters and buffers (allocated, uninitialised: `to_empty`) with their shares of
    the whole tensors `full`; a sharded (DTensor) parameter takes only its own shard, cut locally
    (`src_data_rank=None`: every rank holds the same whole tensor, so nothing is sent)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if isinstance(tensor, DTensor):
            whole = full[name].to(tensor.to_local().device)
            whole = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
        else:
            whole = full[name].to(tensor.device)
        tensor.copy_(whole)


def quiet_warnings() -> None:
    """Silence two warnings that fire every run without anything to act on: FSDP2 warns that a
    sharded Linear returns a view (only in-place ops on it would be wrong; the models use none),
    and DTensor that gathering a 2-D (dp x tp) shard takes two all-gathers (once, at the end)."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def replica_batch(run: RankRun, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel replica's slice of global step `step`'s batch."""
    cfg = run.cfg
    idx = step_indices(len(run.x), cfg.batch_size, cfg.seed, step)
    per = cfg.batch_size // cfg.dp
    idx = idx[run.coords["dp"] * per:(run.coords["dp"] + 1) * per]
    return run.x[idx], run.y[idx]


def autocast(cfg: ParallelConfig, device: torch.device):
    """bf16 mixed precision (weights, gradients and optimizer in fp32; matmuls in bf16), or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def train_step(ctx: WorkerContext, step: int) -> dict:
    """One optimizer step; the loss (mean over this replica's batch) where this rank computes it."""
    run: RankRun = ctx.state["run"]
    x, y = replica_batch(run, step)
    started = time.perf_counter()
    run.optimizer.zero_grad()
    with autocast(run.cfg, ctx.device):
        if run.schedule is None:
            loss = run.recipe.loss(run.module(x), y)
            loss.backward()
            value = loss.item()
        else:
            losses = [] if run.last_stage else None
            inputs = (x,) if run.first_stage else ()
            run.schedule.step(*inputs, target=y if run.last_stage else None, losses=losses)
            value = torch.stack(losses).mean().item() if run.last_stage else None
    run.optimizer.step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - started
    ctx.state["gauges"].record(value, len(x) / seconds, seconds, ctx.device)  # loss: None off the last stage
    return {"loss": value, "seconds": seconds, "coords": run.coords}


def gather_weights(ctx: WorkerContext) -> dict[str, torch.Tensor]:
    """The stage's whole weights, returned by one rank per stage (tp = dp = 0)."""
    run: RankRun = ctx.state["run"]
    weights = full_state(run.module)
    return weights if run.coords["tp"] == run.coords["dp"] == 0 else {}


def _state(run: RankRun) -> dict:
    """This rank's weights and optimizer state as DCP saves them. The optimizer's is flattened (one
    key per parameter and setting, torchtitan's form): in the nested form DCP drops the param
    groups' non-tensor settings (Adam's betas) on load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(run.module, run.optimizer,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": model, "optim": optim}


def save_checkpoint(ctx: WorkerContext, path: str) -> None:
    """Each rank writes its own shards of the weights and the optimizer state (torch.distributed.checkpoint);
    no rank holds the whole model."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(ctx.state["run"]), checkpoint_id=path)


def load_checkpoint(ctx: WorkerContext, path: str) -> None:
    """Read this rank's shards back in place (the layout may differ from the one that saved them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    run = ctx.state["run"]
    state = _state(run)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(run.module, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))
