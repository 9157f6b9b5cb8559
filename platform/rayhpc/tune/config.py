"""The sweep's config tree and its command-line flags (the CLI overrides `--config FILE`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rayhpc.config import ConfigError, StrictModel, load_yaml, merge, validate
from rayhpc.data import DataConfig
from rayhpc.tune.space import Space, check_space, parse_space

DEFAULT_SPACE = {
    "hidden": {"choice": [4, 8, 16, 32, 64]},
    "lr": {"loguniform": [1e-3, 1e-1]},
}


class AshaConfig(StrictModel):
    """Early stopping with ASHA (`scheduler: asha`)."""

    grace_period: int = Field(1, ge=1, description="epochs every trial runs before it may be stopped")
    reduction_factor: float = Field(2.0, gt=1, description="at each rung keep the best 1/reduction_factor")


class SweepConfig(StrictModel):
    """A hyperparameter sweep of the two-layer MLP."""

    name: str = Field("mlp-sweep", pattern=r"^[A-Za-z0-9_.=-]+$", description="sweep folder under storage_path")
    storage_path: Path = Field(Path("rayhpc_results"), description="where sweeps are kept (relative: to the working dir)")
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
    max_failures: int = Field(2, ge=0, description="retries of a trial whose process dies, from its checkpoint")
    seed: int = Field(0, description="seeds sampling, model initialisation and data order")
    resume: bool = Field(False, description="continue the sweep of this name")
    address: str | None = Field(None, description="Ray cluster to join; unset: RAY_ADDRESS, else local Ray")
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
        return self

    @property
    def experiment_dir(self) -> Path:
        return self.storage_path.resolve() / self.name

    def saved(self) -> dict:
        """The fields that define the sweep, as written next to its results for `--resume`."""
        return self.model_dump(mode="json", exclude={"resume", "address", "storage_path"}, exclude_none=True)


# flag -> config key; every flag defaults to None so that unset flags leave the YAML value
FLAGS = {
    "--name": "name", "--storage-path": "storage_path", "--num-samples": "num_samples",
    "--max-concurrent": "max_concurrent", "--cpus-per-trial": "cpus_per_trial",
    "--gpus-per-trial": "gpus_per_trial", "--epochs": "epochs", "--search": "search",
    "--scheduler": "scheduler", "--pack": "pack", "--max-failures": "max_failures", "--seed": "seed",
    "--address": "address", "--data": "data.path",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML sweep file; flags override its values")
    for flag, key in FLAGS.items():
        field = _field(key)
        parser.add_argument(flag, metavar=key.split(".")[-1].upper(), help=field.description)
    parser.add_argument("--target", metavar="COL[,COL]", help="target column(s) of --data (default: target)")
    parser.add_argument("--resume", action="store_true", default=None, help="continue the sweep of this --name")


def from_args(args: argparse.Namespace) -> tuple[SweepConfig, set[str]]:
    """The validated config, and the keys the user set explicitly (YAML or flags)."""
    data = load_yaml(args.config) if args.config else {}
    overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key in FLAGS.items()}
    overrides["data.target"] = args.target.split(",") if args.target else None
    overrides["resume"] = args.resume
    overrides = {k: v for k, v in overrides.items() if v is not None}
    merged = merge(data, overrides)
    flags = {key: flag for flag, key in FLAGS.items() if key in overrides}
    if "data.target" in overrides:
        flags["data.target"] = "--target"
    return validate(SweepConfig, merged, flags), _keys(merged)


def reconcile_resume(cfg: SweepConfig, explicit: set[str]) -> SweepConfig:
    """Refuse to clobber an existing sweep; on `--resume` use its saved definition.

    Values the user gave explicitly must agree with the saved ones: a resumed
    sweep cannot change what its trials are.
    """
    saved_file = cfg.experiment_dir / "sweep.yaml"
    if not cfg.resume:
        if saved_file.exists():
            raise ConfigError(f"name (--name) {cfg.name}: a sweep already exists at {cfg.experiment_dir}; "
                              "pass --resume to continue it or choose another --name")
        return cfg
    if not saved_file.exists():
        return cfg
    saved = validate(SweepConfig, load_yaml(saved_file))
    now, before = cfg.saved(), saved.saved()
    for key in sorted(explicit):
        if key.split(".")[0] in before and _get(now, key) != _get(before, key):
            raise ConfigError(f"{key}: {_get(now, key)!r} differs from the resumed sweep's {_get(before, key)!r}; "
                              "drop it to resume, or start a new --name")
    return saved.model_copy(update={"resume": True, "address": cfg.address, "storage_path": cfg.storage_path})


def _field(key: str):
    model: Any = SweepConfig
    *parents, leaf = key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation
    return model.model_fields[leaf]


def _keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        if isinstance(v, dict) and k != "space":
            out |= _keys(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d
