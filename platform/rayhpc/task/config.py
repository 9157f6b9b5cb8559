"""The config shared by every job that trains a task: which task, its seed, and the `data:` section."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from rayhpc.config import (
    PRECISION_HELP,
    ConfigError,
    JobConfig,
    ModelOptions,
    Optim,
    Precision,
    Schedule,
    StepCheckpoints,
)
from rayhpc.data import DataConfig
from rayhpc.task.load import absolute_spec, spec_label
from rayhpc.tracking.config import Tracking


class TaskJobConfig(JobConfig):
    """A job that trains a task: `task`, `seed` and `data` (the name defaults to `<task>-<kind>`)."""

    task: str = Field("mlp", description="the model, data and loss: mlp (built in), FILE.py:NAME or "
                      "package.module:NAME")
    seed: int = Field(0, description="seeds initialisation, dropout and the data order")
    data: DataConfig = DataConfig()
    tracking: Tracking = Tracking()
    uploads_weights: ClassVar[bool] = True  # tracking.log_checkpoint: this job can upload its model's weights
    @model_validator(mode="after")
    def _weights_to_upload(self):
        if self.tracking.log_checkpoint != "none" and not self.uploads_weights:
            raise ConfigError(f"tracking.log_checkpoint (--log-checkpoint) {self.tracking.log_checkpoint}: a "
                              f"{self.kind} job's weights are sharded over its ranks or servers; sweeps and "
                              "training runs upload weights; use none")
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("name") is None:
            return {**data, "name": f"{spec_label(str(data.get('task') or 'mlp'))}-{cls.kind}"}
        return data

    @field_validator("task")
    @classmethod
    def _absolute(cls, spec: str) -> str:
        return absolute_spec(spec)


class Training(ModelOptions):
    """The training section every job composes (a sweep's trials, `rayhpc train`, `parallel` and `ps`), declared
    once with one default each: how long, the global batch, the optimizer's step, precision and restarts."""

    default_epochs: ClassVar[int] = 10  # where neither `steps` nor `epochs` is given, in every job
    epochs: int | None = Field(None, ge=1, description="passes over the training split, one report and checkpoint "
                               "each (an epoch's last batch is partial where the data does not fill it); unset "
                               "with steps unset: 10")
    steps: int | None = Field(None, ge=1, description="optimizer steps, instead of epochs: the epochs they take, "
                              "the last one cut short")
    global_batch_size: int = Field(32, ge=1, description="samples per optimizer step over all workers (of a "
                                   "sweep's trial: space.batch_size searches it)")
    accumulate: int = Field(1, ge=1, description="micro-batches per optimizer step on each data-parallel replica "
                            "(a pipeline's schedule runs; the batch is unchanged: less memory, the same step)")
    optim: Optim = Optim()
    schedule: Schedule = Schedule()
    precision: Precision = Field("tf32", description=PRECISION_HELP)
    max_failures: int = Field(2, ge=0, description="restarts after a failure (a trial's process, a worker or a "
                              "server), each from the latest checkpoint")

    @model_validator(mode="before")
    @classmethod
    def _steps_or_epochs(cls, data: Any) -> Any:
        """How long every job trains: `steps` or `epochs`, never both."""
        if not isinstance(data, dict):
            return data
        if data.get("steps") is not None and data.get("epochs") is not None:
            raise ConfigError(f"steps (--steps) {data['steps']} and epochs (--epochs) {data['epochs']}: give one, "
                              "not both")
        if data.get("steps") is None and data.get("epochs") is None:
            return {**data, "epochs": cls.default_epochs}
        return data


class TrainingJob(Training, TaskJobConfig):
    """A job that trains one model of a task (`rayhpc train`, `parallel` and `ps`): the training section, the
    task's hyperparameters and when it checkpoints."""

    hparams: dict[str, Any] = Field({}, description="the task's own hyperparameters, e.g. hidden=16,depth=3",
                                    json_schema_extra={"flag": "--hp"})
    checkpoint: StepCheckpoints = StepCheckpoints()
