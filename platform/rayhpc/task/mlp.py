"""The built-in task (`--task mlp`, the default): the seed documents' MLP on the synthetic task or a
Parquet file, configured by the job's `data:` section (`--data FILE.parquet --target y`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch.utils.data import TensorDataset

from rayhpc.data import DataConfig, mlp_tensors
from rayhpc.models import MLP
from rayhpc.task.api import Task


class MLPHParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hidden: int = Field(4, ge=1, description="width of every hidden layer (the seed documents' 4)")
    depth: int = Field(2, ge=1, description="Linear layers (2: Linear -> ReLU -> Linear)")


class MLPTask(Task):
    """`Linear -> ReLU -> ... -> Linear`, inputs and outputs as wide as the data's features and targets,
    trained with the mean squared error."""

    hparams = MLPHParams
    val_fraction = 0.2
    space = {"hidden": {"choice": [4, 8, 16, 32, 64]}, "lr": {"loguniform": [1e-3, 1e-1]}}

    def __init__(self, data: DataConfig | None = None):
        self.data_cfg = data or DataConfig()
        self._tensors = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tensors is None:  # read once per process
            self._tensors = mlp_tensors(self.data_cfg)
        return self._tensors

    def data(self, hp: dict):
        return TensorDataset(*self.tensors()), None

    def model(self, hp: dict) -> MLP:
        x, y = self.tensors()
        return MLP(x.shape[1], hp["hidden"], y.shape[1], hp["depth"])

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).float(), y)  # .float(): an FSDP bf16 policy returns bf16 outputs

    def tp_divisible(self, hp: dict) -> dict:
        """Tensor parallelism splits the hidden layers' width (there is none at depth 1)."""
        return {"hidden": hp["hidden"]} if hp["depth"] > 1 else {}

    def tp_plan(self, model: MLP) -> dict:
        """Megatron-style, over the Linear layers of `model` (or of the pipeline stage it holds): column-
        and row-parallel in turn, so each pair needs one all-reduce and the ReLU between works on local
        shards; a last column-parallel layer (an odd count) gathers its output, so the model (or
        stage) returns a whole tensor."""
        from torch.distributed.tensor import Replicate  # DTensor: about 0.7 s to import, only where a run shards
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        plan = {}
        for i, name in enumerate(names):
            if i % 2:
                plan[name] = RowwiseParallel()
            elif i == len(names) - 1:
                plan[name] = ColwiseParallel(output_layouts=Replicate())
            else:
                plan[name] = ColwiseParallel()
        return plan

    def pipeline_split(self, model: MLP) -> list[str]:
        """A pipeline stage may begin at any Linear layer after the first."""
        return [f"layers.{i}" for i, m in enumerate(model.layers) if isinstance(m, torch.nn.Linear)][1:]

    def __getstate__(self):  # every process reads the data itself; the pickle carries the settings only
        return {**self.__dict__, "_tensors": None}
