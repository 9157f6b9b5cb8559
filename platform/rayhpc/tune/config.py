"""The sweep's config tree and its command-line flags (the CLI overrides `--config FILE`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rayhpc.config import ConfigError, JobConfig, StrictModel
from rayhpc.data import DataConfig
from rayhpc.tune.space import HParams, ParamSpec, Space, check_space, parse_space

DEFAULT_SPACE = {
    "hidden": {"choice": [4, 8, 16, 32, 64]},
    "lr": {"loguniform": [1e-3, 1e-1]},
}


class AshaConfig(StrictModel):
    """Early stopping with ASHA (`scheduler: asha`)."""

    grace_period: int = Field(1, ge=1, description="epochs every trial runs before it may be stopped")
    reduction_factor: float = Field(2.0, gt=1, description="at each rung keep the best 1/reduction_factor")


class SweepConfig(JobConfig):
    """A hyperparameter sweep of the two-layer MLP."""

    kind: ClassVar[str] = "sweep"
    name: str = Field("mlp-sweep", pattern=r"^[A-Za-z0-9_.=-]+$", description="sweep folder under storage_path")
    num_samples: int = Field(16, ge=1, description="trials (per grid point when the space has grid values); "
                             "unset: 16, or 1 with search=grid")
    max_concurrent: int | None = Field(None, ge=1, description="most trial processes at once: the array job's %K")
    cpus_per_trial: float = Field(1.0, gt=0, description="CPUs reserved per trial process (torch threads)")
    gpus_per_trial: float | None = Field(None, ge=0, description="GPUs per trial process, fractional allowed; "
                                         "unset: 0 without GPUs, else a share of the GPUs")
    epochs: int = Field(10, ge=1, description="training epochs per trial (one report and checkpoint each)")
    search: Literal["random", "grid", "optuna"] = Field("random", description="how configs are drawn")
    scheduler: Literal["fifo", "asha"] = Field("fifo", description="run trials to the end, or stop bad ones early")
    pack: int | None = Field(None, ge=1, description="trials trained together as one batched model; "
                             "unset: enough to fill the cluster once (1 with asha or optuna)")
    workers_per_trial: int = Field(1, ge=1, description="training workers per trial; above 1 every trial is a "
                                   "Ray Train TorchTrainer (DDP) and cpus/gpus_per_trial are per worker")
    max_failures: int = Field(2, ge=0, description="retries of a trial whose process dies, from its checkpoint")
    seed: int = Field(0, description="seeds sampling, model initialisation and data order")
    data: DataConfig = DataConfig()
    asha: AshaConfig = AshaConfig()
    space: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_SPACE), validate_default=True,
                                  description="search space")

    @model_validator(mode="before")
    @classmethod
    def _default_samples(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("search") == "grid" and data.get("num_samples") is None:
            return {**data, "num_samples": 1}  # a grid search runs each grid point once
        return data

    @field_validator("space", mode="before")
    @classmethod
    def _parse_space(cls, raw: Any) -> Space:
        return parse_space(raw)

    @model_validator(mode="after")
    def _check(self) -> "SweepConfig":
        check_space(self.space, self.search)
        if self.pack is not None and self.pack > 1 and self.scheduler == "asha":
            raise ConfigError("pack: packed trials train to the end together; scheduler=asha needs pack 1 or unset")
        if self.pack is not None and self.pack > 1 and self.search == "optuna":
            raise ConfigError("pack: optuna proposes one trial at a time; search=optuna needs pack 1 or unset")
        if self.workers_per_trial > 1:
            self._check_distributed()
        return self

    def _check_distributed(self) -> None:
        """With several workers per trial, batch_size is the global batch and must split evenly."""
        if self.pack is not None and self.pack > 1:
            raise ConfigError(f"pack: trials with workers_per_trial={self.workers_per_trial} cannot be packed; "
                              "use pack 1 or unset")
        spec = self.space.get("batch_size", HParams.model_fields["batch_size"].default)
        if isinstance(spec, ParamSpec) and spec.kind == "randint":
            raise ConfigError("space.batch_size: with workers_per_trial > 1 give batch sizes as choice or grid")
        sizes = list(spec.args) if isinstance(spec, ParamSpec) else [spec]
        bad = [b for b in sizes if int(b) % self.workers_per_trial]
        if bad:
            raise ConfigError(f"space.batch_size: {bad[0]} is not divisible by workers_per_trial "
                              f"(--workers-per-trial) {self.workers_per_trial}")


# flag -> config key; unset flags leave the YAML value (see rayhpc.cli.config_from_args)
FLAGS = {
    "--name": "name", "--storage-path": "storage_path", "--num-samples": "num_samples",
    "--max-concurrent": "max_concurrent", "--cpus-per-trial": "cpus_per_trial",
    "--gpus-per-trial": "gpus_per_trial", "--epochs": "epochs", "--search": "search",
    "--scheduler": "scheduler", "--pack": "pack", "--workers-per-trial": "workers_per_trial",
    "--max-failures": "max_failures", "--seed": "seed",
    "--address": "address", "--resume": "resume", "--data": "data.path", "--target": "data.target",
}
