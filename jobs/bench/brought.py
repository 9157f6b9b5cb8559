"""Five models nobody on the project wrote, each as a new user's task: model, data and loss, nothing else.
Hugging Face GPT-2 (tied head) and Qwen2 from `transformers`; timm's ViT-tiny and ResNet-18; litgpt's GPT.
Each is built from its own config (random weights, nothing downloaded), small enough for a CPU, on random
data of its own kind: byte windows for the language models, 32x32 images of 10 classes for the vision ones.
`python jobs/bench/model_jobs.py` runs each through every job (docs/tasks.md, "Models users bring").

timm needs torchvision, and PyPI's torchvision is a CUDA build that imports beside PyPI's (CUDA) torch only:
run the timm and litgpt tasks in a virtualenv of their own with that torch (it runs on CPU too).
"""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

WINDOW, VOCAB, SAMPLES = 32, 256, 64


def _bytes():
    x = torch.randint(VOCAB, (SAMPLES, WINDOW + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(x[:, :-1], x[:, 1:]), None


def _images():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 3, 32, 32, generator=g), torch.randint(10, (SAMPLES,), generator=g)), None


class Gpt2:
    data = staticmethod(lambda hp: _bytes())

    def model(self, hp):
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=WINDOW, n_embd=64, n_layer=2, n_head=4,
                                          bos_token_id=0, eos_token_id=0))

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())


class Qwen2(Gpt2):
    def model(self, hp):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=WINDOW, use_cache=False))


class LitGpt:
    data = staticmethod(lambda hp: _bytes())

    def model(self, hp):
        from litgpt import GPT, Config

        return GPT(Config(block_size=WINDOW, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4,
                          n_embd=64))

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class VitTiny:
    data = staticmethod(lambda hp: _images())

    def model(self, hp):
        import timm

        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)


class ResNet18(VitTiny):
    def model(self, hp):
        import timm

        return timm.create_model("resnet18", num_classes=10)


# The same models with what a user adds once `rayhpc parallel` asks for it (a Megatron-style plan of the blocks'
# Linear layers, and where pipeline stages may begin); the Hugging Face models need neither.

def _megatron(model, blocks: str, column: tuple[str, ...], row: tuple[str, ...]) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i, _ in enumerate(model.get_submodule(blocks)):
        plan.update({f"{blocks}.{i}.{path}": ColwiseParallel() for path in column})
        plan.update({f"{blocks}.{i}.{path}": RowwiseParallel() for path in row})
    return plan


class VitTinyPlanned(VitTiny):
    def tp_plan(self, model):
        return _megatron(model, "blocks", ("attn.qkv", "mlp.fc1"), ("attn.proj", "mlp.fc2"))

    def pipeline_split(self, model):
        return ["blocks.1"]


class ResNet18Planned(ResNet18):
    def tp_plan(self, model):  # only its head is a Linear
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        return {"fc": ColwiseParallel(output_layouts=Replicate())}

    def pipeline_split(self, model):
        return ["layer3"]  # not a pipeline unit (its blocks are): the stages are traced


class LitGptPlanned(LitGpt):
    def tp_plan(self, model):
        return _megatron(model, "transformer.h", ("attn.qkv", "mlp.fc"), ("attn.proj", "mlp.proj"))

    def pipeline_split(self, model):
        return ["transformer.h.1"]
