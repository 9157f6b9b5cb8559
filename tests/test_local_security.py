"""A local job on a machine shared with another Unix user (a login node, a shared allocation): it starts
a Ray of its own in a private folder, and never joins the cluster someone else named first."""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT, job_env
from test_slurm_security import ATTACKER, as_attacker, attacker, world_tmp  # noqa: F401 (fixtures)


JOBS = {"sweep": ["tune_mlp.py", "--num-samples", "2", "--epochs", "2"],
        "training": ["train_mlp.py", "--num-workers", "2", "--epochs", "3"]}


@pytest.mark.parametrize("kind", JOBS)
def test_a_local_job_never_joins_the_cluster_another_user_named_first(kind, attacker, world_tmp, tmp_path):
    """The attack: the other user makes `<tmp>/ray` first (0777, as `ray start --head` does) and names "the"
    cluster in its `ray_current_cluster`: a port they listen on. Ray's default `ray.init()` would connect
    there with the victim's token, code and data, and so would Ray's state API inside the job's workers
    (Ray Train's placement-group cleaner asks it every second whether the controller lives). The job
    (no --address) must not connect and must write nothing under that folder; its own Ray lives in a new
    0700 folder the other user cannot enter, removed when the job ends."""
    shared = world_tmp("rh")  # stands in for /tmp: every user may create entries
    shared.mkdir()
    shared.chmod(0o1777)
    with socket.socket() as trap:
        trap.bind(("", 0))  # every interface: Ray turns 127.0.0.1 into the node's address
        trap.listen()
        trap.setblocking(False)
        port = trap.getsockname()[1]
        assert as_attacker("mkdir", "-m", "777", f"{shared}/ray").returncode == 0
        assert as_attacker("sh", "-c", f"echo 127.0.0.1:{port} > {shared}/ray/ray_current_cluster").returncode == 0

        script, *args = JOBS[kind]
        job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / script), *args, "--storage-path", str(tmp_path)],
                               cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=job_env({"TMPDIR": str(shared), "RAY_TMPDIR": str(shared)}))
        try:
            deadline, own = time.monotonic() + 90, []
            while not own:
                assert job.poll() is None and time.monotonic() < deadline, "no private Ray folder appeared: did the job join the other user's cluster?"
                time.sleep(0.2)
                own = [p for p in shared.iterdir() if p.name.startswith("rayhpc-")]
            mode = stat.S_IMODE(own[0].stat().st_mode)
            entered = as_attacker("ls", str(own[0])).returncode == 0
            output, _ = job.communicate(timeout=180)
        finally:
            job.kill()
        assert job.returncode == 0, output[-3000:]
        try:
            conn, peer = trap.accept()
            conn.close()
            raise AssertionError(f"the {kind} connected to the cluster the other user named ({peer})")
        except BlockingIOError:
            pass  # nobody connected
    assert mode == 0o700 and not entered, (oct(mode), f"{ATTACKER} could list {own[0]}: {entered}")
    assert "started local Ray at" in output, output[-2000:]
    theirs = [p.name for p in (shared / "ray").iterdir()]
    assert theirs == ["ray_current_cluster"], f"the {kind} wrote into the other user's Ray folder: {theirs}"
    left = [p.name for p in shared.iterdir() if p.name.startswith("rayhpc-")]
    assert left == [], f"the local Ray's folder was left behind: {left}"
