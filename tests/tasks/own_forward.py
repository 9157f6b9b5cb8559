"""Models whose own forward calls the modules a pipeline split removes, as a user writes their tasks: a
`transformers` ViT (a class token, its encoder's layers called in a loop, a final norm and head by name) and ResNet
(BatchNorm, stages inside an encoder), and a model with litgpt's shape written here (RoPE's cos and sin sliced once and
passed to every block, a final norm and head). Each split by module path with no wrapper: the stages are traced."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

SAMPLES, CLASSES = 80, 5  # batches of 32: 32, 32, then a partial one of 16


class Images:
    """Random 16 x 16 images of 5 classes."""

    def data(self, hp):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(SAMPLES + 16, 3, 16, 16, generator=g), torch.randint(CLASSES, (SAMPLES + 16,), generator=g)
        return TensorDataset(x[:SAMPLES], y[:SAMPLES]), TensorDataset(x[SAMPLES:], y[SAMPLES:])

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).logits, y)


class ViT(Images):
    def model(self, hp):
        from transformers import ViTConfig, ViTForImageClassification

        return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                                   intermediate_size=64, image_size=16, patch_size=4,
                                                   num_labels=CLASSES))

    def pipeline_split(self, model):
        return ["vit.layers.1", "vit.layers.2", "vit.layers.3"]


class ResNet(Images):
    def model(self, hp):
        from transformers import ResNetConfig, ResNetForImageClassification

        return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32],
                                                         depths=[1, 1, 1, 1], num_labels=CLASSES))

    def pipeline_split(self, model):
        return ["resnet.encoder.stages.2"]


class Block(nn.Module):
    """litgpt's block: pre-norm attention with rotary positions (the cos and sin its GPT passes in), then an MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, cos, sin):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm_1(x)).split(c, dim=-1))
        q, k = (z * cos + torch.cat([-z[..., z.size(-1) // 2:], z[..., :z.size(-1) // 2]], -1) * sin for z in (q, k))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm_2(x))


class LitGptShapedModel(nn.Module):
    """litgpt's GPT: `lm_head` and a `transformer` dict of `wte`, `h` (the blocks) and `ln_f`, its forward checking
    the length, slicing the RoPE cache and calling each by name: no pipeline unit between its layers."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 2, layers: int = 4, max_seq_length: int = 16):
        super().__init__()
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, width), ln_f=nn.LayerNorm(width),
                                              h=nn.ModuleList(Block(width, heads) for _ in range(layers))))
        self.max_seq_length = max_seq_length
        half = width // heads // 2
        angles = torch.arange(max_seq_length)[:, None] / 10000 ** (torch.arange(half) / half)
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def forward(self, idx):
        t = idx.size(1)
        if self.max_seq_length < t:
            raise ValueError(f"Cannot forward sequence of length {t}, max seq length is only {self.max_seq_length}.")
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


class LitGptShaped:
    """Next-token prediction on random windows of 8 tokens."""

    def data(self, hp):
        x = torch.randint(64, (SAMPLES + 16, 9), generator=torch.Generator().manual_seed(0))
        return TensorDataset(x[:SAMPLES, :-1], x[:SAMPLES, 1:]), TensorDataset(x[SAMPLES:, :-1], x[SAMPLES:, 1:])

    def model(self, hp):
        return LitGptShapedModel()

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def pipeline_split(self, model):
        return ["transformer.h.1", "transformer.h.2", "transformer.h.3"]


class LitGptShapedTied(LitGptShaped):
    """Its head is its token embedding: a split between them would give each stage a copy."""

    def model(self, hp):
        model = LitGptShapedModel()
        model.lm_head.weight = model.transformer.wte.weight
        return model
