"""Distributed trials on warm worker groups: N workers per trial slot, started once per sweep.

A `TorchTrainer` per trial starts a controller, worker processes that import torch, and a
process group: tens of seconds before the first step, paid by every trial. Here each trial slot
is one Tune trial process that Tune keeps for the whole sweep (`reuse_actors`), and the process
keeps a `WorkerGroup` of N ranks (one gloo or NCCL process group, GPUs pinned for good):

- resources: the trial's placement group has an empty head (the trial process holds nothing)
  and one bundle per worker, so Tune counts every worker's CPUs and GPUs and the group's
  ranks live in the trial's own bundles (`resources`);
- each trial builds its model, optimizer and data shard on the warm ranks with the training
  job's code (`make_worker`: DDP or FSDP2, `DistributedSampler` order, seeded initialisation),
  after dropping the previous trial's state, and runs the training job's epoch (`run_epoch`);
- rank 0's rows come back with the files of each rank's checkpoint folder (`checkpoint.save`, as
  under Ray Train: DDP's `model.pt`, FSDP's DCP shards, every rank's RNG states so that dropout
  after a resume draws what it would have), which the trial process merges into one checkpoint for
  `tune.report`: ASHA, Optuna, `--resume` and requeue see an ordinary function trial;
- Tune's function trials report synchronously: a trial ASHA stops ends inside `tune.report`,
  between two epochs, with the group idle; the next trial on this process takes it as it is;
- a rank that dies fails the group's call (`WorkerGroupError`): the group is started again in
  the same bundles and the trial goes on from its last checkpoint (counted against
  `max_failures`); a trial process that dies is Tune's retry, from the same checkpoint.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import torch

from rayhpc.config import Compute, Optim, Schedule
from rayhpc.engine import checkpoint
from rayhpc.engine.loop import Diverged
from rayhpc.engine.metrics import MetricsRecorder
from rayhpc.task.config import Training
from rayhpc.task.failure import cause_of
from rayhpc.task.hparams import PLATFORM_KEYS
from rayhpc.task.load import LoadedTask
from rayhpc.train.config import TrainConfig
from rayhpc.train.loop import Worker, make_worker, run_epoch
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.trainable import members_of
from rayhpc.workers import WorkerContext, WorkerGroup, WorkerGroupError

log = logging.getLogger(__name__)


def resources(sweep: SweepConfig, gpu: bool):
    """A trial's placement group: an empty head for the trial process, one bundle per worker."""
    from ray.tune import PlacementGroupFactory  # Ray Tune: about 1 s to import, only where a sweep runs

    worker = {"CPU": sweep.cpus_per_trial, **({"GPU": 1.0} if gpu else {})}
    return PlacementGroupFactory([{}] + [worker] * sweep.workers_per_trial)


@dataclasses.dataclass
class Warm:
    """This trial process's group, kept between the trials Tune runs in it."""

    group: WorkerGroup
    start_s: float  # seconds its start took
    trials: int = 0  # trials begun on it


_WARM: Warm | None = None


def _warm_group(sweep: SweepConfig, gpu: bool) -> Warm:
    global _WARM
    if _WARM is None:
        # Ray: only where a cluster is used (config checks and --help stay fast)
        from ray.util import get_current_placement_group

        started = time.perf_counter()
        group = WorkerGroup(sweep.workers_per_trial, cpus_per_worker=sweep.cpus_per_trial,
                            gpus_per_worker=1.0 if gpu else 0.0, placement_group=get_current_placement_group())
        _WARM = Warm(group, time.perf_counter() - started)
    return _WARM


def _drop_group() -> None:
    global _WARM
    if _WARM is not None:
        _WARM.group.shutdown(graceful=False)  # the ranks may be stuck in a collective with a dead one
        _WARM = None


# A trial's latest checkpoint as the trial process holds it: the files of the folder every rank's
# `checkpoint.save` wrote (each its own, merged as Ray Train merges its ranks'), by name
Saved = dict[str, bytes]


def _progress(saved: Saved | None) -> checkpoint.Progress:
    return checkpoint.Progress(**json.loads(saved[checkpoint.PROGRESS_FILE])) if saved else checkpoint.Progress()


def trial_train_config(sweep: SweepConfig, hp: dict, trial_id: str, gpu: bool) -> TrainConfig:
    """The training run of one trial: the sweep's task, data and training section, with the trial's values of
    the hyperparameters that section's fields carry (optimizer, schedule, batch, accumulation, seed) and of
    the task's own."""
    trained = sweep.model_dump(include={"task", "data", *Training.model_fields})
    return TrainConfig(**{
        **trained, "optim": {k: hp[k] for k in Optim.model_fields}, "schedule": {k: hp[k] for k in Schedule.model_fields},
        "global_batch_size": hp["batch_size"], "accumulate": hp["accumulate"], "seed": hp["seed"],
        "hparams": {k: v for k, v in hp.items() if k not in PLATFORM_KEYS},
        "name": f"train-trial_id={trial_id}", "storage_path": sweep.experiment_dir, "strategy": sweep.strategy,
        "compute": Compute(num_workers=sweep.workers_per_trial, cpus_per_worker=sweep.cpus_per_trial, gpu=gpu)})


def train_warm_trial(config: dict, *, task: LoadedTask, packs, sweep: SweepConfig, defaults: dict,
                     gpu: bool) -> None:
    """One Tune trial with `workers_per_trial` workers, on this trial process's warm group."""
    from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

    # Ray Train logs every persisted checkpoint at INFO; a sweep makes one per trial-epoch.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    (member,) = members_of(config, packs)
    hp = {**defaults, **member}
    cfg = trial_train_config(sweep, hp, tune.get_context().get_trial_id(), gpu)
    cfg.make_dir()
    trial = Trial(cfg, task, hp, _load(tune.get_checkpoint()), MetricsRecorder(cfg.experiment_dir, cfg.epochs,
                                                                               logging.DEBUG))
    failures = 0
    while True:
        warm = _warm_group(sweep, gpu)
        try:
            return trial.run(warm)
        except WorkerGroupError as exc:
            _drop_group()
            diverged = [line for line in exc.failed.values()  # "rayhpc.engine.loop.Diverged: the loss ..."
                        if line.partition(": ")[0].rpartition(".")[2] == Diverged.__name__]
            if diverged:  # a retry would diverge alike: the trial ends `diverged`, the sweep goes on
                return trial.diverged(diverged[0])
            failures += 1
            if failures > sweep.max_failures:
                raise
            epoch = _progress(trial.saved).epoch
            cause = f" ({cause_of(exc.failed[min(exc.failed)])})" if exc.failed else ""
            log.warning(f"{cfg.name}: {str(exc).splitlines()[0]}{cause}; starting the worker group again, the trial "
                        f"goes on after epoch {epoch} (failure {failures} of at most {sweep.max_failures})")


@dataclasses.dataclass
class Trial:
    """One trial's run on a warm group; `saved` follows its checkpoints (what a restarted group resumes)."""

    cfg: TrainConfig
    task: LoadedTask
    hp: dict
    saved: Saved | None
    recorder: MetricsRecorder  # the trial's metrics.parquet and TensorBoard, as on the TorchTrainer path
    last: dict = dataclasses.field(default_factory=dict)  # its last report

    def run(self, warm: Warm) -> None:
        import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

        warm.trials += 1
        first = warm.trials == 1
        extra = {"group_trial": warm.trials, "group_start_s": warm.start_s if first else 0.0}
        saved = ray.put(self.saved) if self.saved else None  # one copy, read by every rank
        started = time.perf_counter()
        local = warm.group.run(_setup, self.cfg, self.task, self.hp, [saved])
        (elements, epochs), *_ = local
        extra |= {"setup_s": time.perf_counter() - started, "rank0_param_elements": elements}
        for epoch in range(_progress(self.saved).epoch, epochs):
            by_rank = warm.group.run(_epoch, epoch)
            for reports in zip(*by_rank):  # one report, as every rank saw it
                metrics, files = reports[0]
                merged = {k: v for _, rank_files in reports for k, v in (rank_files or {}).items()}
                self._report({**metrics, **extra}, merged if files is not None else None)

    def diverged(self, line: str) -> None:
        """A rank's loss or val_loss stopped being finite (`line`, its Diverged) in the epoch after the last report:
        the trial reports that epoch as the one it diverged at, its values NaN (no search takes it for a good one),
        and ends; the sweep's table marks it `diverged`, as a packed trial's member."""
        from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

        epoch = int(self.last.get("epoch", _progress(self.saved).epoch)) + 1
        log.warning(f"{self.cfg.name}: {line.partition(': ')[2]} (epoch {epoch})")
        values = {name: math.nan for name, value in {"train_loss": 0.0, "val_loss": 0.0, **self.last}.items()
                  if isinstance(value, float) and (name == "train_loss" or name.startswith(("val_", "best_")))}
        tune.report({**values, "epoch": epoch, "diverged_epoch": epoch})

    def _report(self, metrics: dict, saved: Saved | None) -> None:
        from ray import tune  # Ray: only where a cluster is used (config checks and --help stay fast)

        self.last = metrics
        self.recorder.record(metrics)
        if saved is None:
            tune.report(metrics)
            return
        self.saved = saved
        with tempfile.TemporaryDirectory() as tmp:
            _write(tmp, saved)
            # a trial that ASHA stopped ends in here (SystemExit from Tune), its group idle
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))


def _load(ckpt) -> Saved | None:
    """The checkpoint a resumed or retried trial starts from (None: a fresh trial)."""
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        return _read(d)


def _read(folder: str) -> Saved:
    return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


def _write(folder: str, saved: Saved) -> None:
    for name, data in saved.items():
        (Path(folder) / name).write_bytes(data)


# --- on every rank of the group


class Collected:
    """A rank's reports of one epoch call: (metrics, the files of its checkpoint folder): the metrics on
    rank 0 only, the files only for a report with a checkpoint (`checkpoint.save`, the layout of every job's:
    FSDP's DCP shards, as under Ray Train)."""

    def __init__(self):
        self.reports: list[tuple] = []

    def __call__(self, w: Worker, metrics: dict, with_checkpoint: bool) -> None:
        files = None
        if with_checkpoint:  # a collective where the ranks share the state (RNG, FSDP's shards): every rank
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint.save(tmp, [(w.model, w.optimizer)], w.progress, sharded=w.cfg.strategy == "fsdp",
                                device=w.device, rank=w.rank, world=w.world)
                files = _read(tmp)
        self.reports.append((metrics if w.rank == 0 else None, files))


def _setup(ctx: WorkerContext, cfg: TrainConfig, task: LoadedTask, hp: dict, saved: list) -> tuple[int, int]:
    """Drop the previous trial (model, optimizer, batches), then build this one; restore its state.
    Returns the parameter elements the rank holds, and the epochs the trial runs."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    ctx.state.clear()
    if ctx.device.type == "cuda":
        # a DDP model's reference cycles would keep its GPU memory until Python's collector runs; the
        # full collection costs about 0.15 s a trial, which on CPUs (where memory is plentiful) is
        # most of a warm trial's overhead, so only GPU ranks pay it
        gc.collect()
        torch.cuda.empty_cache()
    (ref,) = saved  # in a list, so that Ray hands the reference over instead of resolving it per call
    saved = ray.get(ref) if ref is not None else None

    def restore(model, optimizer):  # after the model's seeded initialisation: the RNG goes on where it stopped
        if saved is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            _write(tmp, saved)
            return checkpoint.load(tmp, [(model, optimizer)], sharded=cfg.strategy == "fsdp", device=ctx.device,
                                   rank=ctx.rank)[0]

    worker = make_worker(cfg, task, hp, ctx.device, ctx.rank, ctx.world_size, restore)
    worker.sink = ctx.state["sink"] = Collected()
    ctx.state["trial"] = worker
    return _local_elements(worker.model), worker.epochs


def _local_elements(model) -> int:
    """Parameter elements this rank holds: all of them under DDP, its shards under FSDP2."""
    from torch.distributed.tensor import DTensor  # DTensor: about 0.7 s to import, only where a run shards

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _epoch(ctx: WorkerContext, epoch: int) -> list[tuple]:
    sink = ctx.state["sink"]
    sink.reports = []
    run_epoch(ctx.state["trial"], epoch)
    return sink.reports
