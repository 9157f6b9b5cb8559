"""The built-in task's data and loss on a model with BatchNorm in each half: a pipeline of two stages (split at
`layers.3`) holds one in each, whose running statistics training updates and validation uses."""

from torch import nn

from rayhpc.task.mlp import MLPTask


class BatchNormNet(nn.Module):
    def __init__(self, inputs: int, width: int, outputs: int):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(inputs, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width),
                                    nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, outputs))

    def forward(self, x):
        return self.layers(x)


class BatchNormMLP(MLPTask):
    def model(self, hp):
        x, y = self.tensors()
        return BatchNormNet(x.shape[1], hp["hidden"], y.shape[1])

    def pipeline_split(self, model):
        return ["layers.3"]
