"""The study folder's bookkeeping, tested directly (no Ray): concurrent claims, dead slices, shared ASHA, a
slice's definition. (Slices running a sweep together: tests/ray/test_study.py.)"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import random

import pytest

from rayhpc.config import ConfigError
from rayhpc.study.folder import LEDGER_FILE, LOCK_FILE, Study
from rayhpc.study.slice import as_slice
from rayhpc.tune.adaptive import RungKeeper
from rayhpc.tune.config import SweepConfig

TRIALS = 1000


def _worker(folder: str, name: str, abandon: int) -> None:
    """A slice: claims packs until none is left, finishing each; with `abandon`, it claims that many and dies."""
    study = Study(folder)
    study.join(name, ("val_loss", "min"))
    for _ in range(abandon):
        with study.locked():
            study.claim(name, None, 1, 0)
    if abandon:
        os._exit(0)  # dead, its claims unfinished: another slice must take them over
    while True:
        with study.locked():
            pack = study.claim(name, None, 1, 0)
        if pack is None:
            return
        with study.locked():
            study.finish(name, pack["pack"], [{"trial_id": f"{pack['pack']}-0", "slice": name}])


def test_four_processes_claim_a_thousand_trials_each_exactly_once_and_take_over_a_dead_ones(tmp_path):
    study = Study(tmp_path)
    with study.locked():
        study.ensure_plan(lambda: [[{"lr": i}] for i in range(TRIALS)])
    ctx = multiprocessing.get_context("fork")
    quitter = ctx.Process(target=_worker, args=(str(tmp_path), "quitter", 10))
    quitter.start()
    quitter.join()  # it claimed 10 packs and died holding them
    slices = [ctx.Process(target=_worker, args=(str(tmp_path), f"s{i}", 0)) for i in range(4)]
    for p in slices:
        p.start()
    for p in slices:
        p.join(timeout=120)
    assert [p.exitcode for p in slices] == [0] * 4
    events = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    finished = collections.Counter(e["pack"] for e in events if e["event"] == "finish")
    assert sorted(finished) == list(range(TRIALS)) and set(finished.values()) == {1}
    claims = collections.Counter(e["pack"] for e in events if e["event"] == "claim")
    assert sum(claims.values()) == TRIALS + 10  # the quitter's 10, each claimed again once
    by = collections.Counter(e["slice"] for e in events if e["event"] == "finish")
    assert set(by) == {"s0", "s1", "s2", "s3"}, by  # every slice finished some; the quitter none
    rows = Study(tmp_path)
    with rows.locked():
        assert sorted(rows.results()["trial_id"]) == sorted(f"{i}-0" for i in range(TRIALS))


def test_asha_across_two_slices_stops_at_the_same_rungs_as_one_slice(tmp_path):
    rng = random.Random(0)
    results = [(f"{m // 8}-{m % 8}", epoch, rng.random() / epoch) for epoch in range(1, 5) for m in range(32)]
    args = ("val_loss", "min", 4, 1, 2.0)
    one = RungKeeper(str(tmp_path / "one.pkl"), *args)
    alone = [one.decide("val_loss", [r])[0] for r in results]
    shared = tmp_path / "study"
    shared.mkdir()
    slices = [RungKeeper(str(shared / "asha.pkl"), *args, lock=str(shared / LOCK_FILE)) for _ in range(2)]
    together = [slices[i % 2].decide("val_loss", [r])[0] for i, r in enumerate(results)]  # reports alternate
    assert together == alone
    assert 0 < sum(alone) < len(alone)  # ASHA stopped some, not all


def test_a_slice_agrees_with_its_study_or_is_refused_before_anything_starts(tmp_path):
    first, _, _ = as_slice(SweepConfig(study=tmp_path / "s", num_samples=8, epochs=2), {"num_samples", "epochs"})
    assert (first.num_samples, first.storage_path) == (8, tmp_path / "s" / "slices")
    assert oct((tmp_path / "s").stat().st_mode & 0o777) == "0o700"
    joined, _, _ = as_slice(SweepConfig(study=tmp_path / "s"), set())  # the study's definition, not the defaults
    assert (joined.num_samples, joined.epochs) == (8, 2) and joined.name != first.name
    with pytest.raises(ConfigError, match=r"^num_samples: 9 differs from study .*'s 8; drop it"):
        as_slice(SweepConfig(study=tmp_path / "s", num_samples=9), {"num_samples"})
    with pytest.raises(ConfigError, match=r"^resume \(--resume\): a study continues by itself"):
        as_slice(SweepConfig(study=tmp_path / "s", resume=True), {"resume"})
    with pytest.raises(ConfigError, match=r"^workers_per_trial \(--workers-per-trial\) 2: a study's slices"):
        as_slice(SweepConfig(study=tmp_path / "t", workers_per_trial=2), {"workers_per_trial"})
    os.chmod(tmp_path / "s", 0o770)
    with pytest.raises(ConfigError, match=r"^study \(--study\) .*: .*mode 0770"):
        as_slice(SweepConfig(study=tmp_path / "s"), set())


def test_array_tasks_are_slices_without_ray_that_run_optuna_and_asha(tmp_path):
    """Two Ray-free slices (what `rayhpc submit --array --study` runs per task) share one Optuna + ASHA study."""
    import subprocess
    import sys

    import optuna
    import pandas as pd

    from helpers import ROOT, job_env
    from rayhpc.job import bind_task
    from rayhpc.tune.config import bind_sweep
    from rayhpc.tune.slice_search import _journal
    from rayhpc.tune.study_array import prepare_tasks

    cfg = SweepConfig(study=tmp_path / "s", search="optuna", scheduler="asha", num_samples=12, epochs=4,
                      data={"synthetic": {"num_samples": 2000}})
    cfg, study, _ = as_slice(cfg, {"search", "scheduler", "num_samples", "epochs", "data"})
    cfg, task, info, _ = bind_task(cfg, bind_sweep)
    prepare_tasks(study, cfg, task, info)
    tasks = [subprocess.Popen([sys.executable, "-m", "rayhpc.tune.study_array", "--study", str(study.path)], cwd=ROOT,
                              env=job_env(None), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [t.communicate(timeout=300)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs
    events = [json.loads(line) for line in (study.path / LEDGER_FILE).read_text().splitlines()]
    finished = collections.Counter(e["pack"] for e in events if e["event"] == "finish")
    assert sorted(finished) == list(range(12)) and set(finished.values()) == {1}
    assert len({e["slice"] for e in events if e["event"] == "finish"}) == 2, outs  # both tasks trained trials
    table = pd.read_parquet(study.path / "results.parquet")
    assert set(table["status"]) == {"finished", "early-stopped"}, table  # ASHA stopped some
    stopped = table[table["status"] == "early-stopped"]
    assert (stopped["iterations"] < 4).all() and (table[table["status"] == "finished"]["iterations"] == 4).all()
    trials = optuna.load_study(study_name="rayhpc", storage=_journal(study.path)).trials
    assert len(trials) == 12 and {t.state.name for t in trials} == {"COMPLETE"}
    assert sorted(t.value for t in trials) == sorted(table["val_loss"])


def test_a_pack_is_recorded_once_when_a_slice_thought_dead_finishes_it_too(tmp_path):
    """A slice whose lock was lost (seen dead) and that finishes its pack after another took it over: the
    second finish is refused, so the pack's rows are those of the first, once."""
    lost, other = Study(tmp_path), Study(tmp_path)
    with lost.locked():
        lost.ensure_plan(lambda: [[{"lr": 0.1}]])
    lost.join("lost", ("val_loss", "min"))
    with lost.locked():
        lost.claim("lost", None, 1, 0)
    lost._alive.release()  # its lock released, the process alive
    other.join("other", ("val_loss", "min"))
    with other.locked():
        assert other.claim("other", None, 1, 0)["pack"] == 0  # taken over
        assert other.finish("other", 0, [{"trial_id": "0-0", "by": "other"}])
    with lost.locked():
        assert not lost.finish("lost", 0, [{"trial_id": "0-0", "by": "lost"}])
        assert lost.results()["by"].tolist() == ["other"]
    finishes = [e for e in map(json.loads, (tmp_path / LEDGER_FILE).read_text().splitlines()) if e["event"] == "finish"]
    assert [e["slice"] for e in finishes] == ["other"]


def test_an_array_task_goes_on_with_a_dead_tasks_trial_from_its_checkpoint_in_the_study(tmp_path):
    """A study's array task checkpoints each epoch's end in the study's pack folder (as a Ray slice's packs do):
    the trial a task held when it died goes on from there in the task that claims it next, and ends with the
    weights of a run never stopped. Checked: a restore that finds nothing fails (it starts again at epoch 0)."""
    import torch

    from rayhpc.engine.checkpoint import latest_checkpoint
    from rayhpc.job import bind_task
    from rayhpc.tune.config import bind_sweep
    from rayhpc.tune.single import train_alone
    from rayhpc.tune.study_array import prepare_tasks, run_task
    from rayhpc.tune.trainable import load_pack_state

    cfg = SweepConfig(study=tmp_path / "s", num_samples=1, epochs=3, data={"synthetic": {"num_samples": 400}})
    cfg, study, _ = as_slice(cfg, {"num_samples", "epochs", "data"})
    cfg, task, info, _ = bind_task(cfg, bind_sweep)
    prepare_tasks(study, cfg, task, info)
    dead = Study(study.path)  # a task that claimed the trial and died after its first epoch's checkpoint
    dead.join("dead", info.objective)
    with dead.locked():
        hp = {**cfg.defaults(task.hp_model), **dead.claim("dead", None, 1, 1)["members"][0]}
    train_alone(task, hp, cfg, folder=study.pack_dir(0), then=lambda values, epoch: epoch == 1)
    dead._alive.release()
    assert run_task(study) == 1
    state = load_pack_state(latest_checkpoint(study.pack_dir(0)))
    assert (state["epoch"], state["metrics"]["resumed_from_epoch"]) == (3, 1), state["metrics"]
    whole = train_alone(task, hp, cfg)["model"].state_dict()
    for key, value in whole.items():
        torch.testing.assert_close(state["model"][key], value, msg=lambda m: f"{key}: {m}")
    with study.locked():
        assert study.results()[["trial_id", "status", "iterations"]].values.tolist() == [["0-0", "finished", 3]]


def test_a_slices_optuna_journal_pickles_as_tune_saves_the_searcher_that_holds_it(tmp_path):
    """Tune saves a slice's searcher whole (cloudpickle), and with it the Optuna journal and the journal's lock: the
    lock pickles as its path, a new lock that is not held (a flock belongs to the process that took it)."""
    import optuna
    import ray.cloudpickle as cloudpickle
    from filelock import Timeout

    from rayhpc.study.folder import file_lock
    from rayhpc.tune.slice_search import _journal

    storage = cloudpickle.loads(cloudpickle.dumps(_journal(tmp_path)))
    study = optuna.create_study(study_name="rayhpc", storage=storage)
    study.tell(study.ask(), 1.0)
    assert len(optuna.load_study(study_name="rayhpc", storage=_journal(tmp_path)).trials) == 1
    lock = file_lock(tmp_path / "held.lock")
    lock.acquire()
    copy = cloudpickle.loads(cloudpickle.dumps(lock))
    assert (copy.lock_file, copy.is_locked) == (lock.lock_file, False)
    with pytest.raises(Timeout):
        copy.acquire(timeout=0)
    lock.release()
