"""Slices of one study on two real Ray clusters: a TPE sweep run together, a slice SIGKILLed and started
again, every trial exactly once. (The study folder's bookkeeping alone: tests/unit/test_study_folder.py.)"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil

from helpers import ROOT, job_env, run_job
from rayhpc.engine.checkpoint import load_progress
from rayhpc.study.folder import LEDGER_FILE, LOCK_FILE, PACKS_DIR, RESULTS_FILE, SLICES_DIR
from rayhpc.tune.slice_search import _journal

# a small discrete space (8 configurations): 64 trials find its best in any order of proposals, so that the
# best of two slices is comparable with one slice's (a trial's result depends on its configuration alone);
# 12000 samples: a pack takes long enough (seconds an epoch) for the test to see one checkpointed and unfinished
# on a loaded machine too (with 4000, a slice on 2 CPUs once ran its 3 packs between two looks)
SWEEP = ("search: optuna\nnum_samples: 64\nepochs: 4\nseed: 3\ndata: {synthetic: {num_samples: 12000}}\n"
         "space: {hidden: {choice: [16, 64]}, lr: {choice: [0.003, 0.01, 0.03, 0.1]}}\n")


def events(study: Path) -> list[dict]:
    return [json.loads(line) for line in (study / LEDGER_FILE).read_text().splitlines()]


def slice_proc(config: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "jobs" / "tune_mlp.py"), "--config", str(config), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=job_env(env))


def wait_for_checkpoint(study: Path, slice_name: str, proc: subprocess.Popen) -> int:
    """A pack that slice `slice_name` holds and has checkpointed (epoch 1 or later) but not finished."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        if (study / LEDGER_FILE).exists():
            claimed = {e["pack"] for e in events(study) if e["event"] == "claim" and e["slice"] == slice_name}
            done = {e["pack"] for e in events(study) if e["event"] == "finish"}
            for pack in sorted(claimed - done):
                if list((study / PACKS_DIR / str(pack)).glob("checkpoint_*")):
                    return pack
        time.sleep(0.05)
    raise AssertionError(f"slice {slice_name} checkpointed no pack in 180 s")


def frozen(proc: subprocess.Popen, study: Path) -> list[psutil.Process]:
    """`proc` and every process it started (its own Ray: the slice's trial processes too) stopped (SIGSTOP) at a
    moment none of them holds the study's lock, so that the other slices go on."""
    while True:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            p.suspend()
        fd = os.open(study / LOCK_FILE, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return tree
        except BlockingIOError:
            for p in tree:
                p.resume()
        finally:
            os.close(fd)
        time.sleep(0.01)


def test_two_slices_on_two_clusters_run_one_tpe_sweep_and_a_killed_slice_loses_and_repeats_nothing(
        ray_address, tmp_path):
    study, config = tmp_path / "study", tmp_path / "sweep.yaml"
    config.write_text(f"study: {study}\n{SWEEP}")
    # the slice on a cluster of its own claims a pack, and is held (SIGSTOP) until the second slice has claimed one
    # and checkpointed it: otherwise a loaded machine lets either finish every pack before the other claims any
    other = slice_proc(config, env={"RAY_OVERRIDE_RESOURCES": '{"CPU": 1}'})
    deadline = time.monotonic() + 180
    while not ((study / LEDGER_FILE).exists() and any(e["event"] == "claim" for e in events(study))):
        assert other.poll() is None and time.monotonic() < deadline, other.stdout.read()
        time.sleep(0.05)
    held = frozen(other, study)
    first = slice_proc(config, "--address", ray_address)  # a slice on the suite's cluster, to be killed
    deadline = time.monotonic() + 300  # a cold driver on 2 cores that CI's Slurm session also loads
    while len({e["slice"] for e in events(study) if e["event"] == "slice"}) < 2:
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.05)
    doomed = [e["slice"] for e in events(study) if e["event"] == "slice"][1]
    orphan = wait_for_checkpoint(study, doomed, first)
    first.kill()  # SIGKILL: no clean-up at all, its packs claimed and unfinished
    first.wait()
    for p in held:
        p.resume()
    again = run_job("tune_mlp.py", "--study", str(study), "--address", ray_address)  # the study's own definition
    assert again.returncode == 0, again.stdout + again.stderr
    out, _ = other.communicate(timeout=300)
    assert other.returncode == 0, out

    log = events(study)
    slices = [e["slice"] for e in log if e["event"] == "slice"]
    finished = collections.Counter(e["pack"] for e in log if e["event"] == "finish")
    story = [(e["event"], slices.index(e["slice"]) if e.get("slice") in slices else None, e.get("pack"))
             for e in log]  # (event, slice 0-2, pack): what a failure prints
    assert len(slices) == 3 and set(finished.values()) == {1}, story  # every pack finished once
    by_slice = collections.Counter(e["slice"] for e in log if e["event"] == "finish")
    # the other cluster's slice ran some; the third, a cold start of its own, may find the killed slice's packs taken
    # over already by the other, which then runs them (once each, as below)
    assert slices[0] in by_slice, story
    claims = [e["slice"] for e in log if e["event"] == "claim" and e["pack"] == orphan]
    assert claims[0] == doomed and len(claims) == 2, story  # the killed slice's pack, taken over once
    assert [e["slice"] for e in log if e["event"] == "finish" and e["pack"] == orphan] == claims[1:], story
    table = pd.read_parquet(study / RESULTS_FILE)
    assert len(table) == 64 and table["trial_id"].is_unique and set(table["status"]) == {"finished"}
    # each pack's checkpoint is its last step's (4 epochs), the older pruned; the orphan resumed from its own
    for pack in finished:
        kept = list((study / PACKS_DIR / str(pack)).glob("checkpoint_*"))
        assert len(kept) == 1 and load_progress(kept[0]).epoch == 4, (pack, kept)
    # the slice that took it over (the killed one's trial folder is there or not, with or without a result,
    # depending on whether Tune synced its experiment state before the SIGKILL) reported first an epoch after the
    # checkpoint's: it went on from epoch 1 or later, or, where the killed slice had saved the last epoch before
    # the kill (a loaded node), reported that epoch's metrics again without training
    resumed = [json.loads(r.read_text().splitlines()[0]) for r in (study / SLICES_DIR / claims[1]).glob("*/result.json")
               if json.loads((r.parent / "params.json").read_text())["pack"] == orphan]
    assert [r["epoch"] >= 2 for r in resumed] == [True], resumed
    # Optuna's study holds each of the 64 trials once, every one told its value
    import optuna

    trials = optuna.load_study(study_name="rayhpc", storage=_journal(study)).trials
    assert len(trials) == 64 and {t.state.name for t in trials} == {"COMPLETE"}
    assert sorted(t.value for t in trials) == sorted(table["val_loss"])

    # one slice alone, the same budget: two slices find a best at least as good
    alone, config_alone = tmp_path / "alone", tmp_path / "alone.yaml"
    config_alone.write_text(f"study: {alone}\n{SWEEP}")
    proc = run_job("tune_mlp.py", "--config", str(config_alone), "--address", ray_address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    best_alone = pd.read_parquet(alone / RESULTS_FILE)["best_val_loss"].min()
    # equal (up to float rounding: the same configuration trained in packs of other members) or better
    assert table["best_val_loss"].min() <= best_alone * (1 + 1e-5), (table["best_val_loss"].min(), best_alone)
    status = subprocess.run([sys.executable, "-m", "rayhpc", "status", "--study", str(study)], capture_output=True,
                            text=True, cwd=ROOT, env=job_env(None))
    assert status.returncode == 0 and "64 finished" in status.stdout and "0 running" in status.stdout, status
    assert os.stat(study).st_mode & 0o777 == 0o700


# the dropout task (random masks at every step) sleeping 150 ms a step: a pack's 3 epochs of 8 steps take about
# 4 s, so a slice is stopped in the middle of one; 24 steps of 8 an epoch
STEPS_SWEEP = (f"task: {ROOT / 'tests' / 'tasks' / 'dropout.py'}:Dropout\nsearch: random\nnum_samples: 4\npack: 2\n"
               "steps: 24\nseed: 5\nspace: {lr: {loguniform: [0.003, 0.1]}, step_ms: {choice: [150]}}\n")


def test_a_slice_stopped_by_sigterm_mid_pack_leaves_it_to_be_finished_once_as_if_never_stopped(ray_address, tmp_path):
    """SIGTERM (scancel's, a time limit's) to a slice of a `--steps` study while it trains a pack: the slice ends
    with its one line, recording nothing of that pack as finished; the next slice claims it again and finishes
    it from its checkpoint, once, with the values an uninterrupted study's slice gets."""
    study, config = tmp_path / "study", tmp_path / "sweep.yaml"
    config.write_text(f"study: {study}\n{STEPS_SWEEP}")
    first = slice_proc(config, "--address", ray_address)
    deadline = time.monotonic() + 120
    while not ((study / LEDGER_FILE).exists() and events(study)):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.05)
    stopped = events(study)[0]["slice"]
    pack = wait_for_checkpoint(study, stopped, first)
    first.terminate()
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 128 + 15 and "interrupted by SIGTERM" in out, out[-3000:]
    assert pack not in {e["pack"] for e in events(study) if e["event"] == "finish"}, events(study)
    again = run_job("tune_mlp.py", "--study", str(study), "--address", ray_address)
    assert again.returncode == 0, again.stdout + again.stderr

    log = events(study)
    finished = collections.Counter(e["pack"] for e in log if e["event"] == "finish")
    assert sorted(finished) == [0, 1] and set(finished.values()) == {1}, finished
    claims = [e["slice"] for e in log if e["event"] == "claim" and e["pack"] == pack]
    assert claims[0] == stopped and len(claims) == 2, claims
    # each trial of the pack's first result; the stopped slice's trial may have none (stopped after its trial
    # saved the checkpoint, before the driver recorded the result that came with it)
    firsts = [r.read_text().splitlines()[:1] for r in (study / SLICES_DIR).glob("*/*/result.json")
              if json.loads((r.parent / "params.json").read_text())["pack"] == pack]
    resumed = [json.loads(first[0])["resumed_from_epoch"] for first in firsts if first]
    assert resumed and max(resumed) >= 1, resumed  # from the stopped slice's checkpoint, not from the start
    alone, config_alone = tmp_path / "alone", tmp_path / "alone.yaml"
    config_alone.write_text(f"study: {alone}\n{STEPS_SWEEP}")
    proc = run_job("tune_mlp.py", "--config", str(config_alone), "--address", ray_address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    columns = ["config.lr", "val_loss", "best_val_loss", "iterations"]
    got, want = (pd.read_parquet(s / RESULTS_FILE).sort_values("config.lr")[columns].reset_index(drop=True)
                 for s in (study, alone))
    assert len(got) == 4 and set(pd.read_parquet(study / RESULTS_FILE)["status"]) == {"finished"}, got
    pd.testing.assert_frame_equal(got, want, check_exact=True)
