"""Run a parameter-server job: validate, start (or join) Ray, start S servers and N workers, supervise.

The driver hands each worker one epoch at a time (`run_epoch`), so workers run on their own (async
workers never wait for each other beyond the staleness bound) and the driver sees every failure:
- a dead worker is replaced by a new one that continues at the first step it had not pushed to every
  server; servers ignore pushes they already have, so a sync step the dead worker left half-done is
  simply redone, and the run ends as an uninterrupted one;
- a dead server: every actor goes, the servers restart from the latest complete checkpoint (each
  server's shard, optimizer state and push counts) and the workers from that checkpoint's step.
Checkpoints are written by the servers themselves when every worker has pushed a checkpoint step (each
epoch's end, and every `checkpoint.every`); a checkpoint is complete when all S shards are there, and the
driver then writes its progress file, the mark of a complete checkpoint in every job.
In async mode a shard saved at step k may hold updates of faster workers beyond k, which the resumed
workers (all restarting at k) compute again: async SGD tolerates that, and it is what Downpour does.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import ray
import torch

from rayhpc import cluster, interrupt
from rayhpc.config import ConfigError, Optim, Schedule
from rayhpc.engine.loop import Diverged
from rayhpc.engine.metrics import METRICS_FILE
from rayhpc.job import start_job
from rayhpc.optim import step_plan
from rayhpc.ps import shards
from rayhpc.ps.config import PSConfig
from rayhpc.ps.progress import Progress, checkpoint_step, checkpoint_steps, epoch_loss, latest_checkpoint
from rayhpc.ps.server import ParameterServer
from rayhpc.ps.worker import PSEvaluator, PSWorker, weights
from rayhpc.task.batches import epoch_steps
from rayhpc.task.failure import cause_of, plain, rank_failure
from rayhpc.tracking.runs import job_run
from rayhpc.train.config import bind_train

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PSResult:
    cfg: PSConfig
    metrics: pd.DataFrame  # metrics.parquet: one row per epoch
    steps: pd.DataFrame  # steps.parquet: one row per worker step (staleness, pull/push times, bytes)
    weights: dict[str, torch.Tensor]  # the final parameters, gathered from the servers
    layout: shards.Layout
    failures: list[str]  # what died and what was done about it
    checkpoint: Path | None


@dataclasses.dataclass
class Fleet:
    """The running actors of one attempt."""

    servers: list
    workers: list
    calls: dict  # object ref of a worker's running `run_epoch` -> worker index
    evaluator: object = None
    evals: dict = dataclasses.field(default_factory=dict)  # object ref of a validation -> epoch
    eval_queue: collections.deque = dataclasses.field(default_factory=collections.deque)  # epochs not yet asked


def run_ps(cfg: PSConfig, *, explicit: set[str] = frozenset(),
           on_epoch: Callable[[int, int, Fleet], None] | None = None, log_level: int = logging.INFO) -> PSResult:
    """Train (or resume) the run `cfg` describes; every input error is raised before Ray starts.
    `on_epoch(worker, epoch, fleet)`: called as each worker finishes an epoch (tests kill actors from it)."""
    made: dict = {}

    def bind(c: PSConfig, task):
        c, hp = bind_train(c, task)
        made.update(plan_run(c, task, hp))
        return c, hp

    job = start_job(cfg, explicit, bind=bind, workers=lambda c: c.compute.num_workers)
    cfg, task = job.cfg, job.task
    made["resources"] = fleet_resources(cfg, job.resources)
    say = functools.partial(log.log, log_level)
    run = Progress(cfg, made, started=time.time(), objective=task.objective)
    failures: list[str] = []
    checkpoint = latest_checkpoint(cfg) if cfg.resume else None
    if checkpoint is not None:
        say(f"resuming from {checkpoint}")
    fleet = start_fleet(cfg, task, made, run, checkpoint)
    say(describe(cfg, made))
    params = {**made["hp"], "mode": cfg.mode, "num_workers": cfg.compute.num_workers,
              "num_servers": cfg.compute.num_servers}
    try:
        with job_run(cfg, params, "ps") as tracked:
            run.track = tracked.log
            while fleet.calls or fleet.evals:
                # a stop signal's KeyboardInterrupt raised while Ray held the main thread can be lost there (seen
                # once on a loaded node: the run went on to the forced end); the signal is remembered, so stop here
                if interrupt.received():
                    raise KeyboardInterrupt
                fleet = supervise(cfg, task, made, run, fleet, failures, on_epoch, say)
        final = weights(made["layout"], fleet.servers)
    finally:
        stop_fleet(fleet)
    return PSResult(cfg, run.table(), run.steps_table(), final, made["layout"], failures,
                    latest_checkpoint(cfg))


def plan_run(cfg: PSConfig, task, hp: dict) -> dict:
    """The initial parameters, their layout over the servers and the steps per epoch (checked before Ray
    starts: more servers than parameter elements is bad input, and so is a task's own optimizer)."""
    if own := task.own_optimizer:
        raise ConfigError(f"{task.where()}: brings its own {own}; the parameter server's shards each step the "
                          "optimizer --optimizer names (train_mlp.py and train_parallel.py take a task's own)")
    model = task.initial_model(hp)
    params = {name: p.detach() for name, p in model.named_parameters()}
    layout = shards.plan({name: tuple(p.shape) for name, p in params.items()}, cfg.compute.num_servers)
    train, val = task.split_data(hp, cfg.data)
    n = math.ceil(len(train) / cfg.compute.num_workers)  # each worker's share (DistributedSampler's)
    per_epoch = epoch_steps(len(train), cfg.per_worker_batch, cfg.compute.num_workers)
    total, epochs = step_plan(per_epoch, cfg.epochs, cfg.steps)
    return {"hp": hp, "layout": layout, "initial": [f.numpy() for f in layout.flatten(params)],
            "steps_per_epoch": per_epoch, "total_steps": total, "epochs": epochs, "shard_len": n,
            "validates": val is not None and len(val) > 0}


def fleet_resources(cfg: PSConfig, res: cluster.Resources) -> dict[str, dict]:
    """Ray resources of each server, each worker and the evaluator. With `gpu` a worker takes a whole GPU;
    the evaluator takes a sliver of one only where the workers leave a GPU free: on a node whose every
    GPU a worker holds, a sliver would never place (whole-GPU requests leave no fraction behind), so
    it validates on the CPU there."""
    gpu = cfg.compute.gpu
    spare = gpu and res.gpus - cfg.compute.num_workers >= EVALUATOR_GPU
    return {"server": {"num_cpus": cfg.compute.cpus_per_server, "num_gpus": 0},
            "worker": {"num_cpus": cfg.compute.cpus_per_worker, "num_gpus": 1 if gpu else 0},
            "evaluator": {"num_cpus": 0, "num_gpus": EVALUATOR_GPU if spare else 0}}


EVALUATOR_GPU = 0.01  # of a GPU the workers leave free: its CUDA context and one model


def describe(cfg: PSConfig, made: dict) -> str:
    sizes = made["layout"].sizes()
    staleness = "" if cfg.mode == "sync" else f", staleness {'unbounded' if cfg.staleness is None else cfg.staleness}"
    return (f"parameter server ({cfg.mode}{staleness}): {cfg.compute.num_workers} workers of "
            f"{cfg.compute.cpus_per_worker:g} CPU{' + 1 GPU' if cfg.compute.gpu else ''}, {cfg.compute.num_servers} "
            f"server(s) holding {' + '.join(f'{n:,}' for n in sizes)} parameters ({sum(sizes) * 4 / 1e6:.3f} MB in "
            f"fp32), workers in {cfg.precision}; {made['steps_per_epoch']} steps per epoch of {cfg.global_batch} "
            f"samples; per step each worker moves 2 x {sum(sizes) * 4 / 1e6:.3f} MB (pull + push)"
            + ("" if not cfg.compute.gpu or made["resources"]["evaluator"]["num_gpus"] else
               "; validation on the CPU (the workers hold every GPU)"))


def start_fleet(cfg: PSConfig, task, made: dict, run: Progress, checkpoint: Path | None) -> Fleet:
    """Servers (restored from `checkpoint`, or with the initial parameters), then workers, each given
    its first epoch from the checkpoint's step."""
    step = checkpoint_step(checkpoint)
    run.restart_at(step, epoch_loss(checkpoint))
    per_epoch, total = made["steps_per_epoch"], made["total_steps"]
    ends = [run.end_of(e) for e in range(made["epochs"])]
    server_cls = ray.remote(ParameterServer).options(**made["resources"]["server"])
    layout = made["layout"]
    holds = [{"pieces": [(p.name, p.start, p.stop) for p in pieces], "shapes": layout.shapes}
             for pieces in layout.servers]
    stepping = Optim.of(made["hp"]), Schedule.of(made["hp"])  # the run's values (its lr scaled where it asks)
    servers = [server_cls.remote(j, made["initial"][j], holds[j], *stepping, cfg.compute.num_workers, cfg.mode,
                                 cfg.staleness, cfg.name, total, checkpoint_steps(cfg, per_epoch, total),
                                 ends if made["validates"] else [],
                                 str(cfg.experiment_dir), str(checkpoint) if checkpoint else None, per_epoch)
               for j in range(cfg.compute.num_servers)]
    ray.get([server.set_peers.remote(servers) for server in servers])  # sync clipping adds their norms
    fleet = Fleet(servers, [None] * cfg.compute.num_workers, {})
    if made["validates"]:  # the validations of the epochs still to end: each waits for its epoch
        where = made["resources"]["evaluator"]
        fleet.evaluator = ray.remote(PSEvaluator).options(**where).remote(
            cfg, task, made["hp"], made["layout"], servers, "cuda" if where["num_gpus"] else "cpu")
        fleet.eval_queue.extend(run.validations_due(step))
        for _ in range(EVALS_AHEAD):
            ask_validation(fleet, run)
    if step < total:
        for w in range(cfg.compute.num_workers):
            start_worker(cfg, task, made, run, fleet, w, step)
    return fleet


# validations asked of the evaluator ahead of time (the rest wait in the driver): enough to keep it busy,
# few enough that a long run does not hold a call per epoch (each a task the driver owns until it ends)
EVALS_AHEAD = 2


def ask_validation(fleet: Fleet, run: Progress) -> None:
    """The evaluator's next validation: of the next epoch in the queue, once the servers reach its end."""
    if fleet.eval_queue:
        epoch = fleet.eval_queue.popleft()
        fleet.evals[fleet.evaluator.evaluate.remote(epoch, run.end_of(epoch))] = epoch


def start_worker(cfg: PSConfig, task, made: dict, run: Progress, fleet: Fleet, w: int, step: int) -> None:
    """Worker `w` (new), running from global step `step` to the end of that step's epoch."""
    # two threads: `info()` answers while `run_epoch` runs (the driver gives each worker one epoch at a time)
    cls = ray.remote(PSWorker).options(**made["resources"]["worker"], max_concurrency=2)
    fleet.workers[w] = cls.remote(w, cfg.compute.num_workers, cfg, task, made["hp"], made["layout"], fleet.servers,
                                  "cuda" if cfg.compute.gpu else "cpu")
    epoch = step // made["steps_per_epoch"]
    fleet.calls[fleet.workers[w].run_epoch.remote(epoch, step, run.end_of(epoch))] = w


def supervise(cfg: PSConfig, task, made: dict, run: Progress, fleet: Fleet, failures: list[str], on_epoch,
              say) -> Fleet:
    """Wait for the next worker to finish an epoch (give it the next) or to fail (replace it, or restart
    from the checkpoint if a server is gone); the fleet to go on with."""
    done, _ = ray.wait([*fleet.calls, *fleet.evals], num_returns=1, timeout=cfg.timeout_s + 30)
    if not done:
        raise RuntimeError(f"no worker finished an epoch or failed within {cfg.timeout_s + 30:g} s (timeout_s)")
    if done[0] in fleet.evals:
        return validated(cfg, task, made, run, fleet, failures, done[0], say)
    w = fleet.calls.pop(done[0])
    try:
        result = ray.get(done[0])
    except ray.exceptions.RayError as exc:
        return recover(cfg, task, made, run, fleet, failures, w, exc, say)
    run.add(result)
    run.prune()
    if (epoch := result["epoch"] + 1) < made["epochs"]:
        fleet.calls[fleet.workers[w].run_epoch.remote(epoch, run.end_of(epoch - 1), run.end_of(epoch))] = w
    if on_epoch is not None:
        on_epoch(w, result["epoch"], fleet)
    return fleet


def validated(cfg: PSConfig, task, made: dict, run: Progress, fleet: Fleet, failures: list[str], ref,
              say) -> Fleet:
    """An epoch's validation is back (or failed: the evaluator reads the servers, so a failure there is a
    server's; restart from the checkpoint)."""
    fleet.evals.pop(ref)
    try:
        run.add(ray.get(ref))
    except ray.exceptions.RayError as exc:
        return recover(cfg, task, made, run, fleet, failures, None, exc, say)
    ask_validation(fleet, run)
    return fleet


def recover(cfg: PSConfig, task, made: dict, run: Progress, fleet: Fleet, failures: list[str], w: int,
            exc: BaseException, say) -> Fleet:
    """After worker `w`'s call (or the evaluator's, `w` None) failed: replace the worker if every server
    is alive, else restart everything from the checkpoint."""
    trace = plain(str(exc))  # a task's error: the worker's traceback, its last line the cause
    what = cause_of(trace) or type(exc).__name__
    # a worker's loss that stopped being finite ends the run: a replaced worker would repeat it
    diverged = exc.cause if isinstance(getattr(exc, "cause", None), Diverged) else None
    if len(failures) >= cfg.max_failures or diverged is not None:
        stop_fleet(fleet)
        who = "the evaluator" if w is None else f"worker {w}"
        if latest_checkpoint(cfg) is None:  # nothing to resume: the same command starts it again
            cfg.saved_file.unlink(missing_ok=True)
        if diverged is not None:
            raise Diverged(f"{who}: {diverged}") from None
        raise rank_failure({0: trace}, cfg.experiment_dir, task.spec, "the worker",
                           lambda _: f"{who}, after {len(failures)} recoveries (max_failures {cfg.max_failures}),",
                           "its traceback") from None
    dead = dead_servers(fleet.servers)
    if dead or w is None:
        stop_fleet(fleet)
        checkpoint = latest_checkpoint(cfg)
        failures.append(f"server(s) {dead or '?'} died; restarted every server and worker from "
                        f"{checkpoint.name if checkpoint else 'the start'}")
        say(failures[-1])
        return start_fleet(cfg, task, made, run, checkpoint)
    step = min(min(info["pushed"][w] for info in ray.get([s.info.remote() for s in fleet.servers])),
               made["total_steps"])
    ray.kill(fleet.workers[w])
    b, n, per_epoch = cfg.per_worker_batch, made["shard_len"], made["steps_per_epoch"]
    lost = run.mark_lost(w, step, lambda s: min(b, n - (s % per_epoch) * b))
    failures.append(f"worker {w} failed ({what}); replaced, continuing at step {step}"
                    + (f" ({len(lost)} pushed steps' records lost with it)" if lost else ""))
    say(failures[-1])
    if step < made["total_steps"]:
        start_worker(cfg, task, made, run, fleet, w, step)
    return fleet


def dead_servers(servers: list) -> list[int]:
    dead = []
    for j, server in enumerate(servers):
        try:
            ray.get(server.info.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            dead.append(j)
    return dead


def stop_fleet(fleet: Fleet) -> None:
    for actor in [*fleet.workers, *fleet.servers, fleet.evaluator]:
        if actor is not None:
            ray.kill(actor)
    fleet.calls.clear()
    fleet.evals.clear()
    fleet.eval_queue.clear()


def format_summary(result: PSResult) -> str:
    cfg, epochs = result.cfg, result.metrics
    last = epochs.iloc[-1]
    val = f", val_loss {last['val_loss']:.4g} (best {last['best_val_loss']:.4g})" if "val_loss" in epochs else ""
    staleness = result.steps["staleness"] if len(result.steps) else pd.Series([0])
    failures = "".join(f"\nrecovered: {f}" for f in result.failures)
    return (f"trained {cfg.task} with a {cfg.mode} parameter server: {cfg.compute.num_workers} workers, "
            f"{cfg.compute.num_servers} server(s), {int(last['epoch'])} epochs ({int(last['global_step'])} steps) "
            f"in {last['train_seconds']:.1f} s\nloss {epochs['loss'].iloc[0]:.4g} -> {last['loss']:.4g}{val}; "
            f"{epochs['samples_per_s'].median():,.0f} samples/s (median epoch); per step: pull "
            f"{epochs['pull_ms'].median():.2f} ms, compute {epochs['compute_ms'].median():.2f} ms, push "
            f"{epochs['push_ms'].median():.2f} ms, {epochs['bytes_per_step'].median() / 1e6:.3f} MB moved per worker"
            f"\nstaleness (steps ahead of the slowest worker): max {int(staleness.max())}, mean "
            f"{staleness.mean():.2f}{failures}\ncheckpoint: {result.checkpoint}\n"
            f"metrics: {cfg.experiment_dir / METRICS_FILE}, steps: {cfg.experiment_dir / 'steps.parquet'}")
