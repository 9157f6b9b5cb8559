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
    default_epochs: ClassVar[int | None] = None  # epochs where neither `steps` nor `epochs` is given

    @model_validator(mode="before")
    @classmethod
    def _steps_or_epochs(cls, data: Any) -> Any:
        """How long every job trains: `steps` or `epochs` (its fields), never both."""
        if not isinstance(data, dict):
            return data
        if data.get("steps") is not None and data.get("epochs") is not None:
            raise ConfigError(f"steps (--steps) {data['steps']} and epochs (--epochs) {data['epochs']}: give one, "
                              "not both")
        if data.get("steps") is None and data.get("epochs") is None and cls.default_epochs:
            return {**data, "epochs": cls.default_epochs}
        return data

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


class TrainingJob(ModelOptions, TaskJobConfig):
    """A job that trains one model of a task (`rayhpc train`, `parallel` and `ps`): its sections for the
    task's hyperparameters, the optimizer's step, precision, how long, and checkpoints, declared once."""

    hparams: dict[str, Any] = Field({}, description="the task's own hyperparameters, e.g. hidden=16,depth=3",
                                    json_schema_extra={"flag": "--hp"})
    epochs: int | None = Field(None, ge=1, description="passes over the training split (an epoch's last batch "
                               "is partial where the data does not fill it); unset with steps unset: the job's "
                               "default (train and ps 5 epochs, parallel 20 steps)")
    steps: int | None = Field(None, ge=1, description="optimizer steps, instead of epochs: the epochs they take, "
                              "the last one cut short")
    optim: Optim = Optim()
    schedule: Schedule = Schedule()
    accumulate: int = Field(1, ge=1, description="micro-batches per optimizer step on each data-parallel replica "
                            "(a pipeline's schedule runs; the batch is unchanged: less memory, the same step)")
    precision: Precision = Field("tf32", description=PRECISION_HELP)
    checkpoint: StepCheckpoints = StepCheckpoints()
