"""The scaling study's config."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from rayhpc.config import JobConfig, PerWorker
from rayhpc.data import DataConfig


class ScalingConfig(JobConfig):
    """DDP training at each worker count: strong (fixed global batch) and weak (fixed per-worker batch)."""

    kind: ClassVar[str] = "scaling"
    name: str = Field("scaling", pattern=r"^[A-Za-z0-9_.=-]+$", description="results folder under storage_path")
    workers: list[int] = Field([1, 2], description="worker counts to run, e.g. 1,2,4,8")
    modes: list[Literal["strong", "weak"]] = Field(["strong", "weak"], description="strong, weak or both")
    global_batch_size: int = Field(512, ge=1, description="strong scaling: samples per step over all workers")
    batch_size_per_worker: int = Field(128, ge=1, description="weak scaling: samples per step on each worker")
    epochs: int = Field(3, ge=2, description="epochs per run; the first is warm-up and not measured")
    steps_per_epoch: int | None = Field(50, ge=1, description="optimizer steps per epoch in every run: the "
                                        "synthetic data is sized to give them (a few steps per epoch would time "
                                        "start-up noise); unset, or a --data file: the data as it is")
    hidden: int = Field(256, ge=1, description="MLP width (a wider model computes more per byte communicated)")
    depth: int = Field(3, ge=2, description="MLP Linear layers")
    compute: PerWorker = PerWorker()
    data: DataConfig = DataConfig()

    @field_validator("workers")
    @classmethod
    def _counts(cls, v: list[int]) -> list[int]:
        if not v or any(n < 1 for n in v):
            raise ValueError(f"{v}: worker counts must be at least 1")
        return sorted(set(v))
