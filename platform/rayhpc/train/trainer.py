"""Run a data-parallel training job: validate, start (or join) Ray, fit a TorchTrainer."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import pandas as pd
from ray.train import UserCallback

from rayhpc import interrupt
from rayhpc.config import ConfigError
from rayhpc.engine.checkpoint import checkpoint_config, forget_if_unstarted
from rayhpc.engine.loop import Diverged
from rayhpc.engine.metrics import METRICS_FILE, MetricsRecorder
from rayhpc.job import start_job
from rayhpc.monitor.startup import mark
from rayhpc.task.failure import rank_failure
from rayhpc.train.config import TrainConfig, bind_training, train_hparams
from rayhpc.train.loop import train_loop_per_worker

log = logging.getLogger(__name__)


# fit() to first step: each phase ends at its column's time in the worker group's rows (`rayhpc.train.loop`)
STARTUP_PHASES = {"Ray Train's controller and worker processes": "worker_start_time",
                  "worker set-up (Ray Train, imports)": "process_group_start_time",
                  "process group": "process_group_time",
                  "training function start": "train_fn_time",
                  "device": "device_time",
                  "first collective (slowest rank)": "collective_time",
                  "data and model": "worker_ready_time", "first batch": "first_batch_time",
                  "first step": "first_step_time"}
# what those phases hold on GPUs only (a CPU run's have no CUDA context to make, and gloo no communicator)
ON_GPUS = {"process group": "process group (NCCL)", "device": "device (CUDA context)",
           "first collective (slowest rank)": "first collective (NCCL communicator, slowest rank)"}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    cfg: TrainConfig
    metrics: pd.DataFrame  # metrics.parquet: one row per epoch (and per K steps)
    checkpoint_dir: Path | None  # the latest checkpoint
    ray_seconds: float  # to start (or join) Ray
    fit_started: float  # unix time of TorchTrainer.fit()
    fit_seconds: float

    @property
    def fit_to_first_step(self) -> float:
        """Seconds from fit() to the end of the first optimizer step (worker start-up, placement, rendezvous);
        of this session's first step where the run resumed (the rows before it are an earlier session's), NaN where
        it had no step left to run."""
        times = self.metrics["first_step_time"]
        return float(times[times >= self.fit_started].min()) - self.fit_started

    def startup_phases(self) -> dict[str, float]:
        """fit() to first step, phase by phase (seconds) from the worker group's marks in its first row of this
        session: Ray Train's controller and its worker processes, a worker's set-up (Ray Train's worker, imports),
        its joining the NCCL or gloo process group, Ray Train's call of the training function, its device (on a
        GPU, the CUDA context), the world's first collective (NCCL's communicator; it waits for the slowest rank),
        the task's data and model, the first batch, the first step. Empty for rows without the marks."""
        rows = self.metrics[self.metrics["first_step_time"] >= self.fit_started]
        if rows.empty or not set(STARTUP_PHASES.values()) <= set(rows.columns):
            return {}
        first, before, phases = rows.iloc[0], self.fit_started, {}
        gpus = self.cfg is not None and self.cfg.compute.gpu
        for name, column in STARTUP_PHASES.items():
            at = max(float(first[column]), before)  # a process Ray started before fit() (its idle pool): 0 s
            phases[ON_GPUS.get(name, name) if gpus else name], before = at - before, at
        return phases


def run_training(cfg: TrainConfig, *, explicit: set[str] = frozenset(), callbacks: tuple = (),
                 weights=None) -> TrainResult:
    """Train (or resume) the run `cfg` describes; every input error is raised before Ray starts.

    `callbacks` are extra `ray.train.UserCallback`s (tests use one to kill a worker); `weights`, with
    `init_from`, the sweep trial's it names (`rayhpc.tune.weights.trial_weights`: the command reads them,
    the sweep's folder being the layer above this one).
    """
    if (cfg.init_from is None) != (weights is None):
        raise ConfigError(f"init_from {cfg.init_from!r} with weights {'given' if weights else 'None'}: "
                          "run_training takes a trial's weights with init_from, and only with it")
    job = start_job(cfg, explicit, bind=lambda c, task: bind_training(c, task, weights),
                    workers=lambda c: c.compute.num_workers)
    cfg = job.cfg
    if weights is not None:
        log.info("init: the weights of trial %s (%s)", weights.trial_id, weights.checkpoint)
    hp = train_hparams(cfg, job.task.hp_model)
    trainer = make_trainer(cfg, job.task, hp, callbacks,
                           init=weights.state if weights is not None else None)
    import ray.train  # Ray Train: only where a training run is

    fit_started, started = time.time(), time.perf_counter()
    try:
        result = trainer.fit()
    except SystemExit:
        # Ray Train's own SIGINT handler (installed by fit(), reached by our SIGTERM and SIGUSR1 too)
        # aborts the run, removing its workers and placement group, then exits with status 0: a stop
        raise KeyboardInterrupt from None
    except ray.train.WorkerGroupError as exc:  # a rank failed in the task's code, after the retries it had
        forget_if_unstarted(cfg)
        if diverged := [e for e in exc.worker_failures.values() if isinstance(e, Diverged)]:
            raise diverged[0] from None  # the first rank's that diverged (Ray Train stopped the others)
        # each rank's exception; its frames are in Ray Train's message (one snippet of the ranks' tracebacks)
        failed = {rank: str(error) if "Traceback" in str(error) else
                  f"{str(exc).rstrip().rsplit(chr(10), 1)[0]}\n{type(error).__name__}: {error}"
                  for rank, error in exc.worker_failures.items()}
        raise rank_failure(failed, cfg.experiment_dir, job.task.spec, "the training function") from None
    finally:
        interrupt.install()  # Ray Train's handler stays installed after fit()
    fit_seconds = time.perf_counter() - started
    if cfg.tracking.enabled and cfg.tracking.log_checkpoint != "none" and result.checkpoint is not None:
        upload_weights(cfg, result, job.task, hp)
    metrics = pd.read_parquet(cfg.experiment_dir / METRICS_FILE)
    checkpoint = Path(result.checkpoint.path) if result.checkpoint is not None else None
    done = TrainResult(cfg, metrics, checkpoint, job.ray_seconds, fit_started, fit_seconds)
    at = fit_started
    for name, seconds in done.startup_phases().items():  # RAYHPC_TIMINGS: the start-up benchmarks' marks
        at += seconds
        mark(name, at)
    return done


class RecordReports(UserCallback):
    """Ray Train's reports into the run's metrics record, in Ray Train's controller process (it outlives
    worker-group restarts): rank 0's metrics."""

    def __init__(self, recorder: MetricsRecorder):
        self.recorder = recorder

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        self.recorder.record(metrics[0])


def make_trainer(cfg: TrainConfig, task, hp: dict, callbacks: tuple = (), log_level: int = logging.INFO,
                 init: dict | None = None):
    """The TorchTrainer for `cfg` on `task` with hyperparameters `hp` (and initial weights `init`): NCCL on
    GPUs, gloo on CPUs, checkpoints under the run folder."""
    import ray.train  # Ray Train: only where a training run is
    from ray.train.torch import TorchTrainer

    from rayhpc.train.rendezvous import PrivateRendezvous

    quiet_train_defaults()
    gpu = cfg.compute.gpu
    resources = {"CPU": cfg.compute.cpus_per_worker, **({"GPU": 1.0} if gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        # storage_path absolute: the workers' working folder is Ray's, and rank 0's tracking writes there
        train_loop_config={"cfg": cfg.model_copy(update={"storage_path": cfg.storage_path.resolve()}), "task": task,
                           "hp": hp, "init": init},
        torch_config=PrivateRendezvous(backend="nccl" if gpu else "gloo"),  # no TCPStore another user reaches
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.compute.num_workers, use_gpu=gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=cfg.name, storage_path=str(cfg.storage_path.resolve()),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=checkpoint_config(cfg.checkpoint, task.objective, ray.train.CheckpointConfig),
            callbacks=[RecordReports(MetricsRecorder(cfg.experiment_dir, cfg.epochs, log_level)), *callbacks],
            # Ray Train logs every report at INFO; the recorder logs one line per epoch instead
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )


def quiet_train_defaults() -> None:
    """Ray Train settings (read from the driver's environment) that cut start-up and tail latency.

    Set only where the user has not: the preemption watcher is one more actor
    (one more Python process) per run, watching for cloud-node draining, which
    Slurm preemption handles through the platform's sbatch signal trap instead;
    the controller polls workers every 2 s by default, which adds up to 2 s
    after the last step.
    """
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def _utilisation(epochs: pd.DataFrame) -> str:
    """Model TFLOP/s per worker and MFU (GPUs of known peak), medians over epochs."""
    if "worker_tflops" not in epochs:
        return ""
    mfu = f", MFU {epochs['mfu'].median():.1%}" if "mfu" in epochs else ""
    return f", {epochs['worker_tflops'].median():.3g} model TFLOP/s per worker{mfu}"


def format_summary(result: TrainResult) -> str:
    cfg, epochs = result.cfg, result.metrics[result.metrics["kind"] == "epoch"]
    last = epochs.iloc[-1]
    val = (f", val_loss {last['val_loss']:.4g} (best {last['best_val_loss']:.4g})" if "val_loss" in epochs else "")
    val += "".join(f", {c} {last[c]:.4g}" for c in epochs.columns if c.startswith("val_") and c != "val_loss")
    return (f"trained {cfg.task} with {cfg.strategy} on {cfg.compute.num_workers} worker(s) for {int(last['epoch'])} epochs "
            f"({int(last['global_step'])} steps) in {result.fit_seconds:.1f} s from fit() to done\n"
            f"start-up: Ray {result.ray_seconds:.1f} s, fit() to first step {result.fit_to_first_step:.1f} s"
            + "".join(f"; {name} {seconds:.1f} s" for name, seconds in result.startup_phases().items()) + "\n"
            f"batch: {cfg.global_batch} global = {cfg.per_worker_batch} per worker x {cfg.compute.num_workers} workers; "
            f"lr {cfg.effective_lr:g}{' (scaled by workers)' if cfg.scale_lr else ''}\n"
            f"loss {epochs['loss'].iloc[0]:.4g} -> {last['loss']:.4g}{val}; {epochs['samples_per_s'].median():,.0f} samples/s "
            + (f"({epochs['tokens_per_s'].median():,.0f} tokens/s) " if "tokens_per_s" in epochs else "") +
            f"(median epoch), {epochs['step_ms'].median():.2f} ms/step{_utilisation(epochs)}\n"
            f"checkpoint: {result.checkpoint_dir}\nmetrics: {cfg.experiment_dir / METRICS_FILE}")


def upload_weights(cfg: TrainConfig, result, task, hp: dict) -> None:
    """The run's weights as its tracked run's artifact (`tracking.log_checkpoint`): the last checkpoint's, or
    the kept one's with the best objective, whole (FSDP's shards gathered), as `rayhpc export` writes a trial."""
    import functools
    import tempfile

    from rayhpc.engine.checkpoint import load_full_state_dict, write_export
    from rayhpc.tracking.runs import job_run

    pick, metrics = result.checkpoint, result.metrics or {}
    name, mode = task.objective
    scored = [(c, m) for c, m in (result.best_checkpoints or []) if name in m]
    if cfg.tracking.log_checkpoint == "best" and scored:
        pick, metrics = (min if mode == "min" else max)(scored, key=lambda cm: cm[1][name])
    folder = Path(tempfile.mkdtemp(prefix="rayhpc-artifact-"))  # 0700, an unpredictable name
    write_export(folder, hp, load_full_state_dict(pick.path),
                 {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))})
    with job_run(cfg, hp, "train") as run:  # the run rank 0 wrote, continued for its weights
        run.artifact = functools.partial(Path, folder)
