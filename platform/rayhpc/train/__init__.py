"""Data-parallel training with Ray Train's TorchTrainer: `run_training(TrainConfig(...))`.

DDP or FSDP2 workers, NCCL on GPUs and gloo on CPUs, checkpoints that survive
worker loss and driver restarts, and a per-epoch metrics record.
"""

from typing import Any

__all__ = ["TrainConfig", "run_training"]


def __getattr__(name: str) -> Any:
    if name == "TrainConfig":
        from rayhpc.train.config import TrainConfig  # as rayhpc.tune: nothing heavy with the package

        return TrainConfig
    if name == "run_training":
        from rayhpc.train.trainer import run_training  # Ray Train and torch: only when a run starts

        return run_training
    raise AttributeError(f"module 'rayhpc.train' has no attribute {name!r}")
