"""The config shared by every job that trains a task: which task, its seed, and the `data:` section."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from rayhpc.config import ConfigError, JobConfig
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
