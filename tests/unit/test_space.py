"""Search spaces and the sweep config: parsing, sampling, packing plans, and one-line errors (no Ray needed)."""

import functools

import pytest

from rayhpc.config import ConfigError, validate
from rayhpc.data import DataConfig
from rayhpc.task import task_for
from rayhpc.task.check import check_task
from rayhpc.task.hparams import PlatformHParams
from rayhpc.tune.config import SweepConfig, bind_sweep
from rayhpc.tune.packing import pack_key
from rayhpc.tune.plan import make_plan

MLP = task_for("mlp", DataConfig())


def sweep(**kw) -> SweepConfig:
    """The sweep `kw` describes, bound to the built-in mlp task (its space checked against the task)."""
    return bind_sweep(validate(SweepConfig, kw), MLP)[0]


def sample_configs(cfg: SweepConfig) -> list[dict]:
    return cfg.configs(MLP.hp_model)


def test_grid_is_a_cross_product_repeated_per_sample():
    cfg = sweep(num_samples=3, space={"hidden": {"grid": [4, 8]}, "batch_size": {"grid": [16, 32]},
                                      "lr": {"loguniform": [1e-3, 1e-1]}})
    configs = sample_configs(cfg)
    assert len(configs) == 2 * 2 * 3
    assert {(c["hidden"], c["batch_size"]) for c in configs} == {(4, 16), (4, 32), (8, 16), (8, 32)}
    assert len({c["lr"] for c in configs}) == 12  # a fresh draw for every trial


def test_every_kind_draws_inside_its_domain_and_is_reproducible():
    space = {"hidden": {"randint": [3, 7]}, "lr": {"loguniform": [1e-4, 1e-2]}, "momentum": {"uniform": [0.1, 0.5]},
             "optimizer": {"choice": ["sgd", "adam"]}, "weight_decay": 0.01}
    cfg = sweep(num_samples=200, space=space, seed=5)
    configs = sample_configs(cfg)
    assert {c["hidden"] for c in configs} == {3, 4, 5, 6}  # randint's high is exclusive, as in Ray Tune
    assert all(1e-4 <= c["lr"] <= 1e-2 and 0.1 <= c["momentum"] <= 0.5 for c in configs)
    assert {c["optimizer"] for c in configs} == {"sgd", "adam"}
    assert {c["weight_decay"] for c in configs} == {0.01}
    assert configs == sample_configs(cfg)
    assert configs != sample_configs(cfg.model_copy(update={"seed": cfg.seed + 1}))


def test_grid_search_turns_choices_into_grid_values():
    cfg = sweep(search="grid", space={"hidden": {"choice": [4, 8, 16]}, "lr": {"grid": [0.1, 0.01]}})
    configs = sample_configs(cfg)
    assert sorted((c["hidden"], c["lr"]) for c in configs) == sorted((h, lr) for h in (4, 8, 16) for lr in (0.1, 0.01))


def test_yaml_style_exponents_are_numbers():
    # PyYAML reads `1e-3` (no dot) as a string; the config still takes it as a float
    cfg = sweep(space={"lr": {"loguniform": ["1e-3", "1e-1"]}})
    assert cfg.space["lr"].args == (1e-3, 1e-1)


def test_packs_group_trials_that_can_step_together():
    cfg = sweep(num_samples=3, space={"batch_size": {"grid": [16, 32]}, "optimizer": {"grid": ["sgd", "adam"]},
                                      "lr": {"uniform": [0.01, 0.1]}, "hidden": {"choice": [4, 8]},
                                      "depth": {"grid": [2, 3]}})
    configs = sample_configs(cfg)
    info, _ = check_task(MLP, configs[0], DataConfig())
    assert info.model_reads == {"hidden", "depth"} and info.data_reads == frozenset()
    packs = make_plan(configs, 64, functools.partial(pack_key, MLP, info))
    assert sum(len(p) for p in packs) == 24
    for pack in packs:
        assert len({(m["batch_size"], m["optimizer"], m["depth"]) for m in pack}) == 1
        # two-layer MLPs of different widths share a padded pack; deeper ones must agree on the width
        assert pack[0]["depth"] == 2 or len({m["hidden"] for m in pack}) == 1
    assert any(len({m["hidden"] for m in p}) > 1 for p in packs)
    assert all(len(p) == 1 for p in make_plan(configs, 64, None))


@pytest.mark.parametrize("data, message", [
    ({"num_sample": 3}, "num_sample: unknown key; allowed keys: accumulate, activation_checkpointing, address,"),
    ({"num_samples": 0}, "num_samples: Input should be greater than or equal to 1"),
    ({"num_samples": "many"}, "num_samples: Input should be a valid integer"),
    ({"search": "bayes"}, "search: Input should be 'random', 'grid' or 'optuna'"),
    ({"space": {}}, "space: empty search space"),
    ({"space": {"hidden": 8}}, "space: empty search space"),
    ({"space": {"width": {"choice": [1, 2]}}}, "space.width: unknown parameter; allowed: optimizer, lr, momentum,"),
    ({"space": {"depth": {"choice": [2, "deep"]}}}, "space.depth: Input should be a valid integer"),
    ({"space": {"lr": {"loguniform": [0, 1]}}}, "space: lr: loguniform: low 0.0 must be > 0"),
    ({"space": {"lr": {"normal": [0, 1]}}}, "space: lr: unknown kind 'normal'; allowed: grid, choice,"),
    ({"space": {"hidden": {"choice": []}}}, "space: hidden: choice: empty list"),
    ({"space": {"hidden": {"uniform": [4, 64]}}}, "space.hidden: uniform draws floats but hidden is an integer"),
    ({"space": {"hidden": {"choice": [4, -1]}}}, "space.hidden: Input should be greater than or equal to 1 (got -1)"),
    ({"search": "grid", "space": {"lr": {"uniform": [0.1, 1]}}}, "space.lr: search=grid needs grid or choice"),
    ({"data": {"path": "x.parquet", "colour": 1}}, "data.colour: unknown key; allowed keys: features, path,"),
])
def test_bad_configs_name_the_key_and_what_is_allowed(data, message):
    with pytest.raises(ConfigError) as err:
        sweep(**data)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_hparams_defaults_are_a_valid_trial():
    assert PlatformHParams().model_dump()["optimizer"] == "adam"
    assert MLP.hp_model().model_dump() == {**PlatformHParams().model_dump(), "hidden": 4, "depth": 2}


def test_flags_are_derived_from_the_config_fields():
    from rayhpc.cli import derived_flags
    from rayhpc.collectives.config import CollectivesConfig
    from rayhpc.parallel.config import ParallelConfig
    from rayhpc.scaling.config import ScalingConfig
    from rayhpc.train.config import TrainConfig

    train = derived_flags(TrainConfig)
    assert {train[f] for f in ("--num-workers", "--cpus-per-worker", "--gpu", "--lr", "--optimizer", "--hp", "--task",
                               "--data", "--target", "--val-fraction")} == {
        "compute.num_workers", "compute.cpus_per_worker", "compute.gpu", "optim.lr", "optim.optimizer", "hparams",
        "task", "data.path", "data.target", "data.val_fraction"}
    sweep = derived_flags(SweepConfig)
    assert sweep["--grace-period"] == "asha.grace_period" and "--space" not in sweep  # a dict key has no flag
    assert sweep["--keep-checkpoints"] == train["--keep-checkpoints"] == "checkpoint.keep"
    assert not any(key.startswith("data.synthetic") for key in sweep.values())  # two sections down: YAML only
    parallel = derived_flags(ParallelConfig)
    assert parallel["--hp"] == "hparams"  # a field that names its own flag
    # the same section and flag names as the training job's, and the pipeline's in `parallelism:`
    assert {f: parallel[f] for f in ("--lr", "--warmup-steps", "--clip-grad-norm", "--accumulate", "--global-batch-size",
                                     "--checkpoint-every", "--epochs")} == {f: train[f] for f in (
        "--lr", "--warmup-steps", "--clip-grad-norm", "--accumulate", "--global-batch-size", "--checkpoint-every",
        "--epochs")}
    assert parallel["--schedule"] == "parallelism.schedule" and parallel["--tp"] == "parallelism.tp"
    for model in (CollectivesConfig, ScalingConfig):
        flags = derived_flags(model)
        assert flags["--cpus-per-worker"] == "compute.cpus_per_worker" and flags["--name"] == "name"


def test_the_optim_and_schedule_sections_fix_every_trials_values_and_leave_the_rest_to_the_space():
    task = task_for("mlp", SweepConfig().data)
    given = validate(SweepConfig, {"optim": {"optimizer": "adamw", "lr": 0.003}, "schedule": {"warmup_steps": 5},
                                   "num_samples": 6})
    bound, _ = bind_sweep(given, task)
    assert "lr" not in bound.space and "hidden" in bound.space, bound.space  # the task's space, less lr
    configs = bound.configs(task.hp_model)
    assert {(c["optimizer"], c["lr"], c["warmup_steps"]) for c in configs} == {("adamw", 0.003, 5)}
    assert len({c["hidden"] for c in configs}) > 1
    plain, _ = bind_sweep(validate(SweepConfig, {"num_samples": 6}), task)  # no section: the defaults, lr searched
    configs = plain.configs(task.hp_model)
    assert {(c["optimizer"], c["warmup_steps"]) for c in configs} == {("adam", 0)}
    assert len({c["lr"] for c in configs}) == 6


def test_the_batch_and_accumulation_are_constants_of_every_trial_unless_the_space_searches_them():
    """`rayhpc tune --global-batch-size 64 --accumulate 2` (as `train`, `parallel` and `ps` take them): every
    trial's batch and micro-batches; a space that searches one of them draws it instead."""
    task = task_for("mlp", SweepConfig().data)
    configs = sweep(global_batch_size=64, accumulate=2, num_samples=4).configs(task.hp_model)
    assert {(c["batch_size"], c["accumulate"]) for c in configs} == {(64, 2)}
    searched = sweep(accumulate=2, num_samples=4, search="grid",
                     space={"batch_size": {"grid": [16, 32]}, "lr": 0.01}).configs(task.hp_model)
    assert sorted((c["batch_size"], c["accumulate"]) for c in searched) == [(16, 2)] * 4 + [(32, 2)] * 4
    assert {(c["batch_size"], c["accumulate"]) for c in sample_configs(sweep(num_samples=2))} == {(32, 1)}
