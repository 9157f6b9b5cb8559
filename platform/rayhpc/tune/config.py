"""The sweep's config tree, and how it binds to its task (the search space checked against the task's
hyperparameters). Command-line flags are derived from the fields (`rayhpc.cli`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from rayhpc.config import ConfigError, ModelOptions, Optim, RankedCheckpoints, Schedule, StrictModel
from rayhpc.task.config import TaskJobConfig, Training
from rayhpc.task.hparams import check_value, full_hparams
from rayhpc.tune.objectives import Constraint, check_names, parse_constraint, parse_objective
from rayhpc.tune.pbt import MUTABLE, mutable
from rayhpc.tune.space import (
    ParamSpec,
    Space,
    check_space_form,
    check_space_values,
    complete_point,
    conditional,
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


class MedianConfig(StrictModel):
    """Median stopping (`scheduler: median`, Tune's MedianStoppingRule on pack members): a trial whose best
    so far is worse than the median of the other trials' running means at the same epoch stops."""

    grace_period: int = Field(1, ge=1, description="epochs every trial runs before it may be stopped",
                              json_schema_extra={"flag": "--median-grace-period"})
    min_samples: int = Field(3, ge=1, description="other trials that must have reached the epoch first",
                             json_schema_extra={"flag": "--median-min-samples"})


class HyperbandConfig(StrictModel):
    """Synchronous HyperBand (`scheduler: hyperband`, Tune's HyperBandScheduler): brackets of successive
    halving. It pauses whole trials and resumes them later, which a pack's members cannot do apart: its
    trials run unpacked."""

    reduction_factor: float = Field(3.0, gt=1, description="each round keeps the best 1/reduction_factor",
                                    json_schema_extra={"flag": "--hyperband-reduction-factor"})


class PbtConfig(StrictModel):
    """Population-based training of each pack's members (`scheduler: pbt`, `rayhpc.tune.pbt`)."""

    perturbation_interval: int = Field(2, ge=1, description="epochs between exploit/explore rounds")
    quantile_fraction: float = Field(0.25, gt=0, le=0.5, description="the worst share copies the best share")
    resample_probability: float = Field(0.25, ge=0, le=1, description="a fresh draw instead of x0.8 / x1.2")


# the hyperparameters every trial takes from a field of the sweep where the space does not search them
CONSTANTS = {"batch_size": "global_batch_size", "accumulate": "accumulate"}


class SweepConfig(Training, TaskJobConfig):
    """A hyperparameter sweep of a task (the built-in MLP by default): each trial trains by the training section
    (`rayhpc.task.config.Training`), its values the constants of the hyperparameters the space leaves out."""

    kind: ClassVar[str] = "sweep"
    run_keys: ClassVar[frozenset[str]] = frozenset({"time_budget"})
    num_samples: int = Field(16, ge=1, description="trials (per grid point when the space has grid values); "
                             "unset: 16, or 1 with search=grid")
    max_concurrent: int | None = Field(None, ge=1, description="most trial processes at once: the array job's %K")
    cpus_per_trial: float = Field(1.0, gt=0, description="CPUs reserved per trial process (torch threads)")
    gpus_per_trial: float | None = Field(None, ge=0, le=1, description="GPUs per trial process (per worker with "
                                         "workers_per_trial > 1): 1, or 1/k to put k packs on each GPU (k <= 8); "
                                         "unset: 0 without GPUs, else 1")
    search: Literal["random", "grid", "optuna"] = Field("random", description="how configs are drawn")
    objective: list[str] | None = Field(None, description="what the sweep optimises, NAME:MODE (MODE min or max): "
                                        "a reported value (val_loss, val_<metric>) or a measured one (params, flops, "
                                        "step_ms, peak_mem_mb); several: a multi-objective search (the table marks "
                                        "the Pareto front); the first is the best for checkpoints and --init-from; "
                                        "unset: the task's objective")
    constraints: list[str] | None = Field(None, description="NAME<=BOUND or NAME>=BOUND (e.g. params<=5e6) every "
                                          "trial should meet: Optuna samples under them, the table marks feasible")
    sampler: Literal["tpe", "nsga2"] = Field("tpe", description="Optuna's sampler (search optuna): TPE, or "
                                             "NSGA-II for several objectives")
    repeats: int = Field(1, ge=1, le=16, description="runs of each configuration, with seeds seed, seed+1, ...: "
                         "members of one pack (each its own data order and initialisation); the table gets a "
                         "row per run and summary.parquet the mean, std and 95% interval of each configuration; "
                         "searchers and ASHA see the mean")
    time_budget: float | None = Field(None, gt=0, description="seconds (or 90m, 3h) the sweep may run: then it "
                                      "starts no trial and stops the running ones, resumable (--resume), and "
                                      "ends; give a Slurm job's time limit less its start-up")
    max_trials: int | None = Field(None, ge=1, description="search optuna: the most trials it proposes (instead of "
                                   "num_samples); with time_budget, whichever comes first ends the sweep")
    points_to_evaluate: list[dict[str, Any]] | None = Field(None, description="configurations tried first, each "
                                                            "KEY=VALUE;KEY=VALUE (YAML: a list of mappings); the "
                                                            "searched keys they leave out are drawn")
    warm_start: Path | None = Field(None, description="an earlier sweep's folder: Optuna learns from its "
                                    "finished trials before it proposes any (search optuna)")
    scheduler: Literal["fifo", "asha", "median", "hyperband", "pbt"] = Field(
        "fifo", description="run trials to the end, stop bad ones early (asha, median: on pack members; "
        "hyperband: Tune's synchronous HyperBand, unpacked trials), or evolve each pack's members (pbt)")
    pack: int | None = Field(None, ge=1, description="trials trained together as one batched model; "
                             "unset: enough to fill the cluster once (optuna: 2 batches per slot)")
    workers_per_trial: int = Field(1, ge=1, description="training workers per trial; above 1 every trial is "
                                   "data-parallel (strategy) and cpus/gpus_per_trial are per worker")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="with workers_per_trial > 1: DDP, or FSDP2 "
                                             "(parameters sharded over the trial's workers)")
    checkpoint: RankedCheckpoints = RankedCheckpoints()
    asha: AshaConfig = AshaConfig()
    median: MedianConfig = MedianConfig()
    hyperband: HyperbandConfig = HyperbandConfig()
    pbt: PbtConfig = PbtConfig()
    space: dict[str, Any] | None = Field(None, description="search space; unset: the task's own, else lr (less "
                                         "the optim: and schedule: keys set to other than their defaults)")
    study: Path | None = Field(None, description="a study folder (on a filesystem every slice sees): this run "
                               "becomes one slice of the sweep kept there, with any others started on it; the "
                               "first slice's settings define the sweep (rayhpc.study)")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("max_trials") is not None:
            if data.get("search") != "optuna":
                raise ConfigError(f"max_trials (--max-trials) {data['max_trials']}: the cap of an adaptive search; "
                                  f"use search optuna, or num_samples (got search {data.get('search', 'random')})")
            data = {**data, "num_samples": data["max_trials"]}
        if data.get("search") == "grid" and data.get("num_samples") is None:
            data = {**data, "num_samples": 1}  # a grid search runs each grid point once
        return data

    @field_validator("space", mode="before")
    @classmethod
    def _parse_space(cls, raw: Any) -> Space | None:
        return None if raw is None else parse_space(raw)

    @field_validator("time_budget", mode="before")
    @classmethod
    def _parse_budget(cls, raw: Any) -> Any:
        """90, "90s", "15m", "3h" as seconds."""
        if isinstance(raw, str) and raw.strip()[-1:] in ("s", "m", "h"):
            number, unit = raw.strip()[:-1], raw.strip()[-1]
            try:
                return float(number) * {"s": 1, "m": 60, "h": 3600}[unit]
            except ValueError:
                raise ValueError(f"{raw!r}: expected seconds, or a number with s, m or h (90m, 3h)") from None
        return raw

    @field_validator("points_to_evaluate", mode="before")
    @classmethod
    def _parse_points(cls, raw: Any) -> Any:
        """A flag's points are `KEY=VALUE;KEY=VALUE` strings (values read as YAML)."""
        if not isinstance(raw, list):
            return raw
        return [_point(item) if isinstance(item, str) else item for item in raw]

    @field_validator("objective", mode="after")
    @classmethod
    def _parse_objective(cls, raw: list[str] | None) -> list[str] | None:
        return None if not raw else [":".join(parse_objective(t)) for t in raw]

    @field_validator("constraints", mode="after")
    @classmethod
    def _parse_constraints(cls, raw: list[str] | None) -> list[str] | None:
        return None if not raw else [str(parse_constraint(t)) for t in raw]

    @property
    def objectives(self) -> list[tuple[str, str]] | None:
        """The objectives given, as (name, mode); None: the task's."""
        return None if self.objective is None else [parse_objective(t) for t in self.objective]

    @property
    def constraint_list(self) -> list[Constraint]:
        return [parse_constraint(t) for t in self.constraints or []]

    @model_validator(mode="after")
    def _check(self) -> "SweepConfig":
        self._check_search()
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
        if self.scheduler == "hyperband" and ((self.pack or 1) > 1 or self.repeats > 1):
            what = f"pack (--pack) {self.pack}" if (self.pack or 1) > 1 else f"repeats (--repeats) {self.repeats}"
            raise ConfigError(f"{what}: scheduler {self.scheduler} pauses and resumes whole trials, so its trials "
                              "run unpacked; use pack 1 and repeats 1 (or asha/median, which stop pack members)")
        if self.pack is not None and self.pack > 1 and self.model_options_set:
            key, value = next((k, v) for k, v in self.model_options_set.items())
            raise ConfigError(f"{key} (--{key.replace('_', '-')}) {value}: packed trials run as one batched model "
                              "(torch.func), not as the task's blocks; use pack 1 (or leave pack unset)")
        if self.pack is not None and self.pack > 1 and self.workers_per_trial > 1:
            raise ConfigError(f"pack: trials with workers_per_trial={self.workers_per_trial} cannot be packed; "
                              "use pack 1 or unset")
        return self

    def _check_search(self) -> None:
        """What the search features need of each other: several objectives go to Optuna's samplers and the
        table's front (a scheduler ranks by one value); a study's slices share one plain search."""
        several = len(self.objective or []) > 1
        if several and self.scheduler != "fifo":
            raise ConfigError(f"scheduler (--scheduler) {self.scheduler}: it ranks trials by one value and "
                              f"objective has {len(self.objective)} ({', '.join(self.objective)}); use fifo, or "
                              "give one objective")
        if self.study is not None and self.search == "optuna" and self.space and conditional(self.space):
            raise ConfigError(f"space.{next(iter(conditional(self.space)))}.when: a study's Optuna slices "
                              "propose every parameter; leave out --study, or the condition")
        if (several or self.constraints) and self.study is not None:
            raise ConfigError("study (--study): a study's slices search one objective without constraints; "
                              "leave out --study or give one objective and no constraints")
        if self.repeats > 1:
            self._check_repeats()
        if self.warm_start is not None and self.search != "optuna":
            raise ConfigError(f"warm_start (--warm-start) {self.warm_start}: it feeds Optuna's sampler; use search "
                              f"optuna (got {self.search})")
        if self.study is not None and (self.warm_start is not None or self.points_to_evaluate):
            raise ConfigError("study (--study): a study's slices start from its own folder; leave out "
                              "points_to_evaluate and warm_start, or --study")
        if self.sampler == "nsga2" and self.search != "optuna":
            raise ConfigError(f"sampler (--sampler) nsga2: Optuna's sampler; use it with search optuna "
                              f"(got {self.search})")

    def _check_repeats(self) -> None:
        """Repeats are members of packs that differ in their seed: single-process trials, no PBT (which would
        copy one seed's weights into another's), no study (its packs are claimed whole by one slice)."""
        what = ("scheduler (--scheduler) pbt" if self.scheduler == "pbt"
                else f"workers_per_trial (--workers-per-trial) {self.workers_per_trial}" if self.workers_per_trial > 1
                else "study (--study)" if self.study is not None
                else "space.seed" if self.space and "seed" in self.space else None)
        if what is not None:
            raise ConfigError(f"repeats (--repeats) {self.repeats}: repeated seeds are members of one pack, "
                              f"which {what} does not allow; use repeats 1 or leave it out")

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

    @property
    def fixed(self) -> dict[str, Any]:
        """The constants of every trial set to other than their defaults, by hyperparameter: the `optim:` and
        `schedule:` keys, `global_batch_size` (`batch_size`) and `accumulate`."""
        given = {k: v for section in (self.optim, self.schedule) for k, v in section.model_dump().items()
                 if v != type(section).model_fields[k].default}
        given.update({key: getattr(self, field) for key, field in CONSTANTS.items()
                      if getattr(self, field) != type(self).model_fields[field].default})
        return given

    @property
    def constants(self) -> dict[str, Any]:
        """The batch and accumulation of every trial the space does not search, by hyperparameter."""
        return {key: getattr(self, field) for key, field in CONSTANTS.items()}

    def defaults(self, hp_model) -> dict:
        """Every hyperparameter's value where the space sets none: the `optim:` and `schedule:` sections', the
        batch and accumulation, and the sweep's seed for `seed`."""
        return full_hparams(hp_model, {**self.optim.model_dump(), **self.schedule.model_dump(), "seed": self.seed,
                                       **self.constants})

    def configs(self, hp_model) -> list[dict]:
        """Every trial's hyperparameters, for a random or grid search: the points to evaluate first."""
        defaults = self.defaults(hp_model)
        points = [complete_point(self.space, p, self.seed + i, hp_model, defaults)
                  for i, p in enumerate(self.points_to_evaluate or [])]
        return points + sample_configs(self.space, self.num_samples, self.search, self.seed, hp_model, defaults)


def bind_sweep(cfg: SweepConfig, task) -> tuple[SweepConfig, dict]:
    """The sweep with its space resolved (the task's own when unset) and checked against the task's
    hyperparameters; and one trial's hyperparameters to check the task with."""
    fixed = cfg.fixed
    if cfg.space is None:  # the task's own space (or lr) searches only what the sections leave to it
        space = {k: v for k, v in parse_space(task.default_space or DEFAULT_SPACE).items() if k not in fixed}
    else:
        space = cfg.space
        if both := sorted(set(fixed) & set(space)):
            key = both[0]
            name = ("optim." if key in Optim.model_fields else "schedule." if key in Schedule.model_fields else "") \
                + CONSTANTS.get(key, key)
            raise ConfigError(f"{name} (--{name.rpartition('.')[2].replace('_', '-')}) {fixed[key]}: space.{key} "
                              "sets it too; give it in one place")
    check_space_form(space, cfg.search)
    check_space_values(space, task.hp_model)
    cfg = cfg.model_copy(update={"space": space})
    if cfg.scheduler == "pbt" and not mutable(space):
        raise ConfigError(f"space: scheduler pbt perturbs {', '.join(MUTABLE)} inside a pack, and the space "
                          f"varies none of them ({', '.join(searched(space))})")
    check_batches(cfg)
    if cfg.repeats > 1 and _values(cfg, "accumulate") != [1]:
        raise ConfigError(f"repeats (--repeats) {cfg.repeats}: each run of a pack takes its own batches, which are "
                          "not split into micro-batches; leave space.accumulate out (or 1)")
    for i, point in enumerate(cfg.points_to_evaluate or []):
        for name, value in point.items():
            check_value(task.hp_model, f"points_to_evaluate[{i}].{name}", name, value)
    if cfg.warm_start is not None:
        from rayhpc.tune.warm_start import check_warm_start  # only warm-started sweeps

        check_warm_start(cfg.warm_start)
    return cfg, sample_configs(space, 1, "random", cfg.seed, task.hp_model, cfg.defaults(task.hp_model))[0]


def _point(text: str) -> dict:
    out = {}
    for item in text.split(";"):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{text!r}: expected KEY=VALUE;KEY=VALUE, e.g. lr=0.01;hidden=16")
        out[key.strip()] = yaml.safe_load(value)
    return out


def bind_objectives(cfg: SweepConfig, info):
    """The task check's `info` with the sweep's first objective as its objective (the one every
    single-valued ranking uses); every objective and constraint checked against what the task reports."""
    reported = ["train_loss"] + (["val_loss", *(f"val_{m}" for m in info.metric_names)] if info.has_val else [])
    objectives = cfg.objectives or [info.objective]
    check_names(objectives, cfg.constraint_list, reported)
    return dataclasses.replace(info, objective=objectives[0])


def check_batches(cfg: SweepConfig) -> None:
    """batch_size is the global batch: it must split evenly over the workers of a trial, and each worker's
    share into `accumulate` micro-batches."""
    sizes, micro = (_values(cfg, key) for key in ("batch_size", "accumulate"))
    if (sizes is None and cfg.workers_per_trial > 1) or (sizes is None and micro != [1]) or micro is None:
        raise ConfigError("space.batch_size, space.accumulate: with several workers per trial or micro-batches, "
                          "give them as choice or grid")
    # the key the value came from: the space's, or the sweep's constant
    size_key = "space.batch_size" if "batch_size" in cfg.space else "global_batch_size (--global-batch-size)"
    micro_key = "space.accumulate" if "accumulate" in cfg.space else "accumulate (--accumulate)"
    for size in sizes or []:
        if int(size) % cfg.workers_per_trial:
            raise ConfigError(f"{size_key}: {size} is not divisible by workers_per_trial "
                              f"(--workers-per-trial) {cfg.workers_per_trial}")
        share = int(size) // cfg.workers_per_trial
        if bad := [a for a in micro if share % int(a)]:
            raise ConfigError(f"{micro_key}: {bad[0]} does not divide the batch per worker {share} "
                              f"({size_key} {size} over {cfg.workers_per_trial} worker(s))")


def _values(cfg: SweepConfig, key: str) -> list | None:
    """Every value the space may give `key` (its default where it gives none); None for a randint."""
    spec = cfg.space.get(key, cfg.constants[key])
    if isinstance(spec, ParamSpec):
        return None if spec.kind in ("randint", "lograndint") else list(spec.args)
    return [spec]
