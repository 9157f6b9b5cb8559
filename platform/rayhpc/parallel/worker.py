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
import functools
import logging
import time
import warnings

import ray
import torch
import torch.distributed as dist
from torch import nn

from rayhpc import engine
from rayhpc.config import ConfigError
from rayhpc.engine import checkpoint
from rayhpc.engine.parallelize import full_state, parallelize
from rayhpc.engine.step import clip_grad_norm_
from rayhpc.monitor.metrics import WorkerMetrics
from rayhpc.optim import set_lr
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.mesh import Degrees, build_mesh
from rayhpc.parallel.plan import keep_stage, tied, units
from rayhpc.parallel.pp import SPLIT_BACKWARD, build_schedule, rank_stages
from rayhpc.parallel.recipe import Recipe
from rayhpc.parallel.traced import TracedStage
from rayhpc.precision import autocast, set_matmul_precision
from rayhpc.task.batches import draw_as_a_loader, epoch_indices, eval_batch, named_scores, score_sums
from rayhpc.workers.group import WorkerContext


@dataclasses.dataclass
class RankRun:
    cfg: ParallelConfig
    coords: dict[str, int]
    parts: list[nn.Module]  # this rank's stages (one unless the schedule interleaves), TP/FSDP-sharded
    stage_ids: list[int]  # their global stage indices
    optimizers: list[torch.optim.Optimizer]  # one per part (torchtitan's way: DCP pairs a model with its optimizer)
    schedulers: list  # the task's own LR scheduler per optimizer, or Nones: the `schedule:` section sets the lr
    make_schedule: object  # (inputs, outputs) -> a (schedule, its PipelineStage per part) pair (`pipeline_schedule`):
    # the stages' buffers have one micro-batch's shapes, so each batch size (an epoch's partial last one) gets its own
    pp_group: object | None  # the process group of this rank's pipeline
    x: torch.Tensor
    y: torch.Tensor
    recipe: Recipe
    val: tuple[torch.Tensor, torch.Tensor] | None = None  # validation inputs and targets, if the task has them
    order: tuple[int, list[int]] = (-1, [])  # (epoch, this replica's sample indices of it)
    schedules: dict = dataclasses.field(default_factory=dict)  # micro-batch size -> (schedule, stages)

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
    whole = recipe.build()  # host memory: the one-process run's weights, and every buffer, persistent or not
    initial = {**whole.state_dict(), **dict(whole.named_buffers())}  # (RoPE's inv_freq in a transformers model)
    total = sum(p.numel() for p in whole.parameters())  # each tied weight once, no buffers
    del whole
    p = cfg.parallelism
    mesh = build_mesh(p, ctx.device.type)
    coords = p.coords(ctx.rank)
    stage_ids = rank_stages(p.schedule, coords["pp"], p.pp, p.per_rank_stages) if p.pp > 1 else [None]
    pp_group = mesh["pp"].get_group() if p.pp > 1 else None
    parts = []
    for stage_id in stage_ids:
        with torch.device("meta"):
            model = recipe.build()
        ties = tied(model)
        part = shard_stage(model, mesh, p, stage_id, recipe, data["train"][0], pp_group)
        part.to_empty(device=ctx.device)
        retie(part, ties)
        materialise(part, initial)
        parts.append(part)
    del initial
    # each schedule step is one micro-batch of `accumulate`: its loss is scaled so the gradients the
    # steps add up are the mean over the whole batch (torch's own scaling would divide the sum)
    scale = 1 / (p.n_microbatches * cfg.accumulate)
    make_schedule = functools.partial(build_schedule, parts, stage_ids, p.n_stages, ctx.device, pp_group, p.schedule,
                                      p.n_microbatches, lambda out, target: recipe.loss(out, target) * scale)
    # one optimizer per part: its state shards like the weights; the task's own scheduler (if any) made now,
    # so the optimizer's state records the lr the schedule begins with (`initial_lr`) and a checkpoint holds it
    optimizers = [recipe.task.optimizer(part.parameters(), recipe.hp) for part in parts]
    schedulers = [recipe.task.scheduler(optimizer, recipe.hp) for optimizer in optimizers]
    (x, y), val = data["train"], data["val"]
    val = tuple(t.to(ctx.device) for t in val) if val is not None else None
    run = RankRun(cfg, coords, parts, [s or 0 for s in stage_ids], optimizers, schedulers, make_schedule, pp_group,
                  x.to(ctx.device), y.to(ctx.device), recipe, val)
    ctx.state["run"], ctx.state["gauges"] = run, WorkerMetrics(cfg.name, ctx.rank)
    return total, sum(q.to_local().numel() if hasattr(q, "to_local") else q.numel() for _, q in run.named_parameters())


def shard_stage(model: nn.Module, mesh, degrees: Degrees, stage_id: int | None, recipe: Recipe,
                example: torch.Tensor, pp_group=None) -> nn.Module:
    """Pipeline stage `stage_id` of `model` (cut in place, or traced on `example`'s shapes; None: the whole
    model), then the engine's parallelisms:
    tensor-parallel over mesh["tp"], its blocks checkpointed and compiled, sharded over mesh["fsdp"] and
    replicated over mesh["dp"] (FSDP2's HSDP) wherever there are replicas to average gradients over.

    Parameter names stay those of the whole model (`layers.4.weight`, `blocks.2.attn.wq.weight`),
    so gathered weights and checkpoints line up with an unsharded run.
    """
    if stage_id is None:
        stage = model
    elif recipe.traced:
        stage = TracedStage(recipe.build, recipe.stage_starts(model), stage_id, example, pp_group)
    else:
        stage = keep_stage(model, recipe.stage_starts(model), stage_id)
    # the FSDP2 units: each pipeline unit that holds parameters (a Linear, a block, an embedding; a stage's
    # removed units are not its children), so one unit's parameters are gathered at a time. The zero-bubble
    # schedules compute weight gradients in a pass of their own, outside autograd's hooks, and with nested
    # units (torch 2.13) the result differed from one process (measured); with the stage as one unit it is equal.
    # A traced stage is one unit: its modules are traced away
    nested = recipe.cfg.parallelism.schedule not in SPLIT_BACKWARD and not recipe.traced
    found = [stage.get_submodule(u) for u in units(stage)] if nested else []
    # bf16 by FSDP's mixed-precision policy, as in every job that shards with FSDP (the forward then runs
    # without autocast: `rayhpc.precision.autocast`)
    return parallelize(stage, recipe.task.obj, recipe.cfg, "fsdp" if degrees.fsdp_applies else None,
                       tp=(mesh["tp"], recipe.tp_plan(stage)) if degrees.tp > 1 else None,
                       mesh=mesh["dp", "fsdp"] if degrees.dp > 1 else mesh["fsdp"],
                       units=[m for m in found if any(True for _ in m.parameters())],
                       bf16=recipe.cfg.precision == "bf16")


def retie(module: nn.Module, ties: list[list[str]]) -> None:
    """Make each tied group one parameter again: sharding a module, and `to_empty`, give every module that
    holds a parameter its own, and the copies would train apart. Sharded alike or not at all, or an error."""
    present = dict(module.named_parameters(remove_duplicate=False))  # a pipeline stage holds some
    for first, *aliases in ties:
        param = present.get(first)
        for path in [a for a in aliases if a in present] if param is not None else []:
            layout, want = getattr(module.get_parameter(path), "placements", None), getattr(param, "placements", None)
            if layout != want:
                raise ConfigError(f"tp_plan: {path} is tied to {first}, and the plan shards them differently "
                                  f"({layout} vs {want}); shard both alike, or untie them")
            owner, _, key = path.rpartition(".")
            module.get_submodule(owner).register_parameter(key, param)


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
    """This data-parallel replica's batch of global step `step`: the data order of every job, this replica
    as rank `replica` of `replicas` of a DistributedSampler, an epoch's last batch partial. An epoch's first
    batch draws once from torch's RNG, as iterating a DataLoader does (dropout masks then match every job's)."""
    cfg, p = run.cfg, run.cfg.parallelism
    epoch, k = divmod(step, cfg.steps_per_epoch(len(run.x)))
    if run.order[0] != epoch:
        run.order = epoch, epoch_indices(len(run.x), cfg.seed, epoch, p.replica(run.coords), p.replicas)
    if k == 0:
        draw_as_a_loader()
    b = cfg.replica_batch
    idx = torch.as_tensor(run.order[1][k * b:(k + 1) * b], device=run.x.device)
    return run.x[idx], run.y[idx]


def forward_loss(run: RankRun, x: torch.Tensor, y: torch.Tensor, train: bool, scale: float = 1.0):
    """The batch's mean loss where this rank computes it (the last stage; every rank without a pipeline),
    else None; when `train`, its gradients x `scale` added to the parameters' (a pipeline's loss function
    scales them itself). Also the last stage's output (for metrics), or None."""
    if run.pp_group is None:
        output = run.parts[0](x)
        loss = run.recipe.loss(output, y)
        if train:
            (loss * scale).backward()
        return loss.detach(), output
    if not train:
        output = pipeline_forward(run, x)
        return (run.recipe.loss(output, y) if run.last_stage else None), output
    schedule = pipeline_schedule(run, x)[0]
    losses = [] if run.last_stage else None
    schedule.step(*((x,) if run.first_stage else ()), target=y if run.last_stage else None, losses=losses)
    # the loss function scaled each microbatch's loss by 1 / (microbatches x accumulate)
    return (torch.stack(losses).sum().detach() * run.cfg.accumulate if run.last_stage else None), None


def pipeline_schedule(run: RankRun, x: torch.Tensor) -> tuple:
    """The pipelining schedule, and its stages, of batches the size of `x`: made at that size's first step, each
    stage given its inputs and outputs as one micro-batch of `x` sent through the stages makes them (eval mode, no
    gradients). Left to infer them, torch runs every later stage's forward in train mode on uninitialised memory
    (`torch.empty_strided`), which BatchNorm folds into its running statistics: NaN from then on."""
    if len(x) not in run.schedules:
        seen: dict[int, tuple] = {}
        modes = [part.training for part in run.parts]
        with torch.no_grad():
            for part in run.parts:
                part.eval()
            try:
                pipeline_forward(run, x[:len(x) // run.cfg.parallelism.n_microbatches], seen)
            finally:
                for part, mode in zip(run.parts, modes):
                    part.train(mode)
        # as torch's own inference has them: a later stage's inputs, and every output, need their gradients
        inputs = [tuple(t.detach().requires_grad_(s > 0 and t.is_floating_point()) for t in seen[s][0])
                  for s in run.stage_ids]
        outputs = [_like(seen[s][1], lambda t: t.detach().requires_grad_(t.is_floating_point())) for s in run.stage_ids]
        run.schedules[len(x)] = run.make_schedule(inputs, outputs)
    return run.schedules[len(x)]


def pipeline_forward(run: RankRun, x: torch.Tensor, seen: dict | None = None) -> torch.Tensor | None:
    """The whole batch through every stage in order, forward only, activations sent point to point
    between pipeline ranks: the last stage's output where it lives, else None (`seen`: filled with each of this
    rank's stages' inputs, a tuple, and output). For validation: no microbatches are needed without a backward, and
    torch's own `schedule.eval()` runs backward actions under the zero-bubble V schedule (torch 2.13). A stage may
    pass on several tensors (a traced stage: an attention mask, RoPE's cos and sin beside the activation)."""
    p, me = run.cfg.parallelism, run.coords["pp"]
    holder = {s: r for r in range(p.pp) for s in rank_stages(p.schedule, r, p.pp, p.per_rank_stages)}
    parts = dict(zip(run.stage_ids, run.parts))
    act = x
    for stage in sorted(parts):  # ascending on every rank: the chain of sends and receives cannot deadlock
        if stage > 0 and holder[stage - 1] != me:
            act = _recv(run.pp_group, holder[stage - 1], x.device)
        given = act if isinstance(act, tuple) else (act,)
        act = parts[stage](*given)
        if seen is not None:
            seen[stage] = (given, act)
        if stage + 1 < p.n_stages and holder[stage + 1] != me:
            _send(act, run.pp_group, holder[stage + 1])
    return act if run.last_stage else None


def _like(made, fn):
    """`fn` of a stage's output, a tensor or a tuple of them."""
    return tuple(map(fn, made)) if isinstance(made, tuple) else fn(made)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)


def _send(act: torch.Tensor | tuple, group, to: int) -> None:
    """A stage's output (a tensor, or a tuple of them) to pipeline rank `to`: how many tensors (0: one, not a
    tuple), then each after a header with its dtype and shape (up to 6 dimensions)."""
    dst = dist.get_global_rank(group, to)
    tensors = act if isinstance(act, tuple) else (act,)
    device = tensors[0].device
    dist.send(torch.tensor([len(tensors) if isinstance(act, tuple) else 0], device=device), dst, group=group)
    for tensor in tensors:
        header = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape] + [0] * (6 - tensor.dim())
        dist.send(torch.tensor(header, device=device), dst, group=group)
        dist.send(tensor.contiguous(), dst, group=group)


def _recv(group, source: int, device: torch.device) -> torch.Tensor | tuple:
    src = dist.get_global_rank(group, source)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src, group=group)
    tensors = []
    for _ in range(max(1, int(count))):
        header = torch.zeros(8, dtype=torch.int64, device=device)
        dist.recv(header, src, group=group)
        dtype, ndim, *shape = header.tolist()
        tensors.append(torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device))
        dist.recv(tensors[-1], src, group=group)
    return tuple(tensors) if int(count) else tensors[0]


def train_step(ctx: WorkerContext, step: int) -> dict:
    """One optimizer step (`rayhpc.engine.train_step`) on this replica's batch; the loss (mean over this
    replica's batch) where this rank computes it."""
    run: RankRun = ctx.state["run"]
    x, y = replica_batch(run, step)
    started = time.perf_counter()
    loss = engine.train_step(Stages(run, ctx.device), (x, y), run.cfg.accumulate, step, run.cfg.steps)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)  # every rank's step time is its device's
    value = loss.item() if run.last_stage else None  # one host sync per step
    seconds = time.perf_counter() - started
    ctx.state["gauges"].record(value, len(x) / seconds, seconds, ctx.device)  # loss: None off the last stage
    return {"loss": value, "seconds": seconds, "coords": run.coords}


class Stages:
    """A rank's stages as `rayhpc.engine.train_step` trains them: the schedule's lr (or the task's own
    schedulers), a micro-batch through the pipeline schedule or the TP/FSDP-sharded module, clipping by the
    total norm over every rank's shards."""

    def __init__(self, run: RankRun, device: torch.device):
        self.run, self.device = run, device

    def begin(self, step: int, total_steps: int) -> None:
        for optimizer, scheduler in zip(self.run.optimizers, self.run.schedulers):
            optimizer.zero_grad()
            if scheduler is None:
                set_lr(optimizer, self.run.recipe.optim.lr, self.run.recipe.schedule, step, total_steps)

    def backward(self, part, share: float, last: bool) -> torch.Tensor:
        with autocast(self.run.cfg.precision, self.device, self.run.cfg.parallelism.fsdp_applies):
            loss = forward_loss(self.run, *part, train=True, scale=share)[0]
        return loss if loss is not None else torch.zeros((), device=self.device)  # off the last stage

    def finish(self) -> None:
        run = self.run
        if run.recipe.optim.clip_grad_norm:
            params = [q for _, q in run.named_parameters()]
            clip_grad_norm_(params, run.recipe.optim.clip_grad_norm, run.pp_group)
        for optimizer, scheduler in zip(run.optimizers, run.schedulers):
            optimizer.step()
            if scheduler is not None:
                scheduler.step()


@torch.no_grad()
def evaluate(ctx: WorkerContext) -> dict:
    """Sums over this replica's share of the validation data (every `replicas`-th sample) of the loss and
    the task's metrics, each batch's weighted by its samples, where this rank computes them: the driver
    divides by the samples (`evaluate` of every other job: a mean over all the samples)."""
    run: RankRun = ctx.state["run"]
    p = run.cfg.parallelism
    draw_as_a_loader()  # every job's validation pass iterates its batches as a DataLoader does
    xv, yv = (t[p.replica(run.coords)::p.replicas] for t in run.val)
    batch = eval_batch(run.cfg.micro_batch)

    def score(part) -> dict:  # forward only: any batch size goes through the stages
        with autocast(run.cfg.precision, ctx.device, run.cfg.parallelism.fsdp_applies):
            loss, output = forward_loss(run, *part, train=False)
        return {} if loss is None else named_scores(loss, run.recipe.metrics(output, part[1]))  # the last stage's

    sums, _ = score_sums(score, ((xv[s:s + batch], yv[s:s + batch]) for s in range(0, len(xv), batch)), run.parts)
    return {"sums": {name: float(s) for name, s in sums.items()} or None, "samples": len(xv), "coords": run.coords}


def gather_weights(ctx: WorkerContext) -> dict[str, torch.Tensor]:
    """The stages' whole weights, returned by one rank per pipeline rank (tp = dp = fsdp = 0)."""
    run: RankRun = ctx.state["run"]
    weights = {k: v for part in run.parts for k, v in full_state(part).items()}
    return weights if run.coords["tp"] == run.coords["dp"] == run.coords["fsdp"] == 0 else {}


def save_checkpoint(ctx: WorkerContext, path: str, progress: checkpoint.Progress, extra: dict) -> None:
    """Each rank writes its own shards of its stages' weights and optimizer states, its RNG states (dropout
    goes on as it would have), and rank 0 the run's `extra` and `progress`: `rayhpc.engine.checkpoint.save`."""
    run = ctx.state["run"]
    checkpoint.save(path, list(zip(run.parts, run.optimizers)), progress, sharded=True, device=ctx.device,
                    rank=ctx.rank, world=ctx.world_size, extra=extra)


def load_checkpoint(ctx: WorkerContext, path: str, step: int) -> None:
    """Read this rank's shards back in place (the layout may differ from the one that saved them), and its
    RNG states; the task's own schedulers (if any) continue from optimizer step `step`."""
    run = ctx.state["run"]
    checkpoint.load(path, list(zip(run.parts, run.optimizers)), sharded=True, device=ctx.device, rank=ctx.rank)
    run.schedulers = [run.recipe.task.scheduler(optimizer, run.recipe.hp, step) if scheduler is not None else None
                      for optimizer, scheduler in zip(run.optimizers, run.schedulers)]