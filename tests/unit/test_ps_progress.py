"""The parameter server's record of a run across sessions whose drivers were killed (no Ray: the record alone)."""

import time

import pandas as pd

from rayhpc.config import validate
from rayhpc.ps.config import PSConfig
from rayhpc.ps.progress import STEPS_FILE, Progress


def record(worker: int, step: int) -> dict:
    return {"worker": worker, "step": step, "loss": 0.5, "samples": 16, "staleness": 0, "versions": [step],
            "pull_s": 0.01, "compute_s": 0.01, "push_s": 0.01, "wait_s": 0.0, "bytes": 100, "zero_copy": True,
            "lost": False, "time": time.time()}


def test_sessions_whose_steps_were_never_recorded_leave_a_record_the_next_resume_reads(tmp_path):
    """A first driver killed before it recorded a step, its servers having saved step 8 (the end of epoch 1)
    before Ray ended them: the resumed session writes epoch 1's row from its validation alone, and is stopped
    before epoch 2's row. A third session resumes at step 16 from that record; then epoch 3's steps are
    recorded and kept."""
    cfg = validate(PSConfig, {"storage_path": str(tmp_path), "name": "ps", "epochs": 3, "compute": {"num_workers": 2}})
    hp = {"lr": 0.01, "warmup_steps": 0, "decay": "constant", "min_lr_ratio": 0.0}
    made = {"steps_per_epoch": 8, "validates": True, "hp": hp, "total_steps": 24, "epochs": 3}
    cfg.experiment_dir.mkdir(parents=True)
    second = Progress(cfg, made, time.time())
    second.restart_at(8)
    second.add({"epoch": 0, "val": {"val_loss": 0.5}})
    second.add({"records": [record(w, s) for w in (0, 1) for s in range(8, 12)]})  # stopped mid-epoch 2
    third = Progress(cfg, made, time.time())
    third.restart_at(16)
    third.add({"epoch": 1, "val": {"val_loss": 0.4}})
    third.add({"records": [record(w, s) for w in (0, 1) for s in range(16, 24)]})
    third.add({"epoch": 2, "val": {"val_loss": 0.3}})
    rows = pd.read_parquet(cfg.experiment_dir / "metrics.parquet")
    assert rows["epoch"].tolist() == [1, 2, 3] and rows["val_loss"].tolist() == [0.5, 0.4, 0.3]
    steps = pd.read_parquet(cfg.experiment_dir / STEPS_FILE)
    assert sorted(set(steps["step"])) == list(range(16, 24)) and len(steps) == 16
