"""Every job resumes from its newest complete checkpoint: several complete ones and a newer one half written (a
job killed while saving) in each job's own layout; the finder each job resumes from (or starts from, for
--init-from) picks the newest complete one, never the half-written one and never an older one.
(`rayhpc train` and sweeps resume from what Ray Train and Tune registered: their own records.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rayhpc.engine.checkpoint import PROGRESS_FILE, SERVER_DIR, Progress, latest_checkpoint, prune, write_progress
from rayhpc.ps.progress import latest_checkpoint as ps_latest
from rayhpc.study.folder import save_pack_checkpoint
from rayhpc.tune.trainable import PACK_CHECKPOINTS
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
        for index in range(2):  # the last one: one server's shard of two complete, the other's being written
            saved(folder / SERVER_DIR.format(index=index), step, complete=step < 40 or index == 0)
    assert ps_latest(cfg) == tmp_path / "checkpoint_000030"
    assert not (tmp_path / "checkpoint_000040" / PROGRESS_FILE).exists()


def test_init_from_starts_from_the_trials_newest_complete_checkpoint(tmp_path):
    trial = tmp_path / "train_fn_3f2a1_00002_2_lr=0.01"
    for step in STEPS:
        saved(trial / f"checkpoint_{step // 10 - 1:06d}", step)
    saved(trial / "checkpoint_000003", 40, complete=False)
    assert init_from_checkpoint(tmp_path, "3f2a1_00002", "3f2a1_00002", str(tmp_path)) == (trial, trial / "checkpoint_000002")
    # a plain sweep's pack keeps its own in `pack/`, named by step, beside the empty one Tune was given first
    own = tmp_path / "train_pack_4b3c2_00000_0_pack=0"
    (own / "checkpoint_000000").mkdir(parents=True)
    for step in STEPS:
        saved(own / PACK_CHECKPOINTS / f"checkpoint_{step:06d}", step)
    assert init_from_checkpoint(tmp_path, "4b3c2_00000", "4b3c2_00000-1", str(tmp_path)) \
        == (own, own / PACK_CHECKPOINTS / "checkpoint_000030")


def test_a_study_pack_resumes_from_its_newest_checkpoint_and_never_sees_one_being_written(tmp_path):
    """A study's packs are checkpointed in the layout and found by the finder of every job (the slices of
    several allocations read them): a folder renamed into place whole, the older ones pruned."""
    def write(epoch):
        return lambda folder: (folder.joinpath("model.pt").write_bytes(b"weights"),
                               write_progress(folder, Progress(epoch=epoch, global_step=10 * epoch)))

    for epoch in (1, 2):
        save_pack_checkpoint(tmp_path, 10 * epoch, write(epoch))
    assert [p.name for p in tmp_path.glob("checkpoint_*")] == ["checkpoint_000020"]  # the older one removed
    # another slice that trained the same pack saves the same step: the checkpoint there stands, whole
    assert save_pack_checkpoint(tmp_path, 20, lambda folder: folder.joinpath("model.pt").write_bytes(b"other")) \
        == tmp_path / "checkpoint_000020"
    assert (tmp_path / "checkpoint_000020" / "model.pt").read_bytes() == b"weights"
    assert not list(tmp_path.glob(".tmp-*")), "the other slice's copy was left behind"
    saved(tmp_path / "checkpoint_000010", 10)  # a slice killed after its rename, before the removal
    (tmp_path / ".tmp-half").mkdir()  # and one killed while it wrote epoch 3's
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint_000020", sorted(tmp_path.iterdir())
    # a plain sweep's pack told to keep its latest 2 (`--keep-checkpoints 2`)
    for epoch in (3, 4, 5):
        save_pack_checkpoint(tmp_path, 10 * epoch, write(epoch), keep=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == ["checkpoint_000040", "checkpoint_000050"]


def test_pruning_keeps_the_newest_complete_checkpoints_and_the_one_being_written(tmp_path):
    """The model-parallel job's and the parameter server's pruner: of complete checkpoints at 10, 20 and 30, a
    save at 5 that a failure cut short and one at 40 being written, keeping 2 leaves 20, 30 and 40."""
    for step in STEPS:
        saved(tmp_path / f"checkpoint_{step:06d}", step)
    for step in (5, 40):
        saved(tmp_path / f"checkpoint_{step:06d}", step, complete=False)
    prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"checkpoint_{s:06d}" for s in (20, 30, 40)]
    prune(tmp_path, 3)  # as many as there are: nothing goes
    assert len(list(tmp_path.iterdir())) == 3
