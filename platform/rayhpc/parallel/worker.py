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
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from torch import nn

from rayhpc.data import step_indices
from rayhpc.monitor.metrics import WorkerMetrics
from rayhpc.optim import set_lr
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.mesh import build_mesh
from rayhpc.parallel.parallelize import full_state, parallelize
from rayhpc.parallel.pp import build_schedule, rank_stages
from rayhpc.parallel.recipe import Recipe
from rayhpc.precision import autocast, set_matmul_precision
from rayhpc.train import checkpoint
from rayhpc.workers.group import WorkerContext


@dataclasses.dataclass
class RankRun:
    cfg: ParallelConfig
    coords: dict[str, int]
    parts: list[nn.Module]  # this rank's stages (one unless the schedule interleaves), TP/FSDP-sharded
    stage_ids: list[int]  # their global stage indices
    optimizers: list[torch.optim.Optimizer]  # one per part (torchtitan's way: DCP pairs a model with its optimizer)
    schedulers: list  # the task's own LR scheduler per optimizer, or Nones: the `schedule:` section sets the lr
    schedule: object | None  # the pipelining schedule when pp > 1
    pipe_stages: list  # its PipelineStage per part (none without a pipeline)
    pp_group: object | None  # the process group of this rank's pipeline
    x: torch.Tensor
    y: torch.Tensor
    recipe: Recipe
    val: tuple[torch.Tensor, torch.Tensor] | None = None  # validation inputs and targets, if the task has them

    @property
    def first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last_stage(self) -> bool:
        return self.cfg.parallelism.n_stages - 1 in self.stage_ids

    def named_parameters(self):
        for part in self.parts:
            yield from part.named_parameters()


def setup(ctx: WorkerContext, recipe: Recipe, data) -> tuple[int, int]:
    """Build this rank's share of the model; returns (the model's parameters, this rank's share)."""
    quiet_warnings()
    cfg = recipe.cfg
    data = ray.get(data) if isinstance(data, ray.ObjectRef) else data
    set_matmul_precision(cfg.precision)
    torch.manual_seed(cfg.seed)
    initial = recipe.build().state_dict()  # host memory: the one-process run's weights
    total = sum(t.numel() for t in initial.values())
    p = cfg.parallelism
    mesh = build_mesh(p, ctx.device.type)
    coords = p.coords(ctx.rank)
    stage_ids = rank_stages(p.schedule, coords["pp"], p.pp, p.per_rank_stages) if p.pp > 1 else [None]
    parts = []
    for stage_id in stage_ids:
        with torch.device("meta"):
            model = recipe.build()
        part = parallelize(model, mesh, p, stage_id, recipe)
        part.to_empty(device=ctx.device)
        materialise(part, initial)
        parts.append(part)
    del initial
    schedule, pipe_stages, pp_group = None, [], mesh["pp"].get_group() if p.pp > 1 else None
    if p.pp > 1:
        # each schedule step is one micro-batch of `accumulate`: its loss is scaled so the gradients the
        # steps add up are the mean over the whole batch (torch's own scaling would divide the sum)
        scale = 1 / (p.n_microbatches * cfg.accumulate)
        schedule, pipe_stages = build_schedule(parts, stage_ids, p.n_stages, ctx.device, pp_group, p.schedule,
                                               p.n_microbatches, lambda out, target: recipe.loss(out, target) * scale)
    # one optimizer per part: its state shards like the weights; the task's own scheduler (if any) made now,
    # so the optimizer's state records the lr the schedule begins with (`initial_lr`) and a checkpoint holds it
    optimizers = [recipe.task.optimizer(part.parameters(), recipe.hp) for part in parts]
    schedulers = [recipe.task.scheduler(optimizer, recipe.hp) for optimizer in optimizers]
    (x, y), val = data["train"], data["val"]
    val = tuple(t.to(ctx.device) for t in val) if val is not None else None
    run = RankRun(cfg, coords, parts, [s or 0 for s in stage_ids], optimizers, schedulers, schedule, pipe_stages,
                  pp_group, x.to(ctx.device), y.to(ctx.device), recipe, val)
    ctx.state["run"], ctx.state["gauges"] = run, WorkerMetrics(cfg.name, ctx.rank)
    return total, sum(q.to_local().numel() if hasattr(q, "to_local") else q.numel() for _, q in run.named_parameters())


@torch.no_grad()
def materialise(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Fill `module`'s parameters and buffers (allocated, uninitialised: `to_empty`) with their shares of
    the whole tensors `full`; a sharded (DTensor) parameter takes only its own shard, cut locally
    (`src_data_rank=None`: every rank holds the same whole tensor, so nothing is sent)."""
    # DTensor: about 0.7 s to import, only where a run shards
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
    and DTensor that gathering a 2-D (fsdp x tp) shard takes two all-gathers (once, at the end)."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def replica_batch(run: RankRun, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel replica's slice of global step `step`'s batch."""
    cfg = run.cfg
    idx = step_indices(len(run.x), cfg.global_batch, cfg.seed, step)
    return run.x[replica_slice(run, idx)], run.y[replica_slice(run, idx)]


def replica_slice(run: RankRun, idx):
    """This data-parallel replica's share of a global batch's indices."""
    p = run.cfg.parallelism
    per, share = len(idx) // p.replicas, p.replica(run.coords)
    return idx[share * per:(share + 1) * per]


def forward_loss(run: RankRun, x: torch.Tensor, y: torch.Tensor, train: bool, scale: float = 1.0):
    """The batch's mean loss where this rank computes it (the last stage; every rank without a pipeline),
    else None; when `train`, its gradients x `scale` added to the parameters' (a pipeline's loss function
    scales them itself). Also the last stage's output (for metrics), or None."""
    if run.schedule is None:
        output = run.parts[0](x)
        loss = run.recipe.loss(output, y)
        if train:
            (loss * scale).backward()
        return loss.detach(), output
    if not train:
        output = pipeline_forward(run, x)
        return (run.recipe.loss(output, y) if run.last_stage else None), output
    losses = [] if run.last_stage else None
    run.schedule.step(*((x,) if run.first_stage else ()), target=y if run.last_stage else None, losses=losses)
    # the loss function scaled each microbatch's loss by 1 / (microbatches x accumulate)
    return (torch.stack(losses).sum().detach() * run.cfg.accumulate if run.last_stage else None), None


def pipeline_forward(run: RankRun, x: torch.Tensor) -> torch.Tensor | None:
    """The whole batch through every stage in order, forward only, activations sent point to point
    between pipeline ranks: the last stage's output where it lives, else None. For validation: no
    microbatches are needed without a backward, and torch's own `schedule.eval()` runs backward
    actions under the zero-bubble V schedule (torch 2.13)."""
    p, me = run.cfg.parallelism, run.coords["pp"]
    holder = {s: r for r in range(p.pp) for s in rank_stages(p.schedule, r, p.pp, p.per_rank_stages)}
    parts = dict(zip(run.stage_ids, run.parts))
    act = x
    for stage in sorted(parts):  # ascending on every rank: the chain of sends and receives cannot deadlock
        if stage > 0 and holder[stage - 1] != me:
            act = _recv(run.pp_group, holder[stage - 1], x.device)
        act = parts[stage](act)
        if stage + 1 < p.n_stages and holder[stage + 1] != me:
            _send(act, run.pp_group, holder[stage + 1])
    return act if run.last_stage else None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


def _send(tensor: torch.Tensor, group, to: int) -> None:
    """`tensor` to pipeline rank `to`, after a header with its dtype and shape (up to 6 dimensions)."""
    dst = dist.get_global_rank(group, to)
    header = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape] + [0] * (6 - tensor.dim())
    dist.send(torch.tensor(header, device=tensor.device), dst, group=group)
    dist.send(tensor.contiguous(), dst, group=group)


def _recv(group, source: int, device: torch.device) -> torch.Tensor:
    src = dist.get_global_rank(group, source)
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    dtype, ndim, *shape = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(tensor, src, group=group)
    return tensor


def train_step(ctx: WorkerContext, step: int) -> dict:
    """One optimizer step: the schedule's lr, the gradients of `accumulate` micro-batches of this replica's
    batch, clipped by the total norm over every rank's shards; the loss (mean over this replica's batch)
    where this rank computes it."""
    run: RankRun = ctx.state["run"]
    cfg, hp = run.cfg, run.recipe.hp
    x, y = replica_batch(run, step)
    started = time.perf_counter()
    for optimizer, scheduler in zip(run.optimizers, run.schedulers):
        optimizer.zero_grad()
        if scheduler is None:
            set_lr(optimizer, hp, step, cfg.steps)
    losses = []
    for xm, ym in zip(x.chunk(cfg.accumulate), y.chunk(cfg.accumulate)):  # equal: the config checked it
        with autocast(cfg.precision, ctx.device):
            losses.append(forward_loss(run, xm, ym, train=True, scale=1 / cfg.accumulate)[0])
    if hp.get("clip_grad_norm"):
        clip_grad_norm(run, hp["clip_grad_norm"])
    for optimizer, scheduler in zip(run.optimizers, run.schedulers):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)  # every rank's step time is its device's
    value = torch.stack(losses).mean().item() if losses[0] is not None else None  # one host sync per step
    seconds = time.perf_counter() - started
    ctx.state["gauges"].record(value, len(x) / seconds, seconds, ctx.device)  # loss: None off the last stage
    return {"loss": value, "seconds": seconds, "coords": run.coords}


def clip_grad_norm(run: RankRun, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the whole model, which no rank holds: each sharded (DTensor)
    gradient's norm is reduced over its mesh (TP and FSDP shards), a replicated one counts once, and
    the pipeline ranks add their stages' squares. Returns the total norm."""
    from torch.distributed.tensor import DTensor  # DTensor: about 0.7 s to import, only where a run shards

    params = [q for _, q in run.named_parameters() if q.grad is not None]
    squares = torch.zeros((), device=run.x.device)
    for q in params:
        norm = torch.linalg.vector_norm(q.grad)
        squares += (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    if run.pp_group is not None:
        dist.all_reduce(squares, group=run.pp_group)
    total = squares.sqrt()
    coef = min(1.0, max_norm / (total.item() + 1e-6))  # torch's clip_grad_norm_ formula; a float multiplies
    for q in params:                                    # DTensor and plain gradients alike
        q.grad.mul_(coef)
    return total


@torch.no_grad()
def evaluate(ctx: WorkerContext) -> dict:
    """The validation loss and the task's metrics, averaged over whole global batches of the validation
    data (each replica scores its share), where this rank computes them."""
    run: RankRun = ctx.state["run"]
    xv, yv = run.val
    batch = run.cfg.global_batch
    sums: dict[str, float] = {}
    for start in range(0, len(xv) - batch + 1, batch):  # whole batches: the pipeline's buffers have its shape
        idx = replica_slice(run, torch.arange(start, start + batch))
        with autocast(run.cfg.precision, ctx.device):
            loss, output = forward_loss(run, xv[idx], yv[idx], train=False)
        if loss is not None:
            for name, value in {"val_loss": loss, **run.recipe.metrics(output, yv[idx])}.items():
                sums[name] = sums.get(name, 0.0) + float(value)
    batches = (len(xv) // batch) or 1
    return {"metrics": {k: v / batches for k, v in sums.items()} or None, "coords": run.coords}


def gather_weights(ctx: WorkerContext) -> dict[str, torch.Tensor]:
    """The stages' whole weights, returned by one rank per pipeline rank (tp = dp = fsdp = 0)."""
    run: RankRun = ctx.state["run"]
    weights = {k: v for part in run.parts for k, v in full_state(part).items()}
    return weights if run.coords["tp"] == run.coords["dp"] == run.coords["fsdp"] == 0 else {}


def _states(run: RankRun) -> list[dict]:
    """Per part: its weights and optimizer state as DCP saves them. The optimizer's is flattened (one
    key per parameter and setting, torchtitan's form): in the nested form DCP drops the param
    groups' non-tensor settings (Adam's betas) on load. Keys are whole-model names, so the parts'
    dicts never collide."""
    # DCP: about 1 s to import, only for sharded checkpoints
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return [dict(zip(("model", "optim"), get_state_dict(part, optimizer, options=options)))
            for part, optimizer in zip(run.parts, run.optimizers)]


def _merged(states: list[dict]) -> dict:
    return {key: {k: v for state in states for k, v in state[key].items()} for key in ("model", "optim")}


def save_checkpoint(ctx: WorkerContext, path: str) -> None:
    """Each rank writes its own shards of the weights and the optimizer state (torch.distributed.checkpoint);
    no rank holds the whole model. Every rank's RNG states go to `rng.pt` (`rayhpc.train.checkpoint`)."""
    import torch.distributed.checkpoint as dcp  # DCP: about 1 s to import, only for sharded checkpoints

    dcp.save(_merged(_states(ctx.state["run"])), checkpoint_id=path)
    checkpoint.save_rng(Path(path), ctx.device, ctx.rank, ctx.world_size)  # dropout goes on as it would have


def load_checkpoint(ctx: WorkerContext, path: str, step: int) -> None:
    """Read this rank's shards back in place (the layout may differ from the one that saved them), and its
    RNG states; the task's own schedulers (if any) continue from optimizer step `step`."""
    import torch.distributed.checkpoint as dcp  # DCP: about 1 s to import, only for sharded checkpoints
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    run = ctx.state["run"]
    states = _states(run)
    loaded = _merged(states)
    dcp.load(loaded, checkpoint_id=path)  # tensors in place; non-tensor entries (lr, betas) replaced in `loaded`
    for part, optimizer, state in zip(run.parts, run.optimizers, states):
        set_state_dict(part, optimizer, model_state_dict={k: loaded["model"][k] for k in state["model"]},
                       optim_state_dict={k: loaded["optim"][k] for k in state["optim"]},
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
    run.schedulers = [run.recipe.task.scheduler(optimizer, run.recipe.hp, step) if scheduler is not None else None
                      for optimizer, scheduler in zip(run.optimizers, run.schedulers)]
    checkpoint.load_rng(Path(path), ctx.device, ctx.rank)
