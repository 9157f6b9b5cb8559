"""The data-parallel training job's config tree (flags are derived from it in `rayhpc.cli`)."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rayhpc.config import (
    Compute,
    ConfigError,
    StepCheckpoints,
)
from rayhpc.task.config import TrainingJob
from rayhpc.task.hparams import PLATFORM_KEYS, TRAINING_KEYS, full_hparams, task_keys

PLATFORM_FLAGS = {"batch_size": "--global-batch-size", "seed": "--seed",
                  **{key: "--" + key.replace("_", "-") for key in TRAINING_KEYS}}


class DataParallelJob(TrainingJob):
    """What every job whose workers each train on their own share of the data has: workers, and the batch as
    the global batch (the training section's) or per worker."""

    compute: Compute = Compute()
    batch_size_per_worker: int | None = Field(None, ge=1, description="samples per step on each worker, instead "
                                              "of global_batch_size (which it then is, times num_workers)")

    @model_validator(mode="before")
    @classmethod
    def _global_from_per_worker(cls, data: Any) -> Any:
        """A batch given per worker sets the global batch (times the workers), so the config holds both, agreeing:
        a saved config reloads as it was."""
        if not isinstance(data, dict) or data.get("batch_size_per_worker") is None:
            return data
        compute = data.get("compute", cls.model_fields["compute"].default)
        default = cls.model_fields["compute"].default.num_workers
        workers = compute.get("num_workers", default) if isinstance(compute, dict) else compute.num_workers
        try:  # flags come as text ("32"), YAML and code as numbers
            implied = int(data["batch_size_per_worker"]) * int(workers)
            given = None if data.get("global_batch_size") is None else int(data["global_batch_size"])
        except (TypeError, ValueError):
            return data  # the fields' own checks name the value
        if given not in (None, implied):
            raise ConfigError(f"global_batch_size (--global-batch-size) {data['global_batch_size']} and "
                              f"batch_size_per_worker (--batch-size-per-worker) {data['batch_size_per_worker']}, "
                              f"which is a global batch of {implied} on {workers} workers: give one, not both")
        return {**data, "global_batch_size": implied}

    @model_validator(mode="after")
    def _batch(self) -> "DataParallelJob":
        if self.global_batch_size % self.compute.num_workers:
            given = "global_batch_size" in self.model_fields_set
            raise ConfigError(f"global_batch_size (--global-batch-size) {self.global_batch_size}"
                              f"{'' if given else ' (the default)'}: not divisible by compute.num_workers "
                              f"(--num-workers) {self.compute.num_workers}; give a multiple, or "
                              "--batch-size-per-worker")
        if self.per_worker_batch % self.accumulate:
            raise ConfigError(f"accumulate (--accumulate) {self.accumulate}: does not divide the batch per worker "
                              f"{self.per_worker_batch} (global {self.global_batch} over {self.compute.num_workers} "
                              "workers) into equal micro-batches")
        return self

    @property
    def per_worker_batch(self) -> int:
        return self.global_batch_size // self.compute.num_workers

    @property
    def global_batch(self) -> int:
        return self.global_batch_size

    @property
    def effective_lr(self) -> float:
        return self.optim.lr


class TrainCheckpoints(StepCheckpoints):
    """A training run's checkpoints, which may also be kept by score."""

    keep_best: int | None = Field(None, ge=1, description="keep the K epoch-end checkpoints with the best "
                                  "objective and the latest (resume needs it), instead of the latest `keep`",
                                  json_schema_extra={"flag": "--keep-best"})

    @model_validator(mode="after")
    def _ranked_epochs(self):
        if self.keep_best is not None and self.every is not None:
            raise ConfigError(f"checkpoint.keep_best (--keep-best) {self.keep_best} and checkpoint.every "
                              f"(--checkpoint-every) {self.every}: checkpoints are ranked by validation, which "
                              "runs at epoch ends only; give one")
        return self


class TrainConfig(DataParallelJob):
    """Data-parallel training of a task with Ray Train's TorchTrainer (DDP or FSDP2)."""

    kind: ClassVar[str] = "train"
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="DistributedDataParallel, or FSDP2 fully_shard "
                                             "per layer")
    scale_lr: bool = Field(False, description="multiply lr by the number of workers (the Horovod convention)")
    checkpoint: TrainCheckpoints = TrainCheckpoints()
    metrics_every_steps: int | None = Field(None, ge=1, description="also record a metrics row every K steps")
    metrics_send_s: float = Field(30.0, ge=0, description="step rows reach metrics.parquet and TensorBoard at "
                                  "least this often (each send waits for every rank; Prometheus and the trackers "
                                  "get each row at once)")
    init_from: str | None = Field(None, description="start from a sweep trial's weights: SWEEP_DIR (its best "
                                  "trial by the sweep's objective) or SWEEP_DIR:TRIAL_ID; the trial's own task "
                                  "hyperparameters are the defaults of --hp")

    @property
    def effective_lr(self) -> float:
        return self.optim.lr * self.compute.num_workers if self.scale_lr else self.optim.lr

    @property
    def use_bf16(self) -> bool:
        return self.precision == "bf16"


def train_hparams(cfg: DataParallelJob, hp_model) -> dict:
    """The task's `hp`: the run's optimiser, global batch and seed, and the task's own `hparams`."""
    given = sorted(set(cfg.hparams) & set(PLATFORM_KEYS))
    if given:
        raise ConfigError(f"hparams.{given[0]} (--hp): a platform hyperparameter; set it with "
                          f"{PLATFORM_FLAGS[given[0]]}")
    platform = {**cfg.optim.model_dump(), **cfg.schedule.model_dump(), "lr": cfg.effective_lr,
                "accumulate": cfg.accumulate, "batch_size": cfg.global_batch, "seed": cfg.seed}
    return {**full_hparams(hp_model, cfg.hparams, key="hparams.{name} (--hp)"), **platform}


def bind_train(cfg: DataParallelJob, task) -> tuple[DataParallelJob, dict]:
    return cfg, train_hparams(cfg, task.hp_model)


def bind_training(cfg: TrainConfig, task, weights=None) -> tuple[TrainConfig, dict]:
    """`bind_train`; with `weights` (a sweep trial's, `rayhpc.tune.weights.trial_weights` of `init_from`),
    the trial's own task hyperparameters fill the ones the run leaves unset, and the weights are checked
    against this run's model before anything starts."""
    if weights is None:
        return bind_train(cfg, task)
    own = {k: v for k, v in weights.hp.items() if k in task_keys(task.hp_model)}
    cfg, hp = bind_train(cfg.model_copy(update={"hparams": {**own, **cfg.hparams}}), task)
    check_fits(weights, task.initial_model(hp))
    return cfg, hp


def check_fits(weights, model) -> None:
    """Refuse (one line) weights that do not fit `model`: a name missing on either side, or a shape."""
    own, state = model.state_dict(), weights.state
    problems = [f"{k} missing there" for k in own if k not in state]
    problems += [f"{k} is not in this run's model" for k in state if k not in own]
    problems += [f"{k} is {list(state[k].shape)} there, {list(v.shape)} here" for k, v in own.items()
                 if k in state and state[k].shape != v.shape]
    if problems:
        raise ConfigError(f"init_from (--init-from): trial {weights.trial_id}'s weights do not fit this run's "
                          f"model: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                          + f"; was it another task, or other --hp? it had {_task_hp(weights.hp)}")


def _task_hp(hp: dict) -> str:
    own = {k: v for k, v in hp.items() if k not in PLATFORM_KEYS and not (isinstance(v, float) and math.isnan(v))}
    return ", ".join(f"{k}={v}" for k, v in own.items()) or "no hyperparameters of its own"
