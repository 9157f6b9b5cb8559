"""The parameter-server job's config tree (flags are derived from it in `rayhpc.cli`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rayhpc.config import Compute, ConfigError
from rayhpc.train.config import DataParallelJob


class PSCompute(Compute):
    """Workers (as in every job) and the servers the parameters are sharded over."""

    num_servers: int = Field(1, ge=1, description="parameter-server actors; the parameters are balanced over them "
                             "by size")
    cpus_per_server: float = Field(0.0, ge=0, description="CPUs each server reserves (0: none; a server mostly "
                                   "waits, and applies the optimizer between pushes)")


class PSConfig(DataParallelJob):
    """Training with a sharded parameter server: workers pull parameters and push gradients."""

    kind: ClassVar[str] = "ps"
    uploads_weights: ClassVar[bool] = False  # sharded: tracking.log_checkpoint is refused
    mode: Literal["sync", "async"] = Field("sync", description="sync: servers average the workers' gradients of a "
                                           "step, then step the optimizer once (= DDP); async: Downpour, each "
                                           "gradient applied as it arrives")
    staleness: int | None = Field(None, ge=0, description="async: a worker runs at most K steps ahead of the "
                                  "slowest (unset: unbounded)")
    compute: PSCompute = PSCompute()
    timeout_s: float = Field(120.0, gt=0, description="longest wait for a pull, a push or a worker's start")

    @model_validator(mode="after")
    def _mode(self) -> "PSConfig":
        if self.staleness is not None and self.mode == "sync":
            raise ConfigError(f"staleness (--staleness) {self.staleness}: only for mode async (--mode async); "
                              "sync steps every worker together")
        # sync clips the step's mean gradient (= DDP); async applies each worker's gradient alone, as it arrives
        if self.optim.clip_grad_norm is not None and self.mode == "async":
            raise ConfigError(f"optim.clip_grad_norm (--clip-grad-norm) {self.optim.clip_grad_norm}: only for mode "
                              "sync, which clips each step's mean gradient as DDP does; async applies every "
                              "worker's gradient alone")
        return self
