"""The job's `data:` section, and the built-in MLP task's data: a learnable synthetic task or a Parquet file.

The synthetic task keeps the seed documents' shapes (6 features in, 2 targets
out, generator seed 12345) but, unlike their `RandomTensorDataset`, its
targets are a fixed function of the inputs (a random "teacher" MLP plus a
little noise), so a model can learn it and a sweep can tell configs apart.
Other tasks load their own data (`data(hp)`); of this section they use only
`val_fraction` and `split_seed`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field, field_validator

from rayhpc.config import ConfigError, StrictModel


class SyntheticTask(StrictModel):
    """Targets y = teacher(x) + noise, with x ~ N(0, I)."""

    num_samples: int = Field(2048, ge=2, description="rows in the dataset (train + validation)")
    in_features: int = Field(6, ge=1, description="input width (the seed MLP's 6)")
    out_features: int = Field(2, ge=1, description="target width (the seed MLP's 2)")
    teacher_hidden: int = Field(16, ge=1, description="hidden width of the teacher MLP")
    noise: float = Field(0.05, ge=0, description="std of Gaussian noise added to targets")
    seed: int = Field(12345, description="generator seed (the seed documents' dataset seed)")


class DataConfig(StrictModel):
    """The validation hold-out (every task), and where the built-in MLP task's data comes from."""

    path: Path | None = Field(None, description="mlp task: a Parquet file; unset: the synthetic task",
                              json_schema_extra={"flag": "--data"})
    target: list[str] = Field(["target"], min_length=1, description="mlp task: target column(s) of the Parquet file")
    features: list[str] | None = Field(None, description="mlp task: feature columns; unset: every other column")
    val_fraction: float | None = Field(None, gt=0, lt=1, description="share of the training data held out for "
                                       "validation when the task gives no validation set; unset: the task's own "
                                       "default (mlp: 0.2; else no validation)")
    split_seed: int = Field(0, description="seed of the train/validation split permutation")
    synthetic: SyntheticTask = SyntheticTask()

    def mlp_only(self) -> list[str]:
        """The keys set here that only the built-in MLP task reads."""
        default = DataConfig()
        return [k for k in ("path", "target", "features", "synthetic") if getattr(self, k) != getattr(default, k)]

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        # absolute, so that a resumed job started from another directory reads the same file
        return path.expanduser().resolve() if path is not None else None


def mlp_tensors(cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of the MLP task's data, as float32 (features, targets)."""
    return synthetic_tensors(cfg.synthetic) if cfg.path is None else read_parquet(cfg)


def synthetic_tensors(task: SyntheticTask) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(task.seed)
    x = torch.randn(task.num_samples, task.in_features, generator=g)
    w1 = torch.randn(task.in_features, task.teacher_hidden, generator=g) / task.in_features**0.5
    w2 = torch.randn(task.teacher_hidden, task.out_features, generator=g) / task.teacher_hidden**0.5
    y = torch.tanh(x @ w1) @ w2 + task.noise * torch.randn(task.num_samples, task.out_features, generator=g)
    return x, y


def read_parquet(cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature and target columns of a Parquet file as float32 tensors, or a one-line error."""
    import pyarrow.parquet as pq  # Parquet data only

    path = cfg.path
    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as exc:  # missing file, not Parquet, truncated...
        raise ConfigError(f"data.path (--data) {path}: cannot read as Parquet: {exc}") from None
    columns = list(schema.names)
    missing = [c for c in cfg.target if c not in columns]
    if missing:
        raise ConfigError(
            f"data.target (--target) {path}: no column {missing[0]!r}; columns are {', '.join(columns) or 'none'}"
        )
    features = cfg.features or [c for c in columns if c not in cfg.target]
    absent = [c for c in features if c not in columns]
    if absent:
        raise ConfigError(f"data.features {path}: no column {absent[0]!r}; columns are {', '.join(columns)}")
    if not features:
        raise ConfigError(f"data.features {path}: no feature columns besides the target {cfg.target}")
    try:
        table = pq.read_table(path, columns=features + list(cfg.target))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.path (--data) {path}: cannot read as Parquet: {exc}") from None
    if table.num_rows < 2:
        raise ConfigError(f"data.path (--data) {path}: {table.num_rows} rows; need at least 2 to hold out a validation split")
    x = _numeric_matrix(table, features, path)
    y = _numeric_matrix(table, list(cfg.target), path)
    return x, y


def _numeric_matrix(table, names: list[str], path: Path) -> torch.Tensor:
    import pyarrow as pa  # Parquet data only

    cols = []
    for name in names:
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_boolean(column.type)):
            raise ConfigError(f"data {path}: column {name!r} has type {column.type}; features and targets must be numeric")
        if column.null_count:
            raise ConfigError(f"data {path}: column {name!r} has {column.null_count} missing values")
        cols.append(torch.from_numpy(column.to_numpy().astype("float32")))
    return torch.stack(cols, dim=1)
