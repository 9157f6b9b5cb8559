"""A Hugging Face `transformers` ResNet (its BatchNorm, strided and 1x1 convolutions), built from its config and
used unchanged, classifying synthetic 32x32 images: a CNN whose trials a sweep on CPUs trains faster one after
another than packed (`pip install 'rayhpc[hf]'`; docs/packing.md).

    python jobs/tune_mlp.py --task jobs/tasks/resnet.py:ResNet --num-samples 4 --epochs 2
"""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class ResNet:
    hparams = {"width": 16, "images": 512}
    val_fraction = 0.25

    def model(self, hp):
        from transformers import ResNetConfig, ResNetForImageClassification

        w = hp["width"]
        config = ResNetConfig(num_channels=3, embedding_size=w, hidden_sizes=[w, 2 * w, 4 * w, 8 * w],
                              depths=[2, 2, 2, 2], num_labels=10)
        return ResNetForImageClassification(config)

    def data(self, hp):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(hp["images"], 3, 32, 32, generator=g)
        return TensorDataset(x, (x.mean((1, 2, 3)) * 1e3).long() % 10), None  # labels that depend on the image

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(pixel_values=x).logits, y)
