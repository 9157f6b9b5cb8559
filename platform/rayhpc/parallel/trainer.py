"""Run a model-parallel training job: validate, start (or join) Ray, train on a worker group."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path

import torch

from rayhpc.config import ConfigError
from rayhpc.data import step_indices
from rayhpc.job import start_job
from rayhpc.parallel import worker
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.recipe import Recipe
from rayhpc.task import task_for
from rayhpc.task.batches import collate
from rayhpc.tracking.runs import job_run
from rayhpc.train.checkpoint import Progress, latest_checkpoint, load_progress, prune, write_progress
from rayhpc.train.config import train_hparams
from rayhpc.workers.group import WorkerGroup

log = logging.getLogger(__name__)

LOSSES_FILE = "losses.json"  # the loss of every step so far, beside the training job's progress file


@dataclasses.dataclass(frozen=True)
class ParallelResult:
    cfg: ParallelConfig
    losses: list[float]  # one per step, from step 1 (restored steps included)
    step_seconds: list[float]  # slowest rank's time per step run in this session
    weights: dict[str, torch.Tensor]  # the whole model, gathered, under the unsharded model's names
    validation: dict[str, float] | None  # the final validation loss and task metrics, if there is validation data
    start_seconds: float  # placement group, actors, rendezvous, model set-up
    checkpoint: Path | None  # the latest checkpoint


def make_recipe(cfg: ParallelConfig) -> tuple[Recipe, dict]:
    """The recipe of the run and its data, {"train": (inputs, targets), "val": (inputs, targets) or None
    (a task whose validation data is less than one batch)}, every plan and size checked."""
    task = task_for(cfg.task, cfg.data)
    hp = train_hparams(cfg, task.hp_model)
    train, held_out = task.split_data(hp, cfg.data)
    cfg = cfg.with_steps(len(train))
    x, y = stack_pairs(train, task.where())
    val = stack_pairs(held_out, task.where()) if held_out is not None and len(held_out) >= cfg.global_batch else None
    recipe = Recipe(cfg, hp=hp, task=task)
    step_indices(len(x), cfg.global_batch, cfg.seed, 0)  # raises if the batch exceeds the data
    recipe.check()
    return recipe, {"train": (x, y), "val": val}


def stack_pairs(dataset, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (input, target) item of `dataset` stacked into two tensors: a step's batch is then one
    index per rank, the same on every rank and in the one-process reference."""
    batch = collate(dataset, range(len(dataset)))
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ConfigError(f"{where}: model-parallel training needs (input, target) tensor items, as the "
                          "pipeline feeds inputs to the first stage and targets to the last")
    return batch[0], batch[1]


def run_parallel(cfg: ParallelConfig, *, explicit: set[str] = frozenset(), log_level: int = logging.INFO) -> ParallelResult:
    """Train (or resume) the run `cfg` describes, its progress logged at `log_level`; input errors are raised
    before Ray starts."""
    made = {}
    start_job(cfg, explicit, workers=lambda c: c.world_size,
              check=lambda c, res: made.update(zip(("recipe", "data"), make_recipe(c))))
    recipe = made["recipe"]
    cfg = recipe.cfg  # the resolved config (resume, CPUs per rank), its steps counted from `epochs` if given
    recipe.task.ship()
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    start, losses, checkpoint = resume_point(cfg)
    say = functools.partial(log.log, log_level)
    started = time.perf_counter()
    compute = cfg.compute
    with WorkerGroup(cfg.world_size, cpus_per_worker=compute.cpus_per_worker, gpus_per_worker=float(compute.gpu),
                     timeout_s=cfg.timeout_s) as group:
        group.describe_rank = cfg.parallelism.describe
        params = group.run(worker.setup, recipe, ray.put(made["data"]))
        if checkpoint is not None:
            group.run(worker.load_checkpoint, str(checkpoint), start)
            say(f"resumed from {checkpoint} (step {start})")
        start_seconds = time.perf_counter() - started
        say(describe_layout(cfg, params, start_seconds))
        step_seconds = []
        tracked = job_run(cfg, {**recipe.hp, **cfg.parallelism.model_dump()}, "parallel")
        with tracked:
            validation, checkpoint = _train(cfg, group, recipe, made, start, losses, step_seconds, checkpoint,
                                            tracked, say)
        weights = {k: v for part in group.run(worker.gather_weights) for k, v in part.items()}
    return ParallelResult(cfg, losses, step_seconds, weights, validation, start_seconds, checkpoint)


def _train(cfg: ParallelConfig, group: WorkerGroup, recipe: Recipe, made: dict, start: int, losses: list[float],
           step_seconds: list[float], checkpoint: Path | None, tracked, say) -> tuple[dict | None, Path | None]:
    """The steps from `start` on (each step's loss and time appended, and queued for the tracked run),
    checkpointed and validated as `cfg` asks; (the last validation, None without a split; the latest checkpoint)."""
    for step in range(start, cfg.steps):
        loss, seconds = step_loss(group.run(worker.train_step, step))
        losses.append(loss)
        step_seconds.append(seconds)
        tracked.log(step + 1, {"loss": loss, "step_ms": seconds * 1e3})
        say(f"step {step + 1}/{cfg.steps}: loss {loss:.5f}  {seconds * 1e3:.1f} ms  "
            f"{cfg.global_batch / seconds:,.0f} samples/s{recipe.tokens(cfg.global_batch / seconds)}")
        every = cfg.checkpoint.every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.steps):
            checkpoint = save(group, cfg, step + 1, losses)
            prune(cfg.experiment_dir, cfg.checkpoint.keep)
        if made["data"]["val"] is not None and cfg.eval_every and (step + 1) % cfg.eval_every == 0 \
                and step + 1 < cfg.steps:  # the last step's comes below
            metrics = validate(group)
            tracked.log(step + 1, metrics)
            say(f"step {step + 1}: {describe_validation(metrics)}")
    validation = validate(group) if made["data"]["val"] is not None else None
    if validation is not None:
        tracked.log(cfg.steps, validation)
    return validation, checkpoint


def validate(group: WorkerGroup) -> dict[str, float]:
    """Validation loss and task metrics, averaged over the data-parallel replicas (each scores its share)."""
    replicas = [o["metrics"] for o in group.run(worker.evaluate) if o["metrics"] and o["coords"]["tp"] == 0]
    return {name: sum(r[name] for r in replicas) / len(replicas) for name in replicas[0]}


def describe_validation(metrics: dict[str, float]) -> str:
    return "validation " + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())


def step_loss(outcomes: list[dict]) -> tuple[float, float]:
    """The step's loss (mean over data-parallel replicas, from the last stage's first TP rank)
    and its time (the slowest rank's)."""
    replicas = [o["loss"] for o in outcomes if o["loss"] is not None and o["coords"]["tp"] == 0]
    return sum(replicas) / len(replicas), max(o["seconds"] for o in outcomes)


def describe_layout(cfg: ParallelConfig, params: list[tuple[int, int]], start_seconds: float) -> str:
    p = cfg.parallelism
    stages = f" ({p.per_rank_stages} stages per rank, {p.n_stages} in all)" if p.per_rank_stages > 1 else ""
    pipeline = (f"; {p.schedule}{stages}, {p.n_microbatches} microbatches of "
                f"{cfg.micro_batch // p.n_microbatches} samples" if p.pp > 1 else "")
    accumulate = f", {cfg.accumulate} micro-batches of {cfg.micro_batch} per replica" if cfg.accumulate > 1 else ""
    return (f"parallel: {cfg.world_size} ranks of {cfg.compute.cpus_per_worker:g} CPU, mesh pp({p.pp}) x "
            f"dp({p.dp}) x fsdp({p.fsdp}) x tp({p.tp}) on {'GPU (nccl)' if cfg.compute.gpu else 'CPU (gloo)'}, "
            f"{cfg.precision}; "
            f"{params[0][0]:,} parameters, {min(n[1] for n in params):,}-{max(n[1] for n in params):,} per rank; "
            f"batch {cfg.global_batch}{accumulate}{pipeline}; group ready in {start_seconds:.1f} s")


def save(group: WorkerGroup, cfg: ParallelConfig, step: int, losses: list[float]) -> Path:
    """A sharded checkpoint of the weights after `step` steps; the progress file (written once every rank
    has saved) marks it complete."""
    path = cfg.experiment_dir / f"checkpoint_{step:06d}"
    group.run(worker.save_checkpoint, str(path))
    (path / LOSSES_FILE).write_text(json.dumps(losses))
    write_progress(path, Progress(global_step=step))
    return path


def resume_point(cfg: ParallelConfig) -> tuple[int, list[float], Path | None]:
    """(first step to run, losses so far, checkpoint to load) for a resumed run; (0, [], None) otherwise."""
    latest = latest_checkpoint(cfg.experiment_dir) if cfg.resume else None
    if latest is None:
        return 0, [], None
    return load_progress(latest).global_step, json.loads((latest / LOSSES_FILE).read_text()), latest


def format_summary(result: ParallelResult) -> str:
    cfg, losses, seconds = result.cfg, result.losses, sorted(result.step_seconds)
    speed = "no steps left to run"
    if seconds:
        median = seconds[len(seconds) // 2]
        speed = f"median step {median * 1e3:.1f} ms, {cfg.global_batch / median:,.0f} samples/s"
    validation = f"\n{describe_validation(result.validation)}" if result.validation else ""
    return (f"trained {len(losses)} steps: loss {losses[0]:.5f} -> {losses[-1]:.5f}; {speed}; "
            f"start-up {result.start_seconds:.1f} s{validation}\n"
            f"checkpoint: {result.checkpoint or 'none (--checkpoint-every K to save one)'}")
