"""Run a data-parallel training job: validate, start (or join) Ray, fit a TorchTrainer."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pandas as pd

from rayhpc import cluster
from rayhpc.config import reconcile_resume
from rayhpc.data import load_dataset
from rayhpc.train.config import TrainConfig
from rayhpc.train.loop import train_loop_per_worker
from rayhpc.train.metrics import METRICS_FILE, MetricsRecorder


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
        """Seconds from fit() to the end of the first optimizer step (worker start-up, placement, rendezvous)."""
        return float(self.metrics["first_step_time"].iloc[0]) - self.fit_started


def run_training(cfg: TrainConfig, *, explicit: set[str] = frozenset(), callbacks: tuple = ()) -> TrainResult:
    """Train (or resume) the run `cfg` describes; every input error is raised before Ray starts.

    `callbacks` are extra `ray.train.UserCallback`s (tests use one to kill a worker).
    """
    cfg = reconcile_resume(cfg, set(explicit))
    dataset = load_dataset(cfg.data)
    address = cluster.resolve_address(cfg.address)
    cluster.check_workers(cluster.probe(address), cfg.num_workers, cfg.cpus_per_worker, cfg.gpu)
    t = time.perf_counter()
    cluster.connect(address)
    ray_seconds = time.perf_counter() - t
    if not (cfg.resume and cfg.saved_file.exists()):
        cfg.save()
    import ray

    trainer = make_trainer(cfg, {"cfg": cfg.model_dump(mode="json"), "dataset": ray.put(dataset)}, callbacks)
    fit_started, started = time.time(), time.perf_counter()
    result = trainer.fit()
    fit_seconds = time.perf_counter() - started
    metrics = pd.read_parquet(cfg.experiment_dir / METRICS_FILE)
    checkpoint = Path(result.checkpoint.path) if result.checkpoint is not None else None
    return TrainResult(cfg, metrics, checkpoint, ray_seconds, fit_started, fit_seconds)


def make_trainer(cfg: TrainConfig, loop_config: dict, callbacks: tuple = (), verbose: bool = True):
    """The TorchTrainer for `cfg`: NCCL on GPUs, gloo on CPUs, checkpoints under the run folder."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    quiet_train_defaults()
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1.0} if cfg.gpu else {})}
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if cfg.gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.gpu,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=cfg.name, storage_path=str(cfg.storage_path.resolve()),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            callbacks=[MetricsRecorder(cfg.experiment_dir, cfg.epochs, verbose), *callbacks],
            # Ray Train logs every report at INFO; the recorder prints one line per epoch instead
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


def format_summary(result: TrainResult) -> str:
    cfg, epochs = result.cfg, result.metrics[result.metrics["kind"] == "epoch"]
    last = epochs.iloc[-1]
    return (f"trained {cfg.strategy} on {cfg.num_workers} worker(s) for {int(last['epoch'])} epochs "
            f"({int(last['global_step'])} steps) in {result.fit_seconds:.1f} s from fit() to done\n"
            f"start-up: Ray {result.ray_seconds:.1f} s, fit() to first step {result.fit_to_first_step:.1f} s\n"
            f"batch: {cfg.global_batch} global = {cfg.per_worker_batch} per worker x {cfg.num_workers} workers; "
            f"lr {cfg.effective_lr:g}{' (scaled by workers)' if cfg.scale_lr else ''}\n"
            f"loss {epochs['loss'].iloc[0]:.4g} -> {last['loss']:.4g}, val_loss {last['val_loss']:.4g} "
            f"(best {last['best_val_loss']:.4g}); {epochs['samples_per_s'].median():,.0f} samples/s "
            f"(median epoch), {epochs['step_ms'].median():.2f} ms/step\n"
            f"checkpoint: {result.checkpoint_dir}\nmetrics: {cfg.experiment_dir / METRICS_FILE}")
