"""Sweeps of distributed trials (2 workers each, gloo) on warm worker groups, on a real local Ray.

Every trial is checked against a plain-PyTorch two-rank reference with dropout (each rank its own
DistributedSampler shard and its own random stream), the second and third trials on the same warm
group included, so that anything one trial left on the group (model, optimizer state, RNG, sampler
epoch) would show.
"""

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import ray
from ray.tune import Callback

from helpers import FIXED, ROOT, assert_same_weights, sweep, two_ranks
from rayhpc.engine.checkpoint import latest_checkpoint, load_full_state_dict, load_progress
from rayhpc.tune.sweep import run_sweep

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
EPOCHS = 3
TASK = f"{ROOT / 'tests' / 'tasks' / 'dropout.py'}:Dropout"
LRS = [0.03, 0.01, 0.1]
pytestmark = pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)


def dist_sweep(tmp_path, name: str, lrs=LRS, **kw):
    # one slot (max_concurrent 1): every trial of the warm sweep runs on the same group, one after another
    return run_sweep(sweep(tmp_path, name=name, task=TASK, search="grid", epochs=EPOCHS, workers_per_trial=2,
                           max_concurrent=1, space={"lr": {"grid": lrs}, **FIXED}, **kw))


def trial_folder(exp: Path, trial_id: str) -> Path:
    """Where a trial's checkpoints are: Tune's trial folder."""
    return next(p for p in exp.iterdir() if p.is_dir() and trial_id in p.name and (p / "params.json").exists())


def final_weights(exp: Path, table: pd.DataFrame) -> dict[float, dict]:
    """lr -> the weights of that trial's last checkpoint, which must be its last epoch's."""
    out = {}
    for trial_id, lr in zip(table["trial_id"], table["config.lr"]):
        ckpt = latest_checkpoint(trial_folder(exp, trial_id))
        assert load_progress(ckpt).epoch == EPOCHS, ckpt
        out[lr] = load_full_state_dict(ckpt)
    return out


def group_rows(exp: Path, trial_id: str) -> pd.DataFrame:
    return pd.read_parquet(exp / f"train-trial_id={trial_id}" / "metrics.parquet")


@pytest.fixture(scope="module")
def runs(ray_address, tmp_path_factory):
    """Three trials one after another on one warm group (10 s on 2 CPUs)."""
    tmp = tmp_path_factory.mktemp("warm")
    return {"warm": (tmp / "warm", dist_sweep(tmp, "warm"))}


def test_trials_on_one_warm_group_equal_plain_ddp(runs):
    exp, table = runs["warm"]
    assert set(table["status"]) == {"finished"} and set(table["iterations"]) == {EPOCHS}
    weights = final_weights(exp, table)
    assert sorted(weights) == sorted(LRS)
    for lr in LRS:
        assert_same_weights(weights[lr], two_ranks(lr))
    # the three trials ran one after another on one group, started once
    rows = {tid: group_rows(exp, tid) for tid in table["trial_id"]}
    assert sorted(int(r["group_trial"].iloc[0]) for r in rows.values()) == [1, 2, 3]
    for r in rows.values():
        assert r["epoch"].tolist() == list(range(1, EPOCHS + 1)) and set(r["world_size"]) == {2}
        assert (r["group_start_s"] > 0).all() == (r["group_trial"].iloc[0] == 1)
    best = rows[table.loc[table["best_val_loss"].idxmin(), "trial_id"]]
    assert best["val_loss"].iloc[-1] < 0.9 * best["val_loss"].iloc[0]  # it learned


class KillRankOnce(Callback):
    """In the sweep's driver: after the first trial's epoch-1 result, SIGKILL one rank of the warm
    group a little later (while it trains epoch 2); logs the killed PID."""

    def __init__(self, log: str, dashboard: str, delay_s: float = 0.2):
        """`dashboard`: the session cluster's dashboard URL, which the state API is asked through (left to
        find a cluster by itself, it fails wherever a second Ray runs on the machine)."""
        self.log, self.dashboard, self.delay_s, self.done = log, dashboard, delay_s, False

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.done or result.get("epoch") != 1:
            return
        self.done = True
        threading.Timer(self.delay_s, self._kill).start()

    def _kill(self):
        from ray.util.state import list_actors

        alive = [("class_name", "=", "RankWorker"), ("state", "=", "ALIVE")]
        ranks = list_actors(address=self.dashboard, filters=alive)
        pid = max(r.pid for r in ranks)
        os.kill(pid, signal.SIGKILL)
        Path(self.log).write_text(json.dumps({"pid": pid, "ranks": len(ranks)}))


def test_a_killed_rank_restarts_the_group_and_the_trial_ends_equal(ray_cluster, runs, tmp_path):
    log = tmp_path / "killed.json"
    lrs = LRS[:2]
    table = run_sweep(sweep(tmp_path, name="killed", task=TASK, search="grid", epochs=EPOCHS, workers_per_trial=2,
                            max_concurrent=1, space={"lr": {"grid": lrs}, **FIXED}),
                      callbacks=(KillRankOnce(str(log), f"http://{ray_cluster['webui_url']}"),))
    killed = json.loads(log.read_text())
    assert killed["ranks"] == 2
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)
    assert set(table["status"]) == {"finished"} and set(table["iterations"]) == {EPOCHS}
    exp = tmp_path / "killed"
    warm_exp, warm_table = runs["warm"]
    want = final_weights(warm_exp, warm_table)
    for lr, got in final_weights(exp, table).items():
        assert_same_weights(got, want[lr])  # equal to the uninterrupted trials (and so to the reference)
    # the first trial's epochs after the kill ran on a group started again; the sweep went on on it
    first, second = (group_rows(exp, tid) for tid in table["trial_id"])
    assert first["epoch"].tolist() == [1, 2, 3]
    assert first["group_trial"].tolist() == [1, 1, 1] and (first["group_start_s"] > 0).all()
    assert set(second["group_trial"]) == {2} and (second["group_start_s"] == 0).all()


def test_trials_that_asha_stops_hand_their_group_to_the_next(ray_address, tmp_path):
    lrs = [0.1, 1e-5, 0.03, 1e-6]  # the tiny rates lose at the first rung
    table = run_sweep(sweep(tmp_path, name="asha", task=TASK, search="grid", epochs=EPOCHS, workers_per_trial=2,
                            max_concurrent=1, scheduler="asha", asha={"grace_period": 1, "reduction_factor": 2},
                            space={"lr": {"grid": lrs}, **FIXED, "step_ms": 0.0}))
    assert "early-stopped" in set(table["status"]), table[["config.lr", "status", "iterations"]]
    starts = [group_rows(tmp_path / "asha", tid) for tid in table["trial_id"]]
    # one group for the whole sweep: started by the first trial, taken over by each next one
    assert sorted(int(r["group_trial"].iloc[0]) for r in starts) == [1, 2, 3, 4]
    assert sum(bool((r["group_start_s"] > 0).any()) for r in starts) == 1


def test_fsdp_trials_on_a_warm_group_equal_the_ddp_ones(runs, tmp_path):
    table = dist_sweep(tmp_path, "fsdp", lrs=LRS[:2], strategy="fsdp")
    assert set(table["status"]) == {"finished"}
    warm_exp, warm_table = runs["warm"]
    want = final_weights(warm_exp, warm_table)
    for lr, got in final_weights(tmp_path / "fsdp", table).items():  # gathered from both ranks' shards
        assert_same_weights(got, want[lr])
    # saved as under Ray Train: each rank's DCP shard file and the metadata, no rank's whole model.pt
    for tid in table["trial_id"]:
        files = {p.name for p in latest_checkpoint(trial_folder(tmp_path / "fsdp", tid)).iterdir()}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng.pt", "progress.json"} <= files, files
        assert "model.pt" not in files, files
    # rank 0 held about half of the parameters (FSDP2 shards dim 0; a DDP rank holds all 3 * 16 + 16 + 16 + 1)
    whole = sum(t.numel() for t in want[LRS[0]].values())
    for tid in table["trial_id"]:
        held = group_rows(tmp_path / "fsdp", tid)["rank0_param_elements"].iloc[0]
        assert whole // 2 <= held < whole, (held, whole)


def test_optuna_proposes_distributed_trials_on_one_warm_group(ray_address, tmp_path):
    table = run_sweep(sweep(tmp_path, name="tpe", task=TASK, search="optuna", num_samples=4, epochs=2,
                            workers_per_trial=2, max_concurrent=1,
                            space={"lr": {"loguniform": [0.01, 0.3]}, **FIXED, "step_ms": 0.0}))
    assert len(table) == 4 and set(table["status"]) == {"finished"} and table["config.lr"].nunique() == 4
    rows = [group_rows(tmp_path / "tpe", tid) for tid in table["trial_id"]]
    assert sorted(int(r["group_trial"].iloc[0]) for r in rows) == [1, 2, 3, 4]
