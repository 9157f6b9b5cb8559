"""Every reader of a folder refuses it, in one line naming the path and its mode, where another user may have
written into it: a file inside it group-writable (0664) or world-writable (0606), or the folder itself
group-writable (0770). Whatever it would have loaded (a pickle, a checkpoint, a task file, a table, an address
that gets the token) is never read. (The same attacks made by a second Unix user: tests/ray/test_local_security.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from rayhpc import user_cluster
from rayhpc.config import ConfigError, reconcile_resume, validate
from rayhpc.private import UnsafePath
from rayhpc.study.slice import open_study
from rayhpc.tracking.sync import sync
from rayhpc.tune.config import SweepConfig
from rayhpc.tune.export import export_best
from rayhpc.tune.warm_start import check_warm_start
from rayhpc.tune.weights import trial_weights

BREACHES = {"file 0664": 0o664, "file 0606": 0o606, "folder 0770": 0o770}


def resume(folder: Path) -> None:
    cfg = validate(SweepConfig, {"name": folder.name, "storage_path": str(folder.parent), "resume": True})
    reconcile_resume(cfg, {"name", "storage_path", "resume"})


READERS = {
    "--resume": resume,
    "--study": lambda folder: open_study(folder, create=False),
    "--warm-start": check_warm_start,
    "--init-from": lambda folder: trial_weights(str(folder), ("val_loss", "min")),
    "rayhpc export": lambda folder: export_best(folder, 1, folder.parent / "exported"),
    "rayhpc sync": sync,
}


def breached(folder: Path, breach: str) -> tuple[Path, int]:
    """`folder`, or a file inside it, given the breach's mode; (what was opened up, its mode)."""
    mode = BREACHES[breach]
    culprit = folder if breach.startswith("folder") else next(p for p in folder.rglob("*") if p.is_file()
                                                              and p.name == "tuner.pkl")
    culprit.chmod(mode)
    return culprit, mode


@pytest.mark.parametrize("breach", BREACHES)
@pytest.mark.parametrize("reader", READERS)
def test_a_folder_others_may_write_into_is_refused_by_every_reader(reader, breach, tmp_path):
    storage = tmp_path / "storage"
    storage.mkdir(mode=0o700)
    validate(SweepConfig, {"name": "swept", "storage_path": str(storage)}).save()  # a sweep's folder, sweep.yaml
    folder = storage / "swept"
    (folder / "train_pack_00000").mkdir(mode=0o700)
    (folder / "train_pack_00000" / "tuner.pkl").write_bytes(b"not loaded")
    (folder / "train_pack_00000" / "tuner.pkl").chmod(0o600)
    culprit, mode = breached(folder, breach)
    with pytest.raises((ConfigError, UnsafePath)) as refused:
        READERS[reader](folder)
    message = str(refused.value)
    assert f"{culprit} (mode {mode:04o})" in message and "\n" not in message, message


@pytest.mark.parametrize("breach", BREACHES)
def test_a_connection_file_others_may_write_or_swap_is_refused(breach, tmp_path):
    """The file that names the user's cluster (its address gets the token): itself writable by others, or in a
    folder others can write."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    file = home / "cluster.json"
    file.write_text('{"address": "127.0.0.1:1"}')
    file.chmod(0o600)
    culprit = home if breach.startswith("folder") else file
    culprit.chmod(BREACHES[breach])
    with pytest.raises(UnsafePath) as refused:
        user_cluster.read(file)
    message = str(refused.value)
    assert str(culprit) in message and f"{BREACHES[breach]:04o}" in message and "\n" not in message, message
