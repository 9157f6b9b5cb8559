"""The data-parallel training job's config tree and its command-line flags."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rayhpc.config import ConfigError, JobConfig, StrictModel
from rayhpc.data import DataConfig


class ModelConfig(StrictModel):
    """The MLP: the seed documents' 6 -> 4 -> 2 by default; widen and deepen it to load a GPU."""

    hidden: int = Field(4, ge=1, description="width of every hidden layer")
    depth: int = Field(2, ge=1, description="number of Linear layers (2: Linear -> ReLU -> Linear)")


class TrainConfig(JobConfig):
    """Data-parallel training of the MLP with Ray Train's TorchTrainer (DDP or FSDP2)."""

    kind: ClassVar[str] = "train"
    name: str = Field("mlp-train", pattern=r"^[A-Za-z0-9_.=-]+$", description="run folder under storage_path")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="DistributedDataParallel, or FSDP2 fully_shard per layer")
    num_workers: int = Field(2, ge=1, description="training processes (ranks)")
    gpu: bool = Field(False, description="one GPU per worker and NCCL (else CPU and gloo)")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per worker (its torch threads)")
    epochs: int = Field(5, ge=1, description="passes over the training split")
    global_batch_size: int | None = Field(None, ge=1, description="samples per optimizer step over all workers")
    batch_size_per_worker: int | None = Field(None, ge=1, description="samples per step on each worker "
                                              "(default 32, the seed documents' batch per GPU)")
    lr: float = Field(0.05, gt=0, description="learning rate (before --scale-lr)")
    scale_lr: bool = Field(False, description="multiply lr by the number of workers (the Horovod convention)")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="torch.optim.SGD or Adam")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty added to the gradient")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto: bf16 mixed precision on GPU, "
                                                       "fp32 on CPU")
    checkpoint_every_steps: int | None = Field(None, ge=1, description="also checkpoint every K optimizer steps "
                                               "(always at the end of each epoch)")
    metrics_every_steps: int | None = Field(None, ge=1, description="also record a metrics row every K steps")
    max_failures: int = Field(2, ge=0, description="worker-group restarts from the latest checkpoint")
    seed: int = Field(0, description="seeds initialisation and the data order")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()

    @model_validator(mode="after")
    def _batch(self) -> "TrainConfig":
        if self.global_batch_size is not None and self.batch_size_per_worker is not None:
            raise ConfigError("global_batch_size (--global-batch-size) and batch_size_per_worker "
                              "(--batch-size-per-worker): give one, not both")
        if self.global_batch_size is not None and self.global_batch_size % self.num_workers:
            raise ConfigError(f"global_batch_size (--global-batch-size) {self.global_batch_size}: not divisible "
                              f"by num_workers (--num-workers) {self.num_workers}")
        return self

    @property
    def per_worker_batch(self) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size // self.num_workers
        return self.batch_size_per_worker or 32

    @property
    def global_batch(self) -> int:
        return self.per_worker_batch * self.num_workers

    @property
    def effective_lr(self) -> float:
        return self.lr * self.num_workers if self.scale_lr else self.lr

    @property
    def use_bf16(self) -> bool:
        return self.precision == "bf16" or (self.precision == "auto" and self.gpu)


FLAGS = {
    "--strategy": "strategy", "--num-workers": "num_workers", "--gpu": "gpu",
    "--cpus-per-worker": "cpus_per_worker", "--epochs": "epochs", "--global-batch-size": "global_batch_size",
    "--batch-size-per-worker": "batch_size_per_worker", "--lr": "lr", "--scale-lr": "scale_lr",
    "--optimizer": "optimizer", "--precision": "precision", "--checkpoint-every-steps": "checkpoint_every_steps",
    "--metrics-every-steps": "metrics_every_steps", "--max-failures": "max_failures", "--seed": "seed",
    "--hidden": "model.hidden", "--depth": "model.depth", "--name": "name", "--storage-path": "storage_path",
    "--address": "address", "--resume": "resume", "--data": "data.path", "--target": "data.target",
}
