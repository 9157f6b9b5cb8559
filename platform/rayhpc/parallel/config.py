"""The model-parallel training job's config tree: the shared task, optimizer and schedule sections, and
the degrees and pipeline schedule (`parallelism:`)."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rayhpc.config import (
    Compute,
    ConfigError,
)
from rayhpc.parallel.mesh import Degrees
from rayhpc.task.batches import epoch_steps
from rayhpc.task.config import TrainingJob


class ParallelCompute(Compute):
    num_workers: int | None = Field(None, ge=1, description="world size; must equal dp * fsdp * pp * tp (the "
                                    "default)")


class Parallelism(Degrees):
    """The degrees (pp x dp x fsdp x tp, their product the world size) and the pipeline's schedule."""

    schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv"] = Field(
        "gpipe", description="pipeline schedule: gpipe, 1f1b (one stage per rank); interleaved1f1b, interleavedzb "
        "(zero bubble, ZB1P), zbv (zero bubble, V-shaped): several stages per rank")
    microbatches: int | None = Field(None, ge=1, description="pipeline microbatches per schedule step (default: pp)")
    stages_per_rank: int | None = Field(None, ge=1, description="pipeline stages each rank holds (default: 1; 2 "
                                        "for interleaved1f1b, interleavedzb, zbv)")

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp

    @property
    def per_rank_stages(self) -> int:
        # torch's pipelining (about 1 s): not for checking a config
        from rayhpc.parallel.pp import default_stages_per_rank

        return self.stages_per_rank or default_stages_per_rank(self.schedule)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (1 without pipeline parallelism)."""
        return self.pp * self.per_rank_stages if self.pp > 1 else 1


class ParallelConfig(TrainingJob):
    """Tensor- and pipeline-parallel (and data-parallel) training of a task on the platform's worker group:
    the same `optim:`, `schedule:` and task sections as every job, and a `parallelism:` section."""

    kind: ClassVar[str] = "parallel"
    uploads_weights: ClassVar[bool] = False  # sharded: tracking.log_checkpoint is refused
    parallelism: Parallelism = Parallelism()
    compute: ParallelCompute = ParallelCompute()
    eval_every: int | None = Field(None, ge=1, description="validation loss every K steps (always after the last "
                                   "step, when the task has validation data)")
    timeout_s: float = Field(120.0, gt=0, description="longest wait for any rank before the run fails")

    @property
    def world_size(self) -> int:
        return self.compute.num_workers or self.parallelism.world_size

    @property
    def global_batch(self) -> int:
        return self.global_batch_size

    @property
    def effective_lr(self) -> float:
        return self.optim.lr

    @property
    def replica_batch(self) -> int:
        """Samples per data-parallel replica in one optimizer step (a whole one)."""
        return self.global_batch_size // self.parallelism.replicas

    @property
    def micro_batch(self) -> int:
        """Samples per replica in one forward/backward (one schedule step under a pipeline)."""
        return self.replica_batch // self.accumulate

    def steps_per_epoch(self, n_train: int) -> int:
        """Optimizer steps of one epoch: each replica's DistributedSampler share in batches, the last partial."""
        return epoch_steps(n_train, self.replica_batch, self.parallelism.replicas)

    def with_steps(self, n_train: int) -> "ParallelConfig":
        """This config with `steps` set: as given, else from `epochs` over `n_train` samples; a
        pipeline's last batch of an epoch checked to split into its equal microbatches."""
        p, per_epoch = self.parallelism, self.steps_per_epoch(n_train)
        steps = self.steps or self.epochs * per_epoch
        tail = math.ceil(n_train / p.replicas) - (per_epoch - 1) * self.replica_batch
        parts = self.accumulate * p.n_microbatches
        if p.pp > 1 and tail % parts and steps >= per_epoch:
            raise ConfigError(
                f"global_batch_size (--global-batch-size) {self.global_batch_size}: an epoch of {n_train} training "
                f"samples ends with a batch of {tail} per replica, which the pipeline cannot split into accumulate "
                f"{self.accumulate} x parallelism.microbatches {p.n_microbatches} equal microbatches; choose a batch "
                f"that divides {math.ceil(n_train / p.replicas)} per replica, or a multiple of {parts} samples left, "
                f"or --steps below an epoch's {per_epoch}")
        return self.model_copy(update={"steps": steps})

    @model_validator(mode="after")
    def _check(self) -> "ParallelConfig":
        p = self.parallelism
        try:
            p.check(self.world_size)
        except ConfigError as exc:
            raise ConfigError(f"compute.num_workers (--num-workers) {self.compute.num_workers}: {exc}") from None
        self._check_schedule()
        shares = f"dp {p.dp} x fsdp {p.fsdp}"  # the data-parallel ranks, each with its share of the batch
        if self.global_batch_size % p.replicas:
            raise ConfigError(f"global_batch_size (--global-batch-size) {self.global_batch_size}: not divisible by "
                              f"the {p.replicas} data-parallel ranks, parallelism.dp (--dp) {p.dp} x parallelism.fsdp "
                              f"(--fsdp) {p.fsdp}")
        per_replica = self.global_batch_size // p.replicas
        if per_replica % self.accumulate:
            raise ConfigError(f"accumulate (--accumulate) {self.accumulate}: does not divide the per-replica batch "
                              f"{per_replica} (global_batch_size {self.global_batch_size} / {shares}) into equal "
                              "micro-batches")
        if self.micro_batch % p.n_microbatches:
            raise ConfigError(f"parallelism.microbatches (--microbatches) {p.n_microbatches}: do not divide the "
                              f"per-replica micro-batch {self.micro_batch} (global_batch_size {self.global_batch_size}"
                              f" / {shares} / accumulate {self.accumulate})")
        return self

    def _check_schedule(self) -> None:
        from rayhpc.parallel.pp import SCHEDULES, allows  # torch's pipelining (about 1 s): not for checking a config

        p = self.parallelism
        m, per_rank = p.n_microbatches, p.per_rank_stages
        if not allows(p.schedule, per_rank):
            fits = [name for name in SCHEDULES if allows(name, per_rank)]
            raise ConfigError(f"parallelism.stages_per_rank (--stages-per-rank) {per_rank}: schedule {p.schedule} "
                              f"runs {SCHEDULES[p.schedule][2]} per rank; for {per_rank}: {', '.join(fits)}")
        if p.pp == 1:
            return
        if p.schedule == "1f1b" and m < p.pp:
            raise ConfigError(f"parallelism.microbatches (--microbatches) {m}: schedule 1f1b needs at least one per "
                              f"stage (pp {p.pp})")
        rounds = max(1, m // p.pp)  # torch's interleaved schedules run m in rounds of about pp
        if p.schedule in ("interleaved1f1b", "interleavedzb") and m % rounds:
            raise ConfigError(f"parallelism.microbatches (--microbatches) {m}: schedule {p.schedule} runs them in "
                              f"max(1, m // pp {p.pp}) = {rounds} rounds, which must divide them; e.g. "
                              f"{p.pp}, {2 * p.pp} or {4 * p.pp}")
