"""The connection file of `rayhpc up`: trusted only where it is the user's alone, and a cluster that is gone is
noticed from /proc at once, without a connection attempt. (The real cluster: tests/ray/test_user_cluster.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from rayhpc import user_cluster
from rayhpc.monitor.startup import start_ticks
from rayhpc.private import UnsafePath


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(user_cluster.HOME_VARIABLE, str(tmp_path / "home"))
    return tmp_path / "home"


def info(pid: int, port: int, tmp_path) -> dict:
    return {"address": f"127.0.0.1:{port}", "ports": {"gcs": port}, "pid": pid, "pid_start": start_ticks(pid),
            "marker": "none-such", "temp_dir": str(tmp_path / "t"), "ray_tmpdir": str(tmp_path / "r"),
            "token_path": None}


def test_a_cluster_is_alive_while_its_process_runs_and_its_port_is_ours(home, tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert user_cluster.problem(info(os.getpid(), port, tmp_path)) is None
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead = {**info(os.getpid(), port, tmp_path), "pid": int(ended.stdout)}
        assert user_cluster.problem(dead) == f"its process {dead['pid']} has ended"
        reused = {**info(os.getpid(), port, tmp_path), "pid_start": start_ticks() - 1}  # the pid, another process
        assert user_cluster.problem(reused) == f"its process {os.getpid()} has ended"
    assert user_cluster.problem(info(os.getpid(), port, tmp_path)) == f"nothing of yours listens on its port {port}"


def test_a_gone_cluster_is_noticed_at_once_and_its_file_removed(home, tmp_path, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it
    (tmp_path / "t").mkdir()
    user_cluster.write(info(os.getpid(), port, tmp_path))
    started = time.monotonic()
    with caplog.at_level("INFO", logger="rayhpc"):
        assert user_cluster.find() is None
    assert time.monotonic() - started < 1.0  # no connection attempt, no time-out
    assert [r.getMessage() for r in caplog.records] == [
        f"ray: the cluster of `rayhpc up` in {user_cluster.path()} is gone (nothing of yours listens on its port "
        f"{port}); this job starts a Ray of its own"]
    assert not user_cluster.path().exists() and not (tmp_path / "t").exists()


def test_a_connection_file_others_can_write_is_not_used(home, tmp_path):
    user_cluster.write(info(os.getpid(), 1, tmp_path))
    os.chmod(user_cluster.path(), 0o644)
    with pytest.raises(UnsafePath, match="is not yours alone"):
        user_cluster.read()
    os.chmod(user_cluster.path(), 0o600)
    os.chmod(user_cluster.path().parent, 0o777)
    with pytest.raises(UnsafePath, match="can be written by other users"):
        user_cluster.read()


def test_no_file_no_cluster(home):
    assert user_cluster.find() is None and not home.exists()  # looking creates nothing


def test_up_refuses_bad_input_before_starting_anything_and_down_without_a_cluster_says_so(home):
    def rayhpc(*args):
        return subprocess.run([sys.executable, "-m", "rayhpc", *args], capture_output=True, text=True,
                              env={**os.environ, user_cluster.HOME_VARIABLE: str(home)})

    bad = rayhpc("up", "--num-cpus", "-1")
    assert bad.returncode == 2 and bad.stderr == ("error: num_cpus (--num-cpus) -1: expected a number >= 0 "
                                                  "(see --help)\n"), bad.stderr
    assert not home.exists()  # nothing started, nothing written
    idle = rayhpc("down")
    assert idle.returncode == 0 and idle.stdout.startswith("no cluster of yours is up on "), idle.stdout
