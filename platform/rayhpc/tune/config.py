"""The sweep's config tree, and how it binds to its task (the search space checked against the task's
hyperparameters). Command-line flags are derived from the fields (`rayhpc.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rayhpc.config import PRECISION_HELP, ConfigError, ModelOptions, Precision, RankedCheckpoints, StrictModel
from rayhpc.task.config import TaskJobConfig
from rayhpc.task.hparams import PlatformHParams, full_hparams
from rayhpc.tune.pbt import MUTABLE, mutable
from rayhpc.tune.space import (
    ParamSpec,
    Space,
    check_space_form,
    check_space_values,
    parse_space,
    sample_configs,
    searched,
)

# the search space of a task that declares none (the built-in mlp task also searches its width)
DEFAULT_SPACE = {"lr": {"loguniform": [1e-3, 1e-1]}}


class AshaConfig(StrictModel):
    """Early stopping with ASHA (`scheduler: asha`)."""

    grace_period: int = Field(1, ge=1, description="epochs every trial runs before it may be stopped")
    reduction_factor: float = Field(2.0, gt=1, description="at each rung keep the best 1/reduction_factor")


class PbtConfig(StrictModel):
    """Population-based training of each pack's members (`scheduler: pbt`, `rayhpc.tune.pbt`)."""

    perturbation_interval: int = Field(2, ge=1, description="epochs between exploit/explore rounds")
    quantile_fraction: float = Field(0.25, gt=0, le=0.5, description="the worst share copies the best share")
    resample_probability: float = Field(0.25, ge=0, le=1, description="a fresh draw instead of x0.8 / x1.2")


class SweepConfig(ModelOptions, TaskJobConfig):
    """A hyperparameter sweep of a task (the built-in MLP by default)."""

    kind: ClassVar[str] = "sweep"
    num_samples: int = Field(16, ge=1, description="trials (per grid point when the space has grid values); "
                             "unset: 16, or 1 with search=grid")
    max_concurrent: int | None = Field(None, ge=1, description="most trial processes at once: the array job's %K")
    cpus_per_trial: float = Field(1.0, gt=0, description="CPUs reserved per trial process (torch threads)")
    gpus_per_trial: float | None = Field(None, ge=0, le=1, description="GPUs per trial process (per worker with "
                                         "workers_per_trial > 1): 1, or 1/k to put k packs on each GPU (k <= 8); "
                                         "unset: 0 without GPUs, else 1")
    precision: Precision = Field("tf32", description=PRECISION_HELP + "; every trial, packed or distributed "
                                 "(bf16 needs GPUs)")
    epochs: int | None = Field(None, ge=1, description="training epochs per trial, one report and checkpoint each "
                               "(default 10)")
    steps: int | None = Field(None, ge=1, description="optimizer steps per trial, instead of epochs: the epochs "
                              "they take (by the trial's batch size), the last one cut short")
    search: Literal["random", "grid", "optuna"] = Field("random", description="how configs are drawn")
    scheduler: Literal["fifo", "asha", "pbt"] = Field("fifo", description="run trials to the end, stop bad ones "
                                                      "early (asha), or evolve each pack's members (pbt)")
    pack: int | None = Field(None, ge=1, description="trials trained together as one batched model; "
                             "unset: enough to fill the cluster once (optuna: 2 batches per slot)")
    workers_per_trial: int = Field(1, ge=1, description="training workers per trial; above 1 every trial is "
                                   "data-parallel (strategy) and cpus/gpus_per_trial are per worker")
    trial_runner: Literal["warm", "trainer"] = Field("warm", description="with workers_per_trial > 1: warm "
                                                     "worker groups kept for the whole sweep, one per trial slot, "
                                                     "or a Ray Train TorchTrainer started per trial")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="with workers_per_trial > 1: DDP, or FSDP2 "
                                             "(parameters sharded over the trial's workers)")
    max_failures: int = Field(2, ge=0, description="retries of a trial whose process dies, from its checkpoint")
    checkpoint: RankedCheckpoints = RankedCheckpoints()
    asha: AshaConfig = AshaConfig()
    pbt: PbtConfig = PbtConfig()
    space: dict[str, Any] | None = Field(None, description="search space; unset: the task's own, else lr")
    study: Path | None = Field(None, description="a study folder (on a filesystem every slice sees): this run "
                               "becomes one slice of the sweep kept there, with any others started on it; the "
                               "first slice's settings define the sweep (rayhpc.study)")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("search") == "grid" and data.get("num_samples") is None:
            data = {**data, "num_samples": 1}  # a grid search runs each grid point once
        if data.get("steps") is not None and data.get("epochs") is not None:
            raise ConfigError(f"steps (--steps) {data['steps']} and epochs (--epochs) {data['epochs']}: give one, "
                              "not both")
        return data if data.get("steps") is not None else {**data, "epochs": data.get("epochs") or 10}

    @field_validator("space", mode="before")
    @classmethod
    def _parse_space(cls, raw: Any) -> Space | None:
        return None if raw is None else parse_space(raw)

    @model_validator(mode="after")
    def _check(self) -> "SweepConfig":
        if self.space is not None:
            check_space_form(self.space, self.search)
        if self.gpus_per_trial and self.workers_per_trial > 1 and self.gpus_per_trial != 1:
            raise ConfigError(f"gpus_per_trial (--gpus-per-trial) {self.gpus_per_trial:g}: with workers_per_trial "
                              f"{self.workers_per_trial} every worker is one NCCL rank on a whole GPU; use 1 or 0")
        if self.steps is not None and self.scheduler != "fifo":
            raise ConfigError(f"steps (--steps) {self.steps}: scheduler {self.scheduler} compares trials epoch by "
                              "epoch; give epochs")
        if self.scheduler == "pbt":
            self._check_pbt()
        if self.pack is not None and self.pack > 1 and self.model_options_set:
            key, value = next((k, v) for k, v in self.model_options_set.items())
            raise ConfigError(f"{key} (--{key.replace('_', '-')}) {value}: packed trials run as one batched model "
                              "(torch.func), not as the task's blocks; use pack 1 (or leave pack unset)")
        if self.pack is not None and self.pack > 1 and self.workers_per_trial > 1:
            raise ConfigError(f"pack: trials with workers_per_trial={self.workers_per_trial} cannot be packed; "
                              "use pack 1 or unset")
        return self

    def _check_pbt(self) -> None:
        """PBT evolves the members of a pack: it needs packs of several random or grid trials."""
        if self.search == "optuna":
            raise ConfigError("scheduler (--scheduler) pbt: PBT evolves the members of packs the sweep draws; "
                              "use search random or grid")
        if self.workers_per_trial > 1 or self.pack == 1:
            what = (f"workers_per_trial (--workers-per-trial) {self.workers_per_trial}" if self.workers_per_trial > 1
                    else "pack (--pack) 1")
            raise ConfigError(f"{what}: scheduler pbt evolves the members of a pack; use packs of 2 or more")

    @property
    def model_options_set(self) -> dict[str, str]:
        """compile and activation_checkpointing where they are not "none": such trials train unpacked."""
        return {k: getattr(self, k) for k in ModelOptions.model_fields if getattr(self, k) != "none"}

    def defaults(self, hp_model) -> dict:
        """Every hyperparameter's value where the space sets none (the sweep's seed for `seed`)."""
        return full_hparams(hp_model, {"seed": self.seed})

    def configs(self, hp_model) -> list[dict]:
        """Every trial's hyperparameters, for a random or grid search."""
        return sample_configs(self.space, self.num_samples, self.search, self.seed, hp_model, self.defaults(hp_model))


def bind_sweep(cfg: SweepConfig, task) -> tuple[SweepConfig, dict]:
    """The sweep with its space resolved (the task's own when unset) and checked against the task's
    hyperparameters; and one trial's hyperparameters to check the task with."""
    space = cfg.space if cfg.space is not None else parse_space(task.default_space or DEFAULT_SPACE)
    check_space_form(space, cfg.search)
    check_space_values(space, task.hp_model)
    cfg = cfg.model_copy(update={"space": space})
    if cfg.scheduler == "pbt" and not mutable(space):
        raise ConfigError(f"space: scheduler pbt perturbs {', '.join(MUTABLE)} inside a pack, and the space "
                          f"varies none of them ({', '.join(searched(space))})")
    check_batches(cfg)
    return cfg, sample_configs(space, 1, "random", cfg.seed, task.hp_model, cfg.defaults(task.hp_model))[0]


def check_batches(cfg: SweepConfig) -> None:
    """batch_size is the global batch: it must split evenly over the workers of a trial, and each worker's
    share into `accumulate` micro-batches."""
    sizes, micro = (_values(cfg, key) for key in ("batch_size", "accumulate"))
    if (sizes is None and cfg.workers_per_trial > 1) or (sizes is None and micro != [1]) or micro is None:
        raise ConfigError("space.batch_size, space.accumulate: with several workers per trial or micro-batches, "
                          "give them as choice or grid")
    for size in sizes or []:
        if int(size) % cfg.workers_per_trial:
            raise ConfigError(f"space.batch_size: {size} is not divisible by workers_per_trial "
                              f"(--workers-per-trial) {cfg.workers_per_trial}")
        share = int(size) // cfg.workers_per_trial
        if bad := [a for a in micro if share % int(a)]:
            raise ConfigError(f"space.accumulate: {bad[0]} does not divide the batch per worker {share} "
                              f"(space.batch_size {size} over {cfg.workers_per_trial} worker(s))")


def _values(cfg: SweepConfig, key: str) -> list | None:
    """Every value the space may give `key` (its default where it gives none); None for a randint."""
    spec = cfg.space.get(key, PlatformHParams.model_fields[key].default)
    if isinstance(spec, ParamSpec):
        return None if spec.kind == "randint" else list(spec.args)
    return [spec]
