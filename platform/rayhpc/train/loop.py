"""The per-worker training loop that Ray Train's TorchTrainer runs on every rank, for any task.

Each rank loads the task's data itself (`data(hp)`, then the validation hold-out),
builds the model from the run's seed (the same weights on every rank), wraps it for
DDP or FSDP2, and trains on its `DistributedSampler` shard: the data order of a plain
`torchrun` script with `DistributedSampler(shuffle=True, seed=seed)` and `set_epoch`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import tempfile
import time
import traceback
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from rayhpc.config import Optim, Schedule
from rayhpc.devices import cuda_device
from rayhpc.engine import Module, checkpoint, train_step
from rayhpc.engine.loop import Best, Diverged, Due, Plan, Runner, Window, fit
from rayhpc.engine.metrics import EARLIER_ROWS, metrics_row, report_rows
from rayhpc.engine.parallelize import parallelize
from rayhpc.engine.step import batch_size_of
from rayhpc.monitor.flops import StepFlops, mfu
from rayhpc.monitor.metrics import WorkerMetrics
from rayhpc.monitor.startup import process_start
from rayhpc.precision import autocast, set_matmul_precision
from rayhpc.task.batches import Batches, epoch_steps, eval_batch, evaluate, loader_workers
from rayhpc.task.failure import RankTraceback
from rayhpc.task.load import LoadedTask
from rayhpc.train.config import TrainConfig


@dataclasses.dataclass
class Worker(Runner):
    """One rank's training state."""

    cfg: TrainConfig
    task: LoadedTask
    hp: dict
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train: Batches
    val: Batches | None
    device: torch.device
    rank: int
    world: int
    progress: checkpoint.Progress
    scheduler: object = None  # the task's own LR scheduler, if it has one
    first_step_time: float | None = None  # unix time
    # this worker group's start-up, unix times in every row: its process began (`worker_start_time`), the
    # rank began and ended joining the process group (`process_group_start_time`, `process_group_time`), the
    # training function began (`train_fn_time`), its device was ready (`device_time`: on a GPU, its CUDA context),
    # the world ran its first collective (`collective_time`: NCCL's communicator), data and model were ready
    # (`worker_ready_time`), the first batch came (`first_batch_time`)
    startup: dict = dataclasses.field(default_factory=dict)
    first_batch: int = 0  # samples of the first step (the one whose FLOPs were counted)
    # where reports go: Ray Train's `report` (with a checkpoint) by default; a warm worker group's
    # trial collects them for its Tune trial process instead (`rayhpc.tune.warm`)
    sink: Callable[["Worker", dict, bool], None] | None = None
    tracker: object = None  # a `rayhpc.tracking.runs.JobRun`: rank 0's tracked run where the job has `tracking:`
    reported: float = 0.0  # perf_counter at the end of the last report (train_seconds counts no report's time)
    # step rows held back, sent with the next report that goes to Ray Train: each `ray.train.report` is a barrier
    # of every rank through Ray Train's actors (0.4 s a report on 2 cores, measured); rows go every metrics_send_s
    held: list = dataclasses.field(default_factory=list)
    sent: float = dataclasses.field(default_factory=time.perf_counter)  # when a report last went
    send_due: bool = False  # a rank's rows have waited metrics_send_s or more (agreed in the window's all-reduce)
    resumed: tuple[float, int] = (0.0, 0)  # a run resumed mid-epoch: the epoch's loss sum and samples before it

    def __post_init__(self):
        self.gauges = WorkerMetrics(self.cfg.name, self.rank)  # this rank's Prometheus gauges
        self.flops = StepFlops(enabled=self.cfg.compile == "none")
        # an epoch's steps are the same on every rank (DistributedSampler pads each rank's share to
        # ceil(samples / world)); a checkpoint, and a metrics row, every K steps as the config asks
        self.plan = Plan.of(epoch_steps(len(self.train), self.cfg.per_worker_batch, self.world), self.cfg.epochs,
                            self.cfg.steps, checkpoint_every=self.cfg.checkpoint.every,
                            metrics_every=self.cfg.metrics_every_steps)
        self.trained = Module(self.model, self.optimizer, self.loss, Optim.of(self.hp), Schedule.of(self.hp),
                              self.scheduler)
        restored = {self.task.objective[0]: self.progress.best_objective, "val_loss": self.progress.best_val_loss}
        self.best = Best(self.task.objective, {k: v for k, v in restored.items() if v is not None})
        self.resumed = (self.progress.epoch_loss_sum, self.progress.epoch_samples)

    @property
    def epochs(self) -> int:
        """Epochs to run: `epochs`, or as many as `steps` take (the last one cut short)."""
        return self.plan.epochs

    def loss(self, batch) -> torch.Tensor:
        with autocast(self.cfg.precision, self.device, fsdp=self.cfg.strategy == "fsdp"):
            return self.task.loss(self.model, batch)

    def validate(self) -> dict[str, float]:
        # every rank evaluates the whole split: FSDP's forward is collective anyway
        if self.val is None:
            return {}
        return evaluate(self.task, self.model, self.val.all(eval_batch(self.cfg.per_worker_batch)))

    def report(self, metrics: dict, with_checkpoint: bool, hold: bool = False) -> None:
        """The row to the gauges and the tracker now, and to Ray Train now or (`hold`) with a later report."""
        self.gauges.record(metrics["loss"], metrics["worker_samples_per_s"], metrics["step_ms"] / 1000, self.device,
                           {k: v for k, v in metrics.items() if k.startswith("val_") and k != "val_loss"})
        if self.tracker is not None:  # queued: the tracker's thread writes it
            self.tracker.log(self.progress.global_step, {k: v for k, v in metrics.items() if k not in ("epoch", "kind")})
        if hold:
            self.held.append(metrics)
        else:
            metrics, self.held = ({**metrics, EARLIER_ROWS: self.held} if self.held else metrics), []
            (self.sink or _ray_train_report)(self, metrics, with_checkpoint)
            self.sent = time.perf_counter()
        self.reported = time.perf_counter()

    # `rayhpc.engine.fit`'s runner: this rank's batches and step, its reports through `report`

    def batches(self, epoch: int, steps: range):
        return self.train.steps(self.cfg.seed, epoch, steps, self.plan.per_epoch, self.cfg.per_worker_batch,
                                self.rank, self.world)

    def step(self, step: int, batch) -> tuple[torch.Tensor, int]:
        came = time.time()
        with self.flops.once():  # the FLOPs of one step, counted on the first (for MFU)
            loss = train_step(self.trained, batch, self.cfg.accumulate, step, self.plan.total)
        if self.first_step_time is None:  # when training really began in this worker group (start-up benchmarks)
            self.first_step_time, self.first_batch = time.time(), batch_size_of(batch)
            self.startup["first_batch_time"] = came
        p = self.progress
        p.step_in_epoch, p.global_step = step % self.plan.per_epoch + 1, step + 1
        return loss, batch_size_of(batch)

    def mid_epoch(self, step: int, due: Due, window: Window, epoch: Window) -> bool:
        if not (due.checkpoint or due.metrics):
            return False
        if due.checkpoint:  # where the epoch stands, for a resume: its loss so far
            loss_sum, samples = _summed(self, epoch)
            self.progress.epoch_loss_sum, self.progress.epoch_samples = (self.resumed[0] + loss_sum,
                                                                         self.resumed[1] + int(samples))
        row = metrics_row("step", step // self.plan.per_epoch + 1, self.progress.global_step, **_rates(self, window))
        self.report(row, due.checkpoint, hold=not (due.checkpoint or self.send_due))
        return True

    def end_epoch(self, epoch: int, window: Window) -> bool:
        measured = _rates(self, window, self.resumed)  # before the validation: its time is not the epoch's
        row = metrics_row("epoch", epoch + 1, self.progress.global_step, **measured, values=self.validate(),
                          best=self.best)
        p, so_far, objective = self.progress, self.best.so_far, self.task.objective[0]  # kept for a resume
        p.best_val_loss = so_far.get("val_loss", math.inf)
        p.best_objective = so_far.get(objective) if objective != "val_loss" else None
        p.epoch, p.step_in_epoch = epoch + 1, 0
        self.resumed, p.epoch_loss_sum, p.epoch_samples = (0.0, 0), 0.0, 0
        self.report(row, with_checkpoint=True)
        return False


def _ray_train_report(w: Worker, metrics: dict, with_checkpoint: bool) -> None:
    """`ray.train.report`, with a checkpoint of every rank's state (each writes its own folder, which Ray
    Train merges; rank 0's holds the rows the report carries)."""
    import ray.train  # Ray Train: only where a training run is

    if not with_checkpoint:
        return ray.train.report(metrics)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save(tmp, [(w.model, w.optimizer)], w.progress, sharded=w.cfg.strategy == "fsdp",
                        device=w.device, rank=w.rank, world=w.world, extra={"rows": report_rows(metrics)})
        has_files = w.cfg.strategy == "fsdp" or w.rank == 0
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp) if has_files else None)


def _restore(ckpt, cfg: TrainConfig, model, optimizer, device: torch.device, rank: int):
    """The Progress of Ray Train's checkpoint `ckpt`, its state loaded into `model`, `optimizer` and this
    rank's RNG (None: nothing to restore)."""
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        return checkpoint.load(d, [(model, optimizer)], sharded=cfg.strategy == "fsdp", device=device,
                               rank=rank)[0]


def make_worker(cfg: TrainConfig, task: LoadedTask, hp: dict, device: torch.device, rank: int, world: int,
                restore: Callable, init: dict | None = None) -> Worker:
    """One rank's training state in a process group that is up: the task's data split, the model
    from the trial's seed (or with the weights `init`) wrapped for `cfg.strategy`, its optimizer, and
    `restore(model, optimizer)`'s Progress (None: a fresh start)."""
    torch.set_num_threads(max(1, int(cfg.compute.cpus_per_worker)))
    set_matmul_precision(cfg.precision)
    train, val = task.split_data(hp, cfg.data)  # before seeding the model: data() may draw
    model = task.initial_model(hp)
    if init is not None:  # whole, before sharding: FSDP2 then shards these weights
        model.load_state_dict(init)
    model = parallelize(model, task.obj, cfg, cfg.strategy, device, bf16=cfg.use_bf16)
    optimizer = task.optimizer(model.parameters(), hp)
    progress = restore(model, optimizer) or checkpoint.Progress()
    workers = loader_workers(device, cfg.compute.cpus_per_worker)
    return Worker(cfg, task, hp, model, optimizer, Batches(train, device, workers),
                  Batches(val, device, workers) if val is not None else None, device, rank, world, progress,
                  task.scheduler(optimizer, hp, progress.global_step))


def train_loop_per_worker(config: dict) -> None:
    """Entry point for `TorchTrainer(train_loop_per_worker, train_loop_config={"cfg", "task", "hp"})`:
    the validated config, the task and its hyperparameters, from the driver."""
    try:
        _train_rank(config, time.time())
    except Diverged:  # the job's own error, one line (a rank whose loss is finite meanwhile is stopped by Ray Train)
        raise
    except Exception:  # noqa: BLE001 - re-raised, with its traceback
        # Ray Train hands the driver a rank's exception without its traceback (`WorkerGroupError.worker_failures`),
        # its frames only in a 1,000-character snippet of every rank's: the whole traceback goes as the message
        raise RankTraceback(traceback.format_exc()) from None


def _train_rank(config: dict, entered: float) -> None:
    import ray.train  # Ray Train: only where a training run is
    from ray.train.torch import get_device

    from rayhpc.train.rendezvous import joined  # Ray Train's torch backend: only in a Ray Train worker

    _quiet_report_logs()
    cfg, task, hp = config["cfg"], config["task"], config["hp"]
    ctx = ray.train.get_context()
    if ctx.get_world_rank() != 0:  # torch's warning of a model's sharded module, once a run rather than once a rank
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # Ray Train's get_device() is the CPU where torch cannot use the GPU Ray gave: refuse that instead
    device = cuda_device(f"rank {ctx.get_world_rank()}") if ray.get_gpu_ids() else get_device()
    device_ready, first_collective = _open_device_and_world(device)
    ckpt = ray.train.get_checkpoint()
    worker = make_worker(cfg, task, hp, device, ctx.get_world_rank(), ctx.get_world_size(),
                         lambda model, optimizer: _restore(ckpt, cfg, model, optimizer, device, ctx.get_world_rank()),
                         config.get("init"))
    if ckpt is not None and worker.rank == 0:
        # the rows the checkpoint's report carried go again with this session's first report: Ray Train registers
        # a checkpoint (pruning the one before) before the recorder sees its report, so a driver killed in
        # between leaves them only in the checkpoint (`rayhpc.engine.metrics.MetricsRecorder` replaces, not repeats)
        with ckpt.as_directory() as d:
            worker.held = list((checkpoint.load_extra(d) or {}).get("rows", []))
    began, ended = joined() or (entered, entered)  # the world as the rank joined it (`PrivateRendezvous`)
    worker.startup = {"worker_start_time": process_start(), "process_group_start_time": began,
                      "process_group_time": ended, "train_fn_time": entered, "device_time": device_ready,
                      "collective_time": first_collective, "worker_ready_time": time.time()}
    with _tracked(worker) as run:
        worker.tracker = run
        fit(worker.plan, worker, worker.progress.global_step)


def _open_device_and_world(device: torch.device) -> tuple[float, float]:
    """Unix times when the rank's device was ready and when the world had run its first collective: each cost
    of a GPU's start-up timed on its own rather than inside the model's first tensors and DDP's first broadcast.
    On a GPU the CUDA context is made here (torch makes it at the first tensor there); NCCL makes its communicator
    at the first collective, not at `init_process_group`, and that collective also waits for the slowest rank."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    ready = time.time()
    if dist.is_initialized():
        dist.all_reduce(torch.zeros(1, device=device))
    return ready, time.time()


def _tracked(w: Worker):
    """Rank 0's tracked run (`tracking:`; a restarted group's rank 0 continues it); other ranks track nothing."""
    from rayhpc.tracking.runs import JobRun, job_run

    if w.rank != 0 or not w.cfg.tracking.enabled:
        return JobRun(None, w.cfg.name, {}, {})
    return job_run(w.cfg, {**w.hp, "strategy": w.cfg.strategy, "num_workers": w.world}, "train")


def _quiet_report_logs() -> None:
    """Silence Ray Train's per-report INFO line on workers (one per rank per report), and its traceback lines.

    Ray 2.60 names that logger after its file path (`logging.getLogger(__file__)`),
    so `LoggingConfig(log_level=...)`, which filters `ray.train.*`, misses it.
    """
    import ray.train  # Ray Train: only where a training run is

    path = os.path.join(os.path.dirname(ray.train.__file__), "v2", "_internal", "execution", "context.py")
    logging.getLogger(path).setLevel(logging.WARNING)
    # and its ERROR line with a failed rank's traceback (a private module's logger, which no config reaches):
    # the driver writes every rank's to the run's error.log and prints one line (`rayhpc.task.failure`)
    logging.getLogger("ray.train.v2._internal.util").setLevel(logging.CRITICAL)


def run_epoch(w: Worker, epoch: int) -> None:
    """Train one epoch (or its remainder after a restore) and report it with a checkpoint (a warm group's
    trials, asked epoch by epoch)."""
    fit(w.plan, w, w.progress.global_step, w.plan.span(epoch).stop)


def _summed(w: Worker, win: Window) -> tuple[float, float]:
    """`win`'s loss sum and samples over all ranks (the one host-device sync of the window); with them the ranks
    agree whether held rows are due to be sent (`send_due`: all ranks send a report, or none)."""
    loss_sum = torch.as_tensor(win.loss_sum, dtype=torch.float32, device=w.device)  # 0.0 where no step ran
    waited = float(time.perf_counter() - w.sent >= w.cfg.metrics_send_s)
    totals = torch.stack([loss_sum, torch.tensor(float(win.samples), device=w.device),
                          torch.tensor(waited, device=w.device)])
    if dist.is_initialized() and w.world > 1:
        dist.all_reduce(totals)
    loss_sum, samples, waited = totals.tolist()
    w.send_due = waited > 0
    return loss_sum, samples


def _rates(w: Worker, win: Window, before: tuple[float, int] = (0.0, 0)) -> dict:
    """What a row of `win` measured, over all ranks (`metrics_row`'s arguments and this job's own columns); the
    loss counts `before` too (an epoch's steps before a resume: their loss sum and samples)."""
    if w.device.type == "cuda":
        torch.cuda.synchronize()
    now = time.perf_counter()
    seconds = now - win.started
    # an epoch's window began before its mid-epoch reports; the time between epochs (validation) is not training
    w.progress.train_seconds += now - max(win.started, w.reported)
    loss_sum, samples = _summed(w, win)
    all_per_s = samples / seconds if seconds > 0 else 0.0
    per_s = win.samples / seconds if seconds > 0 else 0.0  # this rank's
    return {
        "loss": (loss_sum + before[0]) / max(samples + before[1], 1),
        "samples_per_s": all_per_s,
        "step_ms": 1000 * seconds / max(win.steps, 1),
        "batch": (w.world, w.cfg.global_batch, w.cfg.per_worker_batch),
        "lr": w.optimizer.param_groups[0]["lr"],  # of the last step (the schedule's)
        "worker_samples_per_s": per_s,
        "data_wait_share": win.data_seconds / seconds if seconds > 0 else 0.0,  # of the time, waiting for batches
        **_tokens(w, all_per_s),
        **_utilisation(w, per_s),
        "train_seconds": w.progress.train_seconds,
        "node": socket.gethostname(),
        "first_step_time": w.first_step_time,
        **w.startup,
    }


def _tokens(w: Worker, samples_per_s: float) -> dict:
    """tokens/s for a task that says how many tokens a sample holds (`tokens_per_sample(hp)`)."""
    per_sample = w.task.tokens_per_sample(w.hp)
    return {"tokens_per_s": samples_per_s * per_sample} if per_sample else {}


def _utilisation(w: Worker, samples_per_s: float) -> dict:
    """This rank's model TFLOP/s and, on a GPU of known peak, its MFU."""
    if not w.flops.flops:
        return {}
    flops_per_s = samples_per_s * w.flops.flops / w.first_batch
    share = mfu(flops_per_s, w.device, w.cfg.use_bf16, w.flops.conv_flops / w.flops.flops)
    return {"worker_tflops": flops_per_s / 1e12, **({"mfu": share} if share is not None else {})}
