"""Every job resumes from its newest complete checkpoint: several complete ones and a newer one half written (a
job killed while saving) in each job's own layout; the finder each job resumes from (or starts from, for
--init-from) picks the newest complete one, never the half-written one and never an older one.
(`rayhpc train` and sweeps resume from what Ray Train and Tune registered: their own records.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rayhpc.ps.progress import latest_checkpoint as ps_latest
from rayhpc.study.folder import latest_pack_checkpoint, save_pack_checkpoint
from rayhpc.train.checkpoint import PROGRESS_FILE, SERVER_FILE, Progress, latest_checkpoint, write_progress
from rayhpc.tune.weights import _checkpoint as init_from_checkpoint

STEPS = (10, 20, 30)  # the complete ones; a fourth, at 40, is half written


def saved(folder: Path, step: int, complete: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    if complete:
        write_progress(folder, Progress(epoch=step // 10, global_step=step))
    return folder


def test_the_model_parallel_job_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """Named by Ray's timestamps or by step, the folder order is not the training order: the step decides."""
    names = {10: "checkpoint_2026-11-26_10-00-09", 20: "checkpoint_2026-11-26_09-59-59",
             30: "checkpoint_2026-11-26_10-00-00", 40: "checkpoint_2026-11-26_10-00-30"}
    for step in STEPS:
        saved(tmp_path / names[step], step)
    saved(tmp_path / names[40], 40, complete=False)
    assert latest_checkpoint(tmp_path) == tmp_path / names[30]


def test_the_parameter_server_resumes_from_the_newest_checkpoint_that_holds_every_servers_shard(tmp_path):
    cfg = SimpleNamespace(experiment_dir=tmp_path, compute=SimpleNamespace(num_servers=2))
    for step in (*STEPS, 40):
        folder = tmp_path / f"checkpoint_{step:06d}"
        folder.mkdir()
        for index in range(2 if step < 40 else 1):  # the last one: one server's shard of two written
            (folder / SERVER_FILE.format(index=index)).write_bytes(b"shard")
    assert ps_latest(cfg) == tmp_path / "checkpoint_000030"
    assert not (tmp_path / "checkpoint_000040" / PROGRESS_FILE).exists()


def test_init_from_starts_from_the_trials_newest_complete_checkpoint(tmp_path):
    trial = tmp_path / "train_fn_3f2a1_00002_2_lr=0.01"
    for step in STEPS:
        saved(trial / f"checkpoint_{step // 10 - 1:06d}", step)
    saved(trial / "checkpoint_000003", 40, complete=False)
    assert init_from_checkpoint(tmp_path, "3f2a1_00002", "3f2a1_00002", str(tmp_path)) == (trial, trial / "checkpoint_000002")


def test_a_study_pack_resumes_from_its_newest_checkpoint_and_never_sees_one_being_written(tmp_path):
    for epoch in (1, 2):
        save_pack_checkpoint(tmp_path, epoch, lambda folder: (folder / "model.pt").write_bytes(b"weights"))
    assert [p.name[:12] for p in tmp_path.glob("epoch-*")] == ["epoch-000002"]  # the older one removed
    (tmp_path / "epoch-000001-0000dead").mkdir()  # a slice killed after its rename, before the removal
    (tmp_path / ".tmp-half").mkdir()  # and one killed while it wrote epoch 3's
    newest = latest_pack_checkpoint(tmp_path)
    assert newest is not None and newest.name.startswith("epoch-000002-"), sorted(tmp_path.iterdir())
