"""The search features of a sweep on a real local Ray: several objectives and constraints (Optuna's
multi-objective samplers on packs, the Pareto front), measured objectives."""

import json
import time

import pandas as pd
import pytest
import torch

from helpers import mlp_split, plain_trial, run_job_warm, sweep, tune_stops
from rayhpc.task import task_for
from rayhpc.tune.sweep import run_sweep

IN, OUT = 6, 2  # the built-in task's synthetic data (rayhpc.data.SyntheticTask)
# seconds Tune takes to save its state one last time and stop the trials: 8.6 s seen on CI's 2 cores with the
# other test session beside it and no trial started yet; a budget that never fired fails on the statuses too
# (every trial would finish), and the trials of 40 epochs take longer than budget + STOP_S two at a time
STOP_S = 12.0


def mlp_params(hidden: int) -> int:
    """Linear(IN, hidden) and Linear(hidden, OUT), with biases."""
    return (IN + 1) * hidden + (hidden + 1) * OUT


def mlp_flops(hidden: int) -> int:
    """Model FLOPs per sample: the two matmuls' 2 x m x n multiply-adds forward, times 3 with the backward."""
    return 3 * 2 * (IN * hidden + hidden * OUT)


def non_dominated(points: dict[str, tuple[float, float]]) -> set[str]:
    """The keys whose (a, b), both minimised, no other point dominates."""
    return {k for k, (a, b) in points.items()
            if not any(x <= a and y <= b and (x < a or y < b) for j, (x, y) in points.items() if j != k)}


@pytest.mark.parametrize("sampler", ["tpe", "nsga2"])
def test_two_objectives_on_packs_mark_the_pareto_front_and_optuna_holds_both_values(sampler, ray_address, tmp_path):
    """val_loss against model FLOPs, under 60 <= params <= 150 (hidden 8 and 16 meet both; 4 falls short, 32 goes
    over): 8 trials in packs of 4 proposed by Optuna's multi-objective sampler."""
    space = {"lr": {"loguniform": [1e-3, 1e-1]}, "hidden": {"choice": [4, 8, 16, 32]}}
    table = run_sweep(sweep(tmp_path, name="mo", search="optuna", sampler=sampler, num_samples=8, pack=4, epochs=2,
                            space=space, objective=["val_loss:min", "flops:min"], constraints=["params<=150", "params>=60"]))
    assert len(table) == 8 and set(table["status"]) == {"finished"} and set(table["pack_size"]) == {4}
    # the measured values, against the MLP's own formulas
    assert (table["flops"] == table["config.hidden"].map(mlp_flops)).all(), table[["config.hidden", "flops"]]
    assert (table["params"] == table["config.hidden"].map(mlp_params)).all(), table[["config.hidden", "params"]]
    assert (table["feasible"] == table["config.hidden"].isin([8, 16])).all(), table[["config.hidden", "feasible"]]
    feasible = table[table["feasible"]]
    front = non_dominated({r.trial_id: (r.val_loss, r.flops) for r in feasible.itertuples()})
    assert set(table.loc[table["pareto"], "trial_id"]) == front and front, table[["trial_id", "pareto"]]
    # Optuna's study: every trial once, told both values; its sampler recorded each one's violations (<= 0: held)
    study = json.loads((tmp_path / "mo" / "optuna_trials.json").read_text())
    assert sorted(t["number"] for t in study) == list(range(8)) and {t["state"] for t in study} == {"COMPLETE"}
    told = sorted((round(t["params"]["lr"], 12), t["params"]["hidden"], round(t["values"][0], 6), t["values"][1],
                   *t["sampler_constraints"]) for t in study)
    rows = sorted(zip(table["config.lr"].round(12), table["config.hidden"], table["val_loss"].round(6),
                      table["flops"], table["params"] - 150.0, 60.0 - table["params"]))
    assert told == rows


@pytest.mark.parametrize("args, expected", [
    (["--objective", "val_loss"], "objective (--objective): 'val_loss': expected NAME:MODE"),
    (["--objective", "val_loss:min,accuracy:max"], "objective (--objective) accuracy: not reported or measured"),
    (["--constraints", "params<5"], "constraints (--constraints): 'params<5': expected NAME<=BOUND"),
    (["--objective", "val_loss:min,params:min", "--scheduler", "asha"], "scheduler (--scheduler) asha: it ranks"),
    (["--sampler", "nsga2"], "sampler (--sampler) nsga2: Optuna's sampler; use it with search optuna"),
])
def test_bad_objectives_exit_2_with_one_line_before_ray_starts(args, expected, tmp_path):
    proc = run_job_warm("tune_mlp.py", *args, "--storage-path", str(tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: " + expected), proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr


SPACE = {"lr": {"loguniform": [1e-3, 1e-1]}, "hidden": {"choice": [4, 8, 16, 32]}}
POINTS = [{"optimizer": "sgd", "lr": 0.05, "hidden": 8}, {"optimizer": "sgd", "lr": 0.02, "hidden": 32}]
COND_SPACE = {"optimizer": {"choice": ["sgd", "adamw"]},
              "momentum": {"uniform": [0.0, 0.9], "when": {"optimizer": "sgd"}},
              "weight_decay": {"qloguniform": [1e-4, 0.1, 1e-4], "when": {"optimizer": "adamw"}},
              "hidden": {"lograndint": [4, 33]}, "lr": {"quniform": [0.01, 0.1, 0.01]}}


@pytest.mark.parametrize("search", ["random", "optuna"])
def test_points_come_first_and_conditional_parameters_appear_only_where_their_condition_holds(search, ray_address,
                                                                                               tmp_path):
    """Two points to evaluate, then 8 trials (packs of 2) of a conditional space with quantized and log-integer
    draws: the points are the first trials (with Optuna: its first two, asked and told like any)."""
    table = run_sweep(sweep(tmp_path, name=f"when-{search}", search=search, num_samples=8, pack=2, epochs=1,
                            space=COND_SPACE, points_to_evaluate=POINTS))
    assert len(table) == 10 and set(table["status"]) == {"finished"}
    first = [{"optimizer": r["config.optimizer"], "lr": r["config.lr"], "hidden": r["config.hidden"]}
             for _, r in table.head(2).iterrows()]
    assert first == POINTS and table.head(2)["config.weight_decay"].isna().all()
    if search == "optuna":
        study = {t["number"]: t for t in json.loads((tmp_path / "when-optuna" / "optuna_trials.json").read_text())}
        assert [study[0]["params"], study[1]["params"]] == [{**p, "momentum": study[i]["params"]["momentum"]}
                                                            for i, p in enumerate(POINTS)]
        assert len(study) == 10 and {t["state"] for t in study.values()} == {"COMPLETE"}
    table = table.iloc[2:]
    sgd = table["config.optimizer"] == "sgd"
    assert sgd.any() and (~sgd).any(), table["config.optimizer"]
    assert table.loc[sgd, "config.momentum"].between(0, 0.9).all() and table.loc[~sgd, "config.momentum"].isna().all()
    decay = table.loc[~sgd, "config.weight_decay"]
    assert decay.between(1e-4, 0.1).all() and table.loc[sgd, "config.weight_decay"].isna().all(), table
    # the quantized and log-integer draws
    assert ((decay / 1e-4).round(6) % 1 == 0).all(), decay
    assert table["config.lr"].between(0.01, 0.1).all() and ((table["config.lr"] / 0.01).round(6) % 1 == 0).all()
    assert table["config.hidden"].between(4, 32).all() and (table["config.hidden"] % 1 == 0).all()


@pytest.mark.parametrize("when, expected", [
    ({"optimizer": "rmsprop"}, "space.momentum.when: optimizer='rmsprop' is not a value optimizer takes (sgd, adamw)"),
    ({"batch_size": 32}, "space.momentum.when: batch_size is not another parameter of the space"),
    ({"lr": 0.1}, "space.momentum.when: lr is drawn from a range (loguniform)"),
])
def test_an_invalid_condition_is_refused_with_one_line_before_ray_starts(when, expected, tmp_path):
    space = {"optimizer": {"choice": ["sgd", "adamw"]}, "lr": {"loguniform": [1e-3, 0.1]},
             "momentum": {"uniform": [0.0, 0.9], "when": when}}
    (tmp_path / "sweep.yaml").write_text(json.dumps({"space": space}))
    proc = run_job_warm("tune_mlp.py", "--config", str(tmp_path / "sweep.yaml"), "--storage-path", str(tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: " + expected), proc.stderr


def test_a_warm_started_tpe_learns_the_earlier_sweep_and_proposes_otherwise_than_a_cold_one(ray_address, tmp_path):
    """An earlier random sweep of 12 trials (TPE models from its 10th trial on) told to Optuna first: the
    warm sweep's 4 proposals differ from a cold TPE's with the same seed (plain Optuna, the same space)."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    earlier = run_sweep(sweep(tmp_path, name="earlier", num_samples=12, epochs=1, space=SPACE))
    warm = run_sweep(sweep(tmp_path, name="warm", search="optuna", num_samples=4, pack=4, epochs=1, seed=7,
                           space=SPACE, warm_start=str(tmp_path / "earlier")))
    study = json.loads((tmp_path / "warm" / "optuna_trials.json").read_text())
    assert len(study) == 16 and {t["state"] for t in study} == {"COMPLETE"}
    told = sorted((round(t["params"]["lr"], 12), t["params"]["hidden"], round(t["value"], 6)) for t in study[:12])
    assert told == sorted(zip(earlier["config.lr"].round(12), earlier["config.hidden"], earlier["val_loss"].round(6)))
    cold = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=7))
    space = {"lr": FloatDistribution(1e-3, 1e-1, log=True), "hidden": CategoricalDistribution([4, 8, 16, 32])}
    cold_first = sorted((round(t.params["lr"], 12), t.params["hidden"]) for t in (cold.ask(space) for _ in range(4)))
    warm_first = sorted(zip(warm["config.lr"].round(12), warm["config.hidden"]))
    assert warm_first != cold_first
    assert not set(warm_first) & set(zip(earlier["config.lr"].round(12), earlier["config.hidden"]))


@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_a_time_budget_ends_the_sweep_in_time_and_resume_continues_it(ray_address, tmp_path, monkeypatch):
    """4 trials of 40 epochs (about 16 s here), 2 at a time, and a budget of 10 s: the sweep ends within the budget
    plus one report interval (and Tune's last save), its trials finished, stopped or never started; --resume
    runs the stopped ones on from their checkpoints to the end."""
    monkeypatch.setenv("RAYHPC_STOP_GRACE_S", "600")  # in this process, a slow stop must fail the test, not end it
    budget = 10.0
    kw = dict(name="budget", num_samples=4, pack=1, epochs=40, space=SPACE,
              data={"synthetic": {"num_samples": 8192}})
    started = time.monotonic()
    table = run_sweep(sweep(tmp_path, time_budget=budget, **kw))
    took = time.monotonic() - started
    reported = table[table["iterations"] > 0]  # on a loaded machine a trial may not have reported yet
    interval = (reported["train_seconds"] / reported["iterations"]).max() if len(reported) else 0.0
    assert took <= budget + interval + STOP_S, (took, interval)
    assert set(table["status"]) <= {"finished", "interrupted", "pending"} and set(table["status"]) != {"finished"}
    stopped = table.loc[table["status"] == "interrupted", ["trial_id", "iterations", "val_loss"]].values.tolist()
    resumed = run_sweep(sweep(tmp_path, resume=True, **kw))
    assert set(resumed["status"]) == {"finished"} and (resumed["iterations"] == 40).all(), resumed
    for trial_id, iterations, val_loss in stopped:  # each went on from its latest checkpoint: the pack's own,
        # saved before its report, so one epoch past the table's where Tune stopped the trial before it heard it
        last = json.loads(next((tmp_path / "budget").glob(f"*{trial_id}*/result.json")).read_text().splitlines()[-1])
        if iterations == 40:  # stopped after its last epoch's checkpoint: its final metrics again, nothing retrained
            assert last["epoch"] == 40 and last["val_loss"] == val_loss, (trial_id, val_loss, last)
        else:
            assert min(1, iterations) <= last["resumed_from_epoch"] <= iterations + 1, (trial_id, iterations, last)


def test_repeats_are_members_of_one_pack_each_equal_to_its_seed_alone_and_summarised(ray_address, tmp_path):
    """3 configurations x 3 seeds, 2 epochs: every run is a member of its configuration's pack, with its own
    initialisation and data order, and equals the configuration trained alone (plain PyTorch) with its seed;
    summary.parquet holds each configuration's mean, std and 95% interval of the 3 runs' val_loss."""
    # the learning rates of the packed-equals-unpacked test: above ~0.05 this task's training amplifies float
    # rounding (a batched matmul's against nn.Linear's) to 1e-3 in two epochs, for any member
    cfg = sweep(tmp_path, name="repeats", num_samples=3, repeats=3, epochs=2,
                space={"lr": {"loguniform": [1e-3, 3e-2]}, "hidden": {"choice": [8, 16]}})
    table = run_sweep(cfg)
    assert len(table) == 9 and set(table["status"]) == {"finished"}
    configs = table.groupby(["config.lr", "config.hidden"])
    assert len(configs) == 3 and all(sorted(g["config.seed"]) == [cfg.seed, cfg.seed + 1, cfg.seed + 2]
                                     for _, g in configs)
    packs = table["trial_id"].str.rsplit("-", n=1).str[0]
    assert all(packs[g.index].nunique() == 1 for _, g in configs)  # a configuration's runs share a pack
    task = task_for("mlp", cfg.data)
    train, val = mlp_split(task)
    for _, row in table.iterrows():
        hp = {**cfg.defaults(task.hp_model), "lr": row["config.lr"], "hidden": int(row["config.hidden"]),
              "seed": int(row["config.seed"])}
        history = plain_trial(task.initial_model(hp), train, val, hp, 2, torch.nn.functional.mse_loss)[1]
        torch.testing.assert_close(torch.tensor(row["val_loss"]), torch.as_tensor(history[-1][0]).float(),
                                   rtol=1e-4, atol=1e-6)
    summary = pd.read_parquet(tmp_path / "repeats" / "summary.parquet")
    assert len(summary) == 3 and set(summary["runs"]) == {3}
    for _, s in summary.iterrows():
        runs = table[(table["config.lr"] == s["config.lr"]) & (table["config.hidden"] == s["config.hidden"])]
        mean, std = runs["val_loss"].mean(), runs["val_loss"].std(ddof=1)
        half = 4.303 * std / 3 ** 0.5  # Student's t(2) 97.5%
        torch.testing.assert_close(torch.tensor(s[["val_loss_mean", "val_loss_std", "val_loss_ci95_low",
                                                   "val_loss_ci95_high"]].astype(float).values),
                                   torch.tensor([mean, std, mean - half, mean + half], dtype=torch.float64))


def test_median_stopping_stops_pack_members_where_tunes_rule_stops_the_same_trials(ray_address, tmp_path):
    """8 trials in one pack under median stopping: Tune's own MedianStoppingRule, fed the members' reports in the
    order the pack made them, stops the same members at the same epochs, and they leave the pack."""
    from ray.tune.schedulers import MedianStoppingRule

    cfg = sweep(tmp_path, name="median", num_samples=8, epochs=6, scheduler="median", pack=8,
                space={"lr": {"loguniform": [1e-4, 1.0]}})
    table = run_sweep(cfg)
    (trial_dir,) = [d for d in (tmp_path / "median").iterdir() if d.is_dir() and (d / "result.json").exists()]
    reports = [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
    rule = MedianStoppingRule(time_attr="epoch", metric="val_loss", mode="min", grace_period=1,
                              min_samples_required=3, hard_stop=True)
    expected = tune_stops(reports, rule, cfg.epochs)
    assert expected, "the rule stopped no member: the test shows nothing"
    rows = table.assign(member=table["trial_id"].str.rsplit("-", n=1).str[1].astype(int)).set_index("member")
    for j in range(8):
        want = ("early-stopped", expected[j]) if j in expected else ("finished", 6)
        assert (rows.loc[j, "status"], rows.loc[j, "iterations"]) == want, (j, rows)
    assert reports[-1]["active_members"] == 8 - len(expected)


def test_hyperband_runs_tunes_brackets_on_unpacked_trials(ray_address, tmp_path):
    table = run_sweep(sweep(tmp_path, name="hyperband", num_samples=6, epochs=9, scheduler="hyperband",
                            space={"lr": {"loguniform": [1e-4, 1.0]}}))
    assert len(table) == 6 and set(table["pack_size"]) == {1}
    assert set(table["status"]) == {"finished", "early-stopped"}, table[["status", "iterations"]]
    assert (table.loc[table["status"] == "finished", "iterations"] == 9).all()
    assert (table.loc[table["status"] == "early-stopped", "iterations"] < 9).all()


def test_optuna_and_asha_see_the_mean_of_a_configurations_repeats(ray_address, tmp_path):
    """4 configurations x 2 seeds proposed by Optuna in one pack under ASHA: each Optuna trial is told the mean
    of its configuration's runs, and ASHA, ranking configurations by that mean, stops a configuration's runs
    together."""
    table = run_sweep(sweep(tmp_path, name="mean", search="optuna", scheduler="asha", repeats=2, num_samples=4,
                            pack=4, epochs=4, space=SPACE))
    assert len(table) == 8 and set(table["pack_size"]) == {8}
    configs = table.groupby(["config.lr", "config.hidden"])
    assert len(configs) == 4
    assert all(g["iterations"].nunique() == 1 and g["status"].nunique() == 1 for _, g in configs), table
    assert "early-stopped" in set(table["status"]), table[["status", "iterations"]]
    study = json.loads((tmp_path / "mean" / "optuna_trials.json").read_text())
    told = sorted((round(t["params"]["lr"], 12), t["params"]["hidden"], round(t["value"], 6)) for t in study)
    means = sorted((round(lr, 12), hidden, round(g["val_loss"].mean(), 6)) for (lr, hidden), g in configs)
    assert told == means
