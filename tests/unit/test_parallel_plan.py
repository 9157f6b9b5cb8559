"""A task's model-parallel plan (`tp_plan`, `pipeline_split`, `tp_divisible`), checked before any actor
starts; the byte-level GPT example's plan and stage split (`jobs/tasks/gpt.py`)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import ROOT
from rayhpc.config import ConfigError
from rayhpc.data import DataConfig
from rayhpc.parallel.plan import check_divisible, check_tp_plan, choose_stage_starts, keep_stage, units
from rayhpc.task import task_for


@pytest.fixture(scope="module")
def gpt():
    task = task_for(f"{ROOT}/jobs/tasks/gpt.py:GPT", DataConfig())
    hp = {**task.obj.hparams, "layers": 4}
    torch.manual_seed(0)
    return task.obj, task.obj.model(hp)


def test_the_gpt_plan_names_modules_of_the_model_and_divides_by_tp(gpt):
    task, model = gpt
    plan = task.tp_plan(model)
    assert len(plan) == 4 * 6 and {type(s).__name__ for s in plan.values()} == {"ColwiseParallel", "RowwiseParallel"}
    check_tp_plan(model, plan, 2)
    check_tp_plan(model, plan, 4)


@pytest.mark.parametrize("change, tp, message", [
    (lambda plan, s: {**plan, "blocks.0.attn.wqq": s}, 2,
     "tp_plan: 'blocks.0.attn.wqq' is not a module of the model; close: blocks.0.attn.wq, "),
    (lambda plan, s: plan, 3,
     "tp_plan: blocks.0.attn.wq (Linear, ColwiseParallel) splits out_features 64, not divisible by tp (--tp) 3"),
    (lambda plan, s: {}, 2, "tp_plan: empty; tensor parallelism (--tp 2) needs at least one module to shard"),
])
def test_a_wrong_plan_fails_with_one_line_naming_the_path_or_sizes(gpt, change, tp, message):
    from torch.distributed.tensor.parallel import ColwiseParallel

    task, model = gpt
    with pytest.raises(ConfigError) as err:
        check_tp_plan(model, change(task.tp_plan(model), ColwiseParallel()), tp)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_sizes_no_module_shows_are_the_tasks_to_state():
    check_divisible({"heads": 4}, 2)
    with pytest.raises(ConfigError, match=r"^hparams.heads \(--hp\) 4: not divisible by tp \(--tp\) 8"):
        check_divisible({"heads": 4}, 8)


def test_stages_begin_at_evenly_spread_split_points(gpt):
    task, model = gpt
    points = task.pipeline_split(model)
    assert points == ["blocks.1", "blocks.2", "blocks.3"]
    assert choose_stage_starts(model, points, 2) == ["blocks.2"]
    assert choose_stage_starts(model, points, 4) == points
    with pytest.raises(ConfigError, match=r"^pp \(--pp\) 5: 5 stages need 4 split points; the task's pipeline_split "
                                          r"gives 3: blocks.1, blocks.2, blocks.3$"):
        choose_stage_starts(model, points, 5)
    assert choose_stage_starts(model, ["blocks.0.attn"], 2) == ["blocks.0.attn"]  # not a unit: traced
    with pytest.raises(ConfigError, match=r"^pipeline_split: blocks.1, blocks.0.attn: not in the model's order, each "
                                          r"once$"):
        choose_stage_starts(model, ["blocks.1", "blocks.0.attn"], 3)
    with pytest.raises(ConfigError, match=r"^pipeline_split: blocks.2, blocks.1: not in the model's order, each once "
                                          r"\(tokens, positions, blocks.0, blocks.1, blocks.2, blocks.3, norm, head\)$"):
        choose_stage_starts(model, ["blocks.2", "blocks.1"], 3)


def test_stages_run_in_turn_compute_the_whole_model(gpt):
    """Each stage keeps its units under the whole model's names; run one after another they are the model."""
    _, model = gpt
    starts = choose_stage_starts(model, ["blocks.1", "blocks.2", "blocks.3"], 3)
    stages = [keep_stage(copy.deepcopy(model), starts, s) for s in range(3)]
    names = [set(dict(stage.named_parameters())) for stage in stages]
    assert set().union(*names) == set(dict(model.named_parameters())) and sum(map(len, names)) == len(
        list(model.parameters())), "every parameter in exactly one stage"
    assert stages[0].head is None and stages[2].tokens is None and list(stages[1].blocks) == ["1", "2"]
    x = torch.randint(0, 256, (3, 16))
    out = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, model(x))
    assert units(model)[:3] == ["tokens", "positions", "blocks.0"]
