"""The seed handbook's DDP listing (Listing 4.9 with the dataset of Listing 4.6) as a task: exactly
its dataset, its model (two Linear layers, no activation) and its loss.

    python jobs/train_mlp.py --task jobs/tasks/seed_listing.py:SeedListing --num-workers 2 \\
        --batch-size-per-worker 32 --optimizer sgd --lr 0.01 --epochs 1

trains what `torchrun --nproc_per_node 2 mlp_ddp.py` trains, with the same data order
(DistributedSampler, seed 0) and the same result (tests/ray/test_tasks.py checks the weights).
The listing has no validation set, so a run reports the training loss only.
"""

import torch
import torch.nn as nn
from torch.utils.data import Dataset


class RandomTensorDataset(Dataset):
    """Listing 4.6: random inputs and random targets, seeded."""

    def __init__(self, num_samples, in_shape, out_shape):
        self.num_samples = num_samples
        torch.manual_seed(12345)
        self.data = [(torch.randn(in_shape), torch.randn(out_shape)) for _ in range(num_samples)]

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        return self.data[idx]


class MLP(nn.Module):
    """Listing 4.9's model."""

    def __init__(self, in_feature, hidden_units, out_feature):
        super().__init__()
        self.hidden_layer = nn.Linear(in_feature, hidden_units)
        self.output_layer = nn.Linear(hidden_units, out_feature)

    def forward(self, x):
        x = self.hidden_layer(x)
        x = self.output_layer(x)
        return x


class SeedListing:
    """6 -> 4 -> 2, MSE, 1024 random samples; the hidden width is searchable."""

    hparams = {"hidden_units": 4}

    def model(self, hp):
        return MLP(in_feature=6, hidden_units=hp["hidden_units"], out_feature=2)

    def data(self, hp):
        return RandomTensorDataset(num_samples=1024, in_shape=6, out_shape=2), None

    def loss(self, model, batch):
        x, y = batch
        return nn.MSELoss()(model(x), y)
