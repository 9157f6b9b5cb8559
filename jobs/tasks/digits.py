"""A small CNN classifier on the 8x8 handwritten digits that scikit-learn ships inside its wheel
(1,797 images, no download; `pip install 'rayhpc[examples]'`), with accuracy as a metric.

    python jobs/tune_mlp.py --task jobs/tasks/digits.py:DigitsCNN --num-samples 16 --epochs 10
    python jobs/train_mlp.py --task jobs/tasks/digits.py:DigitsCNN --strategy fsdp --hp channels=16
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

# images held out for validation (a fixed, seeded 20%): the 1,440 left for training divide evenly over
# 2, 4, ..., 32 ranks, so DistributedSampler pads no rank's shard with repeated images
VAL = 357


class DigitsCNN:
    """Two 3x3 convolutions, a 2x2 max-pool, dropout and a linear classifier; cross-entropy loss."""

    hparams = {"channels": 8, "dropout": 0.0}
    objective = ("val_accuracy", "max")
    space = {"channels": {"choice": [4, 8, 16]}, "lr": {"loguniform": [1e-3, 3e-2]},
             "dropout": {"choice": [0.0, 0.25]}}

    def data(self, hp):
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise ImportError("the digits task needs scikit-learn: pip install 'rayhpc[examples]'") from None
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [1797, 1, 8, 8] in [0, 1]
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        train, val = order[VAL:], order[:VAL]
        return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])

    def model(self, hp):
        c = hp["channels"]
        return nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(),
            nn.Dropout(hp["dropout"]),
            nn.Linear(2 * c * 4 * 4, 10),
        )

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def metrics(self, model, batch):
        x, y = batch
        return {"accuracy": (model(x).argmax(dim=1) == y).float().mean()}
