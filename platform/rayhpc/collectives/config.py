"""The collectives benchmark's config."""

from __future__ import annotations

import re
from typing import ClassVar

from pydantic import Field, field_validator

from rayhpc.collectives.primitives import PRIMITIVES
from rayhpc.config import Compute, JobConfig

UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """`4096`, `64KiB`, `16MiB`, `1GiB` -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size: expected bytes or a number with KiB, MiB or GiB, e.g. 16MiB")
    return int(match.group(1)) * UNITS[(match.group(2) or "").upper()]


class CollectivesConfig(JobConfig):
    """Time each primitive over message sizes 1 KiB .. max_size (powers of two) on a worker group."""

    kind: ClassVar[str] = "collectives"
    name: str = Field("collectives", pattern=r"^[A-Za-z0-9_.=-]+$", description="results folder under storage_path")
    compute: Compute = Compute()
    max_size: int = Field(4 * 2**20, description="largest message (bytes, or e.g. 16MiB); sizes from 1 KiB double")
    primitives: list[str] = Field(list(PRIMITIVES), description="primitives to run")
    iters: int = Field(20, ge=1, description="timed repetitions per size")
    warmup: int = Field(3, ge=0, description="untimed repetitions before timing")
    timeout_s: float = Field(300.0, gt=0, description="longest wait for any rank")

    @field_validator("max_size", mode="before")
    @classmethod
    def _size(cls, v):
        size = parse_size(v)
        if size < 1024:
            raise ValueError(f"{v!r}: at least 1KiB")
        return size

    @field_validator("primitives")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = [p for p in v if p not in PRIMITIVES]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: expected some of {', '.join(PRIMITIVES)}")
        return v

    @field_validator("compute")
    @classmethod
    def _ranks(cls, compute: Compute) -> Compute:
        if compute.num_workers < 2:
            raise ValueError(f"num_workers {compute.num_workers}: a collective needs at least 2 ranks")
        return compute

    @property
    def sizes(self) -> list[int]:
        return [2**p for p in range(10, self.max_size.bit_length()) if 2**p <= self.max_size]
