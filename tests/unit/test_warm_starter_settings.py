"""The warm starter of workers (`rayhpc up`'s, and every local Ray's own) hands a Ray worker a fork of itself
only where the worker's environment sets the settings that the starter's libraries read as they loaded as the
starter's did; the starter of commands, a command only where it sets those of Ray Data, Ray Tune and AIR so. A
worker that comes while its starter imports waits for it. (The real cluster: tests/ray/test_user_cluster.py.)"""

from __future__ import annotations

import subprocess
import threading
import time

from rayhpc.up.starter import starting
from rayhpc.up.warm import COMMAND_SETTINGS, differing, waiting_for


def test_a_setting_set_otherwise_either_way_counts_and_a_workers_own_and_other_variables_do_not():
    then = {"OMP_NUM_THREADS": "2", "PYTORCH_X": "1", "HF_HOME": "/h", "XDG_CACHE_HOME": "/c"}
    same = {"OMP_NUM_THREADS": "1", "PYTORCH_X": "1", "HF_HOME": "/h", "XDG_CACHE_HOME": "/c", "TMPDIR": "/w",
            "RAY_JOB_ID": "01000000", "PATH": "/bin"}
    assert differing(same, then) == []
    assert differing({**same, "TORCHINDUCTOR_FREEZING": "1"}, then) == ["TORCHINDUCTOR_FREEZING"]  # unset then
    assert differing({k: v for k, v in same.items() if k != "PYTORCH_X"}, then) == ["PYTORCH_X"]  # unset now
    assert differing({**same, "SYMPY_USE_CACHE": "no", "XDG_CACHE_HOME": "/d"}, then) == [
        "SYMPY_USE_CACHE", "XDG_CACHE_HOME"]
    # what Ray's libraries read as the starter loads them: protobuf's implementation, fsspec's and msgpack's
    assert differing({**same, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python", "FSSPEC_S3": "{}",
                      "MSGPACK_PUREPYTHON": "1"}, then) == [
        "FSSPEC_S3", "MSGPACK_PUREPYTHON", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"]
    # the starter of commands: what Ray Data, Ray Tune and AIR read as they load, not torch's
    commands = {"RAY_DATA_X": "1"}
    assert differing({**same, **commands}, commands, COMMAND_SETTINGS) == []
    assert differing({**same, "TUNE_X": "1"}, commands, COMMAND_SETTINGS) == ["RAY_DATA_X", "TUNE_X"]
    assert differing({"RAY_AIR_X": "0", "TORCH_X": "1"}, {"RAY_AIR_X": "1"}, COMMAND_SETTINGS) == ["RAY_AIR_X"]


def test_a_worker_waits_for_a_starter_that_is_starting_and_only_for_one(tmp_path):
    """A worker that comes while the starter imports waits until it listens; not where none is starting there,
    where the one that was has ended, nor past the timeout."""
    path = tmp_path / "node-workers.sock"
    with starting(path):  # this process is the starter, which will listen at 0.5 s
        threading.Timer(0.5, path.touch).start()
        began = time.monotonic()
        waiting_for(path, timeout_s=30)
        waited = time.monotonic() - began
        assert path.exists() and waited >= 0.45, waited
        path.unlink()
        began = time.monotonic()
        waiting_for(path, timeout_s=0.3)  # it never listens
        assert 0.3 <= time.monotonic() - began < 5
    assert not path.with_suffix(".starting").exists()
    began = time.monotonic()
    waiting_for(path)  # none starting
    ended = subprocess.Popen(["true"])
    ended.wait()
    path.with_suffix(".starting").write_text(str(ended.pid))  # a starter killed as it imported
    waiting_for(path)
    assert time.monotonic() - began < 1, "a worker waited for a starter that was not starting"
