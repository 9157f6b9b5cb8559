"""The model-parallel training job's config tree: degrees, pipeline schedule, model and data."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rayhpc.config import Compute, ConfigError, JobConfig, StrictModel
from rayhpc.data import DataConfig
from rayhpc.parallel.mesh import Degrees


class ModelSpec(StrictModel):
    """The MLP (Linear -> ReLU -> ... -> Linear, in/out widths from the data) or a transformer stack."""

    kind: Literal["mlp", "transformer"] = Field("mlp", description="mlp, or transformer blocks",
                                                json_schema_extra={"flag": "--model"})
    hidden: int = Field(32, ge=1, description="MLP width; transformer feed-forward width")
    depth: int = Field(4, ge=1, description="Linear layers (mlp) or blocks (transformer)")
    dim: int = Field(16, ge=1, description="transformer model width")
    heads: int = Field(4, ge=1, description="transformer attention heads")
    tokens: int = Field(8, ge=1, description="transformer sequence length")

    def build(self, in_features: int, out_features: int):
        """The whole model, initialised from torch's current RNG state (seed it first)."""
        from rayhpc.models import MLP, Transformer

        if self.kind == "mlp":
            return MLP(in_features, self.hidden, out_features, self.depth)
        return Transformer(self.dim, self.heads, self.hidden, self.depth)


class ParallelCompute(Compute):
    num_workers: int | None = Field(None, ge=1, description="world size; must equal dp * pp * tp (the default)")


class ParallelConfig(JobConfig):
    """Tensor- and pipeline-parallel (and data-parallel) training on the platform's worker group."""

    kind: ClassVar[str] = "parallel"
    name: str = Field("mlp-parallel", pattern=r"^[A-Za-z0-9_.=-]+$", description="run folder under storage_path")
    task: str | None = Field(None, description="FILE.py:NAME or package.module:NAME: the model, data and loss, with "
                             "tp_plan and pipeline_split; unset: the built-in model section")
    hparams: dict[str, Any] = Field({}, description="the task's own hyperparameters, e.g. dim=128,layers=4",
                                    json_schema_extra={"flag": "--hp"})
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="torch.optim.SGD or Adam (its state is sharded "
                                              "and checkpointed with the weights)")
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree (stages)")
    dp: int = Field(1, ge=1, description="data-parallel degree (FSDP2 replicas)")
    compute: ParallelCompute = ParallelCompute()
    microbatches: int | None = Field(None, ge=1, description="pipeline microbatches per step (default: pp)")
    schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv"] = Field(
        "gpipe", description="pipeline schedule: gpipe, 1f1b (one stage per rank); interleaved1f1b, interleavedzb "
        "(zero bubble, ZB1P), zbv (zero bubble, V-shaped): several stages per rank")
    stages_per_rank: int | None = Field(None, ge=1, description="pipeline stages each rank holds (default: 1; 2 "
                                        "for interleaved1f1b, interleavedzb, zbv)")
    precision: Literal["fp32", "tf32", "bf16"] = Field("tf32", description="fp32; tf32: fp32 with TF32 matmuls on "
                                                       "GPUs (as fp32 on CPUs); bf16: autocast mixed precision")
    steps: int = Field(20, ge=1, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="global batch: samples per step over all replicas")
    lr: float = Field(0.3, gt=0, description="SGD learning rate")
    checkpoint_every: int | None = Field(None, ge=1, description="save a sharded checkpoint every K steps")
    eval_every: int | None = Field(None, ge=1, description="validation loss every K steps (always after the last "
                                   "step, when the task has validation data)")
    timeout_s: float = Field(120.0, gt=0, description="longest wait for any rank before the run fails")
    seed: int = Field(0, description="seeds initialisation and the data order")
    model: ModelSpec = ModelSpec()
    data: DataConfig = DataConfig()

    @property
    def degrees(self) -> Degrees:
        return Degrees(pp=self.pp, dp=self.dp, tp=self.tp)

    @property
    def world_size(self) -> int:
        return self.compute.num_workers or self.degrees.world_size

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp

    @property
    def per_rank_stages(self) -> int:
        from rayhpc.parallel.pp import default_stages_per_rank

        return self.stages_per_rank or default_stages_per_rank(self.schedule)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (1 without pipeline parallelism)."""
        return self.pp * self.per_rank_stages if self.pp > 1 else 1

    @field_validator("task")
    @classmethod
    def _absolute(cls, spec: str | None) -> str | None:
        from rayhpc.task.load import absolute_spec

        return absolute_spec(spec) if spec is not None else None

    @model_validator(mode="after")
    def _check(self) -> "ParallelConfig":
        try:
            self.degrees.check(self.world_size)
        except ConfigError as exc:
            raise ConfigError(f"compute.num_workers (--num-workers) {self.compute.num_workers}: {exc}") from None
        self._check_schedule()
        if self.task is None and self.n_stages > self.model.depth:
            raise ConfigError(f"pp (--pp) {self.pp}: {self.n_stages} pipeline stages ({self.per_rank_stages} per rank) "
                              f"are more than the model's {self.model.depth} layers (model.depth, --depth)")
        if self.batch_size % self.dp:
            raise ConfigError(f"batch_size (--batch-size) {self.batch_size}: not divisible by dp (--dp) {self.dp}")
        per_replica = self.batch_size // self.dp
        if per_replica % self.n_microbatches:
            raise ConfigError(f"microbatches (--microbatches) {self.n_microbatches}: do not divide the per-replica "
                              f"batch {per_replica} (batch_size {self.batch_size} / dp {self.dp})")
        if self.task is not None:  # the task's plan is checked on its model (`rayhpc.parallel.recipe`)
            return self
        if self.hparams:
            raise ConfigError("hparams (--hp): only with a task (--task); the built-in model takes model.* keys")
        if self.model.kind == "transformer":
            self._check_transformer()
        return self

    def _check_schedule(self) -> None:
        from rayhpc.parallel.pp import SCHEDULES, allows

        m, per_rank = self.n_microbatches, self.per_rank_stages
        if not allows(self.schedule, per_rank):
            fits = [name for name in SCHEDULES if allows(name, per_rank)]
            raise ConfigError(f"stages_per_rank (--stages-per-rank) {per_rank}: schedule {self.schedule} runs "
                              f"{SCHEDULES[self.schedule][2]} per rank; for {per_rank}: {', '.join(fits)}")
        if self.pp == 1:
            return
        if self.schedule == "1f1b" and m < self.pp:
            raise ConfigError(f"microbatches (--microbatches) {m}: schedule 1f1b needs at least one per stage "
                              f"(pp {self.pp})")
        rounds = max(1, m // self.pp)  # torch's interleaved schedules run m in rounds of about pp
        if self.schedule in ("interleaved1f1b", "interleavedzb") and m % rounds:
            raise ConfigError(f"microbatches (--microbatches) {m}: schedule {self.schedule} runs them in "
                              f"max(1, m // pp {self.pp}) = {rounds} rounds, which must divide them; e.g. "
                              f"{self.pp}, {2 * self.pp} or {4 * self.pp}")

    def _check_transformer(self) -> None:
        m = self.model
        if m.dim % m.heads:
            raise ConfigError(f"model.dim (--dim) {m.dim}: not divisible by model.heads (--heads) {m.heads}")
        for key, value in (("model.heads (--heads)", m.heads), ("model.hidden (--hidden)", m.hidden)):
            if value % self.tp:
                raise ConfigError(f"{key} {value}: not divisible by tp (--tp) {self.tp}")

    def check_mlp_widths(self, in_features: int, out_features: int) -> None:
        """Every width that tensor parallelism splits must divide by tp (known once the data is)."""
        from rayhpc.parallel.pp import stage_ranges

        widths = [in_features] + [self.model.hidden] * (self.model.depth - 1) + [out_features]
        for stage in stage_ranges(self.model.depth, self.n_stages):
            for i, layer in enumerate(stage):  # column-parallel splits outputs, row-parallel inputs
                dim = layer + 1 if i % 2 == 0 else layer
                if widths[dim] % self.tp:
                    key = "model.hidden (--hidden)" if 0 < dim < len(widths) - 1 else "the data's target width"
                    raise ConfigError(f"{key} {widths[dim]}: not divisible by tp (--tp) {self.tp}")
