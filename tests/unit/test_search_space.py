"""Search features without Ray: the Pareto front, constraints, the repeats summary, conditional and quantized
spaces, budgets and points as config."""

import itertools
import math
import random

import numpy as np
import pandas as pd
import pytest

from rayhpc.config import ConfigError, validate
from rayhpc.task import task_for
from rayhpc.tune.config import SweepConfig, bind_sweep
from rayhpc.tune.objectives import mark_front, pareto_mask, parse_constraint
from rayhpc.tune.results import summarize


def test_the_front_is_every_point_no_other_dominates():
    rng = random.Random(0)
    points = np.array([[rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)] for _ in range(60)], dtype=float)
    points[5, 1] = np.nan  # a trial that reported nothing is never on the front
    front = pareto_mask(points)
    for i, p in enumerate(points):
        dominated = any((q <= p).all() and (q < p).any() for q in points if not np.isnan(q).any())
        assert front[i] == (not np.isnan(p).any() and not dominated), (i, p)


def test_mark_front_flips_a_maximised_objective_and_leaves_infeasible_trials_off_the_front():
    table = pd.DataFrame({"status": ["finished"] * 4 + ["running"], "val_accuracy": [0.9, 0.8, 0.95, 0.7, 0.99],
                          "params": [100, 50, 900, 40, 10]})
    marked = mark_front(table, [("val_accuracy", "max"), ("params", "min")], [parse_constraint("params<=500")])
    assert marked["feasible"].tolist() == [True, True, False, True, True]
    # 0.95/900 breaks the constraint; the running trial's values are not its last
    assert marked["pareto"].tolist() == [True, True, False, True, False]
    # a lower bound: 0.8 and 0.7 fall short of it (a `>=` read as `<=` would keep them and drop 0.9)
    marked = mark_front(table, [("val_accuracy", "max"), ("params", "min")],
                        [parse_constraint("params<=500"), parse_constraint("val_accuracy>=0.85")])
    assert marked["feasible"].tolist() == [True, False, False, False, True]
    assert marked["pareto"].tolist() == [True, False, False, False, False]
    assert parse_constraint("val_accuracy>=0.85").violation(0.8) == pytest.approx(0.05)
    assert parse_constraint("val_accuracy>=0.85").violation(0.9) == pytest.approx(-0.05)


def test_the_summary_is_each_configurations_mean_std_and_t_interval_over_its_finished_runs():
    """Runs that did not finish (errored, interrupted, running), with a value of their last report, are left out
    of the statistics and the count of runs; an early-stopped run is in (its configuration's runs stop together)."""
    table = pd.DataFrame({"config.lr": [0.1] * 5 + [0.2] * 3, "config.seed": [0, 1, 2, 3, 4, 0, 1, 2],
                          "status": ["finished", "finished", "early-stopped", "error", "interrupted",
                                     "finished", "finished", "running"],
                          "val_loss": [1.0, 2.0, 4.0, 0.1, 0.2, 3.0, 5.0, 0.3]})
    summary = summarize(table, ("val_loss", "min")).set_index("config.lr")
    for lr, values, unfinished, t in ((0.1, [1.0, 2.0, 4.0], 2, 4.303), (0.2, [3.0, 5.0], 1, 12.706)):
        mean, std = np.mean(values), np.std(values, ddof=1)
        row = summary.loc[lr]
        assert (row["runs"], row["unfinished"]) == (len(values), unfinished), row
        assert math.isclose(row["val_loss_mean"], mean)
        assert math.isclose(row["val_loss_std"], std)
        assert math.isclose(row["val_loss_ci95_high"] - mean, t * std / math.sqrt(len(values)))


def bound(space: dict, **kw):
    cfg = validate(SweepConfig, {"space": space, **kw})
    task = task_for(cfg.task, cfg.data)
    cfg, _ = bind_sweep(cfg, task)
    return cfg, task


def test_a_conditional_grid_expands_only_where_its_condition_holds():
    cfg, task = bound({"optimizer": {"grid": ["sgd", "adamw"]},
                       "momentum": {"grid": [0.0, 0.9], "when": {"optimizer": "sgd"}},
                       "lr": {"choice": [0.01, 0.1]}}, search="grid")
    configs = cfg.configs(task.hp_model)
    got = sorted((c["optimizer"], c.get("momentum"), c["lr"]) for c in configs)
    want = sorted([("sgd", m, lr) for m, lr in itertools.product([0.0, 0.9], [0.01, 0.1])]
                  + [("adamw", None, lr) for lr in [0.01, 0.1]])
    assert got == want


def test_points_come_first_and_a_budget_reads_units():
    cfg, task = bound({"lr": {"loguniform": [1e-3, 0.1]}}, num_samples=3, time_budget="2m",
                      points_to_evaluate=["lr=0.05;hidden=8"])
    configs = cfg.configs(task.hp_model)
    assert len(configs) == 4 and (configs[0]["lr"], configs[0]["hidden"]) == (0.05, 8) and cfg.time_budget == 120


@pytest.mark.parametrize("kw, expected", [
    ({"repeats": 3, "scheduler": "pbt", "pack": 4}, "repeats (--repeats) 3: repeated seeds are members of one pack"),
    ({"scheduler": "hyperband", "pack": 4}, "pack (--pack) 4: scheduler hyperband pauses and resumes whole trials"),
    ({"max_trials": 10}, "max_trials (--max-trials) 10: the cap of an adaptive search"),
    ({"warm_start": "/tmp"}, "warm_start (--warm-start) /tmp: it feeds Optuna's sampler"),
    ({"time_budget": "soon"}, "time_budget"),
])
def test_settings_that_cannot_work_together_are_refused_by_name(kw, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        validate(SweepConfig, kw)


def test_rayhpc_status_shows_the_front_and_feasibility_of_a_running_sweep():
    from rayhpc.monitor.status import format_sweep

    rows = [{"trial_id": f"t{i}", "status": "finished", "config.lr": 0.1 * (i + 1), "iterations": 3,
             "best_val_loss": 0.5 - 0.1 * i, "pareto": i == 1, "feasible": i > 0, "node": "n1"} for i in range(3)]
    lines = format_sweep({"sweep": "mo", "rows": rows, "counts": {"finished": 3}}).splitlines()
    header = lines[1].split()
    assert "pareto" in header and "feasible" in header, lines
    assert [line.split()[header.index("pareto")] for line in lines[2:]] == ["False", "True", "False"], lines
