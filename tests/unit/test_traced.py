"""Traced pipeline stages (`rayhpc.parallel.traced`) of models whose forward calls what a cut stage lacks: fed one
after another they train and evaluate as the whole model, at every batch size, under the whole model's names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import ROOT
from rayhpc.data import DataConfig
from rayhpc.parallel.traced import TracedStage
from rayhpc.task import task_for

SPLITS = {"ViT": ["vit.layers.2"], "ResNet": ["resnet.encoder.stages.2"],
          "LitGptShaped": ["transformer.h.1", "transformer.h.3"], "PositionsFirst": ["blocks.1"]}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.positions, self.fc = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, positions, x):
        return self.fc(x + self.positions(positions))


class PositionsFirst(nn.Module):
    """Its second stage is given the positions (5 x 4: the sequence's length first) before the activation."""

    def __init__(self):
        super().__init__()
        self.embed, self.blocks = nn.Linear(3, 4), nn.ModuleList([Block(), Block()])
        self.register_buffer("table", torch.randn(16, 4))

    def forward(self, x):
        positions, x = self.table[:x.size(1)], self.embed(x)
        for block in self.blocks:
            x = block(positions, x)
        return x


def model_and_inputs(name: str):
    if name == "PositionsFirst":
        return PositionsFirst, torch.randn(8, 5, 3)
    task = task_for(f"{ROOT}/tests/tasks/own_forward.py:{name}", DataConfig()).obj
    return (lambda: task.model({})), task.data({})[0].tensors[0]


def logits(output):
    return getattr(output, "logits", output)


@pytest.fixture(scope="module")
def world():
    """A process group of one (torch's `build_stage`, which moves a trace's own tensors off the meta device, asks
    the stage's group for its rank), with no socket."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", SPLITS)
def test_traced_stages_train_and_evaluate_as_the_whole_model(name, world):
    """(ViT: its mask made by `arange` on the device a trace ran on, the meta device unless moved.)"""
    build, x = model_and_inputs(name)
    torch.manual_seed(0)
    whole = build()
    initial = {**whole.state_dict(), **dict(whole.named_buffers())}
    stages = [TracedStage(build, SPLITS[name], k, x) for k in range(len(SPLITS[name]) + 1)]
    names = [{n for n, _ in stage.named_parameters()} for stage in stages]
    assert set().union(*names) == {n for n, _ in whole.named_parameters()} and sum(map(len, names)) == len(
        list(whole.parameters())), "each of the whole model's parameters in one stage, under its name"
    assert set().union(*(stage.state_dict() for stage in stages)) == set(whole.state_dict()), \
        "a buffer that the model does not save (RoPE's cos and sin) is not saved by a stage either"
    with torch.no_grad():
        for stage in stages:
            stage.to_empty(device="cpu")
            for n, t in [*stage.named_parameters(), *stage.named_buffers()]:
                t.copy_(initial[n])
    optimizer = torch.optim.SGD([p for stage in stages for p in stage.parameters()], lr=0.1)
    reference = torch.optim.SGD(whole.parameters(), lr=0.1)

    def run(batch):
        act = (batch,)
        for stage in stages:
            out = stage(*act)
            act = out if isinstance(out, tuple) else (out,)
        return out

    for size in (4, 4, 3):  # a batch size of its own: its own trace
        batch = x[:size]
        loss = logits(run(batch)).float().pow(2).mean()
        want = logits(whole(batch)).float().pow(2).mean()
        torch.testing.assert_close(loss, want)
        for step, value in ((optimizer, loss), (reference, want)):
            value.backward()
            step.step()
            step.zero_grad()
    held = {n: t for stage in stages for n, t in [*stage.named_parameters(), *stage.named_buffers()]}
    for n, t in [*whole.named_parameters(), *whole.named_buffers()]:
        torch.testing.assert_close(held[n], t, msg=lambda m: f"{n}: {m}")  # BatchNorm's statistics too
    for stage in stages:
        stage.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(run(x[:5])), logits(whole.eval()(x[:5])))
    assert {key for stage in stages for key in stage.traces} == {(True, 4), (True, 3), (False, 5)}
