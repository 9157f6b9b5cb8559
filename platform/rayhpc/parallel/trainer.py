"""Run a model-parallel training job: validate, start (or join) Ray, train on a worker group."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from pathlib import Path

import torch

from rayhpc.config import ConfigError, JobFailed
from rayhpc.engine.checkpoint import (
    Progress,
    forget_if_unstarted,
    latest_checkpoint,
    load_extra,
    load_progress,
    prune,
)
from rayhpc.engine.loop import Best, Due, Plan, Runner, Window, fit
from rayhpc.engine.metrics import MetricsRecorder, metrics_row
from rayhpc.job import start_job
from rayhpc.optim import lr_factor
from rayhpc.parallel import worker
from rayhpc.parallel.config import ParallelConfig
from rayhpc.parallel.recipe import Recipe
from rayhpc.task import task_for
from rayhpc.task.batches import collate
from rayhpc.task.check import CHECK_BATCH
from rayhpc.task.failure import cause_of, rank_failure
from rayhpc.tracking.runs import job_run
from rayhpc.train.config import train_hparams
from rayhpc.workers.group import WorkerGroup, WorkerGroupError

log = logging.getLogger(__name__)



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
    (a task without validation data)}, every plan and size checked."""
    task = task_for(cfg.task, cfg.data)
    hp = train_hparams(cfg, task.hp_model)
    train, held_out = task.split_data(hp, cfg.data)
    x, y = stack_pairs(train, task.where())
    val = stack_pairs(held_out, task.where()) if held_out is not None and len(held_out) else None
    recipe = Recipe(cfg, hp=hp, task=task)
    recipe.check(x[:CHECK_BATCH])  # the plan and the split before the run's length: the error to fix first
    recipe.cfg = cfg.with_steps(len(train))
    recipe.check_stand_in(x[:CHECK_BATCH], y[:CHECK_BATCH])
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
    for failures in range(cfg.max_failures + 1):
        try:
            return _run(cfg, recipe, made, log_level)
        except WorkerGroupError as exc:
            if failures == cfg.max_failures:
                forget_if_unstarted(cfg)
                if not exc.failed:  # ranks that did not answer in time: the summary is one line
                    raise JobFailed(str(exc).splitlines()[0]) from None
                raise rank_failure(exc.failed, cfg.experiment_dir, recipe.task.spec, exc.what, exc.describe) from None
            # as Ray Train restarts a failed group (max_failures): a new group, from the latest checkpoint
            cfg = cfg.model_copy(update={"resume": True})
            cause = f" ({cause_of(exc.failed[min(exc.failed)])})" if exc.failed else ""
            latest = latest_checkpoint(cfg.experiment_dir)
            log.warning(f"{cfg.name}: {str(exc).splitlines()[0]}{cause}; starting the worker group again from "
                        f"{latest.name if latest else 'the start'} (failure {failures + 1} of at most "
                        f"{cfg.max_failures})")


def _run(cfg: ParallelConfig, recipe: Recipe, made: dict, log_level: int) -> ParallelResult:
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
                                            tracked, log_level)
        weights = {k: v for part in group.run(worker.gather_weights) for k, v in part.items()}
    return ParallelResult(cfg, losses, step_seconds, weights, validation, start_seconds, checkpoint)


def _train(cfg: ParallelConfig, group: WorkerGroup, recipe: Recipe, made: dict, start: int, losses: list[float],
           step_seconds: list[float], checkpoint: Path | None, tracked, log_level: int
           ) -> tuple[dict | None, Path | None]:
    """The steps from `start` on (`rayhpc.engine.fit`; each step's loss and time appended, and queued for the
    tracked run; a line each at DEBUG), checkpointed and validated as `cfg` asks, a `metrics.parquet` row and a
    line at each epoch's end (`rayhpc.engine.metrics`); (the last validation, None without a split; the latest
    checkpoint)."""
    n_train = len(made["data"]["train"][0])
    plan = Plan(cfg.steps_per_epoch(n_train), cfg.steps, checkpoint_every=cfg.checkpoint.every,
                eval_every=cfg.eval_every if made["data"]["val"] is not None else None)
    runner = _Driver(cfg, group, recipe, plan, n_train, made["data"]["val"] is not None, start, losses, step_seconds,
                     checkpoint, tracked, log_level)
    fit(plan, runner, start)
    if runner.validation is None and runner.validates:  # nothing left to run: the restored weights' validation
        runner.validation = validate(group)
    return runner.validation, runner.checkpoint


@dataclasses.dataclass
class _Driver(Runner):
    """The model-parallel run as `rayhpc.engine.fit` runs it from the driver: a step is every rank's
    `worker.train_step` (each rank takes its batch of the step itself)."""

    cfg: ParallelConfig
    group: WorkerGroup
    recipe: Recipe
    plan: Plan
    n_train: int
    validates: bool
    start: int
    losses: list[float]
    step_seconds: list[float]
    checkpoint: Path | None
    tracked: object
    log_level: int
    validation: dict | None = None

    def __post_init__(self):
        cfg = self.cfg
        self.recorder = MetricsRecorder(cfg.experiment_dir, self.plan.epochs if cfg.epochs else None, self.log_level)
        # the best so far of the task's objective and of val_loss, as every job's rows hold it (a resumed run's
        # from its checkpoint)
        kept = load_progress(self.checkpoint) if self.checkpoint is not None else Progress()
        restored = {"val_loss": kept.best_val_loss, self.recipe.task.objective[0]: kept.best_objective}
        self.best = Best(self.recipe.task.objective, {k: v for k, v in restored.items()
                                                      if v is not None and math.isfinite(v)})

    def batches(self, epoch: int, steps: range):
        return steps  # each rank draws its own

    def step(self, step: int, _batch) -> tuple[float, int]:
        loss, seconds = step_loss(self.group.run(worker.train_step, step))
        self.losses.append(loss)
        self.step_seconds.append(seconds)
        self.tracked.log(step + 1, {"loss": loss, "step_ms": seconds * 1e3})
        cfg = self.cfg
        log.debug(f"step {step + 1}/{cfg.steps}: loss {loss:.5f}  {seconds * 1e3:.1f} ms  "
                  f"{cfg.global_batch / seconds:,.0f} samples/s{self.recipe.tokens(cfg.global_batch / seconds)}")
        return loss, step_samples(cfg, self.n_train, step)

    def mid_epoch(self, step: int, due: Due, window: Window, epoch: Window) -> bool:
        if due.checkpoint:
            self.save(step)
        if due.evaluate:
            metrics = validate(self.group)
            self.tracked.log(step + 1, metrics)
            log.log(self.log_level, f"step {step + 1}: {describe_validation(metrics)}")
        return False  # an epoch's row covers the whole epoch

    def end_epoch(self, epoch: int, window: Window) -> bool:
        step = self.plan.span(epoch).stop - 1
        self.save(step)  # every job's cadence: each epoch's end (the run's last step ends one), and every K
        self.validation = validate(self.group) if self.validates else None
        this_session = step + 1 - max(self.start, step - step % self.plan.per_epoch)  # the epoch's steps run here
        row = epoch_row(self.cfg, self.recipe, self.n_train, step, self.losses, self.step_seconds[-this_session:],
                        self.validation, self.best)
        if self.validation:
            self.tracked.log(step + 1, self.validation)
        self.recorder.record(row)
        return False

    def save(self, step: int) -> None:
        best = self.best.so_far
        progress = Progress(global_step=step + 1, best_val_loss=best.get("val_loss", math.inf),
                            best_objective=best.get(self.recipe.task.objective[0]))
        self.checkpoint = save(self.group, self.cfg, progress, self.losses)
        prune(self.cfg.experiment_dir, self.cfg.checkpoint.keep)


def step_samples(cfg: ParallelConfig, n_train: int, step: int) -> int:
    """Samples of global step `step` on one replica (each replica's DistributedSampler share in batches of
    `replica_batch`, the epoch's last partial)."""
    share = math.ceil(n_train / cfg.parallelism.replicas)
    return min(cfg.replica_batch, share - (step % cfg.steps_per_epoch(n_train)) * cfg.replica_batch)


def epoch_row(cfg: ParallelConfig, recipe: Recipe, n_train: int, step: int, losses: list[float],
              seconds: list[float], validation: dict | None, best: Best) -> dict:
    """The `metrics.parquet` row of the epoch that step `step` (0-based) ends: its steps' loss weighted by
    their samples (the last batch may be partial; a resumed run's restored steps included), this session's
    time of them, the lr of the step."""
    first = step - step % cfg.steps_per_epoch(n_train)
    sizes = [step_samples(cfg, n_train, s) for s in range(first, step + 1)]
    samples = sum(sizes[-len(seconds):]) * cfg.parallelism.replicas
    own_lr = recipe.task.own_optimizer is not None
    return metrics_row("epoch", step // cfg.steps_per_epoch(n_train) + 1, step + 1,
                       sum(loss * n for loss, n in zip(losses[first:step + 1], sizes)) / sum(sizes),
                       samples / sum(seconds), 1e3 * sum(seconds) / len(seconds),
                       (cfg.world_size, cfg.global_batch, cfg.replica_batch),
                       None if own_lr else recipe.optim.lr * lr_factor(recipe.schedule, step, cfg.steps),
                       validation, best)


def validate(group: WorkerGroup) -> dict[str, float]:
    """Validation loss and task metrics: means over every validation sample (each replica scores its share)."""
    replicas = [o for o in group.run(worker.evaluate) if o["sums"] and o["coords"]["tp"] == 0]
    samples = sum(r["samples"] for r in replicas)
    return {name: sum(r["sums"][name] for r in replicas) / samples for name in replicas[0]["sums"]}


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


def save(group: WorkerGroup, cfg: ParallelConfig, progress: Progress, losses: list[float]) -> Path:
    """A sharded checkpoint of the weights after `progress.global_step` steps, the losses so far its extra
    state (`rayhpc.engine.checkpoint.save`, every rank)."""
    path = cfg.experiment_dir / f"checkpoint_{progress.global_step:06d}"
    group.run(worker.save_checkpoint, str(path), progress, {"losses": losses})
    return path


def resume_point(cfg: ParallelConfig) -> tuple[int, list[float], Path | None]:
    """(first step to run, losses so far, checkpoint to load) for a resumed run; (0, [], None) otherwise."""
    latest = latest_checkpoint(cfg.experiment_dir) if cfg.resume else None
    if latest is None:
        return 0, [], None
    return load_progress(latest).global_step, load_extra(latest)["losses"], latest


def format_summary(result: ParallelResult) -> str:
    cfg, losses, seconds = result.cfg, result.losses, sorted(result.step_seconds)
    speed = "no steps left to run"
    if seconds:
        median = seconds[len(seconds) // 2]
        speed = f"median step {median * 1e3:.1f} ms, {cfg.global_batch / median:,.0f} samples/s"
    validation = f"\n{describe_validation(result.validation)}" if result.validation else ""
    return (f"trained {len(losses)} steps: loss {losses[0]:.5f} -> {losses[-1]:.5f}; {speed}; "
            f"start-up {result.start_seconds:.1f} s{validation}\n"
            f"checkpoint: {result.checkpoint}")
