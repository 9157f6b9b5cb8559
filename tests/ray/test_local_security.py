"""A local job on a machine shared with another Unix user (a login node, a shared allocation): it starts
a Ray of its own in a private folder, and never joins the cluster someone else named first."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from helpers import ATTACKER, ROOT, as_attacker, job_env, python_as_attacker, run_job_warm
from rayhpc.up.connection import listening_uids

JOBS = {"sweep": ["tune_mlp.py", "--num-samples", "2", "--epochs", "1"],
        # a compiled GPT: inductor builds its precompiled headers (the CPU kernels include them)
        "training": ["train_mlp.py", "--task", "jobs/tasks/gpt.py:GPT", "--hp", "block=16,dim=32,heads=2,layers=2,"
                     "corpus_bytes=4000", "--compile", "blocks", "--num-workers", "1", "--epochs", "1"]}


@pytest.mark.parametrize("kind", JOBS)
def test_a_local_job_never_joins_the_cluster_another_user_named_first(kind, attacker, world_tmp, tmp_path):
    """The attack: the other user makes `<tmp>/ray` first (0777, as `ray start --head` does) and names "the"
    cluster in its `ray_current_cluster`: a port they listen on. Ray's default `ray.init()` would connect
    there with the victim's token, code and data, and so would Ray's state API inside the job's workers
    (Ray Train's placement-group cleaner asks it every second whether the controller lives). The job
    (no --address) must not connect and must write nothing under that folder; its own Ray lives in a new
    0700 folder the other user cannot enter, removed when the job ends. Its results and checkpoints, kept in a
    folder every user can read, are the user's alone: 0700 folders, 0600 files.

    They also make torch's compile cache `<tmp>/torchinductor_<user>` first (0777), with a folder for the
    precompiled headers, which inductor takes as it finds it: the victim's `--compile` job used to build its
    headers there, for the other user to swap for one that runs their code in the victim's next job. The
    compiled job writes nothing there, says so, and leaves nothing in <tmp> (no pymp-*, no compile caches)."""
    shared = world_tmp("rh")  # stands in for /tmp: every user may create entries
    shared.mkdir()
    shared.chmod(0o1777)
    inductor = shared / f"torchinductor_{getpass.getuser()}" / "precompiled_headers"
    assert as_attacker("mkdir", "-m", "777", "-p", str(inductor)).returncode == 0
    assert as_attacker("chmod", "777", str(inductor.parent)).returncode == 0
    with socket.socket() as trap:
        trap.bind(("", 0))  # every interface: Ray turns 127.0.0.1 into the node's address
        trap.listen()
        trap.setblocking(False)
        port = trap.getsockname()[1]
        assert as_attacker("mkdir", "-m", "777", f"{shared}/ray").returncode == 0
        assert as_attacker("sh", "-c", f"echo 127.0.0.1:{port} > {shared}/ray/ray_current_cluster").returncode == 0

        script, *args = JOBS[kind]
        storage = shared / "results"
        job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / script), *args, "--storage-path", str(storage)],
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
    assert [p.name for p in inductor.parent.rglob("*")] == ["precompiled_headers"], "the job compiled into theirs"
    if kind == "training":
        assert f"{inductor.parent} is uid " in output and "the compile caches stay in this job's private" in output
    left = sorted(p.name for p in shared.iterdir())
    assert left == ["ray", "results", inductor.parent.name], f"the {kind} left these behind: {left}"
    (job_dir,) = storage.iterdir()
    assert list(job_dir.rglob("checkpoint_*")), f"the {kind} kept no checkpoint: {sorted(job_dir.rglob('*'))}"
    readable = as_attacker("find", str(storage), "-type", "f")
    assert readable.stdout == "", f"{ATTACKER} can list the {kind}'s results:\n{readable.stdout}"
    shared_modes = {str(p.relative_to(storage)): oct(p.lstat().st_mode) for p in [job_dir, *job_dir.rglob("*")]
                    if p.lstat().st_mode & 0o077}
    assert shared_modes == {}, f"folders or files of the {kind} that other users may reach: {shared_modes}"


ATTACK_STORE = """
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=10))
# gloo's rendezvous keys (the default group's, then the next new group's): rank addresses, fixed names
keys = [f"0//{group}cpu//0/{rank}" for group in ["", "1//", "2//"] for rank in (0, 1)]
print("read:", [key for key in keys if store.check([key])])
for key in keys:
    store.set(key, b"attacker's address")
print("planted")
"""


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank functions defined here


def new_group_sum(ctx) -> float:
    """A rendezvous after the other user's visit: a new process group (its addresses go through the store)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total, group=dist.new_group([0, 1]))
    return total.item()


def test_another_user_on_the_node_can_neither_read_nor_steer_the_worker_groups_rendezvous(ray_cluster, attacker):
    """The store of a worker group has no authentication. The attack: the other user connects to it (its port
    is in /proc/net/tcp), reads the ranks' addresses and plants their own under the keys gloo uses. Keys under
    the group's random prefix give them nothing to read, and what they plant is never asked for."""
    from rayhpc.workers.group import WorkerGroup

    with WorkerGroup(2, cpus_per_worker=0.5, timeout_s=60) as group:
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{group.store_port}"], capture_output=True, text=True)
        assert [line.split()[3] for line in listening.stdout.splitlines()] == [f"127.0.0.1:{group.store_port}"], \
            f"the store of a one-node group listens beyond loopback:\n{listening.stdout}"
        attack = python_as_attacker(ATTACK_STORE, str(group.store_port), timeout=60,
                                    imports="import datetime, torch.distributed as dist")
        assert "planted" in attack.stdout, attack.stderr[-2000:]
        assert "read: []" in attack.stdout, f"the other user read the ranks' rendezvous keys: {attack.stdout}"
        assert group.run(new_group_sum, timeout_s=30) == [3.0, 3.0]


PLANTED_PICKLE = """
import os, pickle, sys
class Plant:
    def __reduce__(self):  # runs when the victim loads the pickle
        return (os.system, (f"touch {sys.argv[2]}",))
open(sys.argv[1], "wb").write(pickle.dumps(Plant()))
"""


def test_a_resume_loads_nothing_another_user_could_have_planted(attacker, world_tmp):
    """The attack: a finished sweep's folder that others could write (group-writable, say) and the other user's
    `tuner.pkl` in it, a pickle that runs their command when loaded. `--resume` refuses with one line, while
    the folder is writable and after the owner narrowed it, and loads nothing."""
    from rayhpc.tune.config import SweepConfig

    storage = world_tmp("rh-results")
    job = storage / "sweep-1"
    job.mkdir(parents=True)
    job.chmod(0o777)
    (job / "sweep.yaml").write_text(json.dumps(SweepConfig(name="sweep-1").saved()))
    marker = storage / "planted-pickle-ran"
    planted = python_as_attacker(PLANTED_PICKLE, str(job / "tuner.pkl"), str(marker), imports="import pickle")
    assert planted.returncode == 0, planted.stderr
    resume = ["--name", "sweep-1", "--resume", "--storage-path", str(storage)]
    for mode, culprit in [(0o777, f"{job} (mode 0777) can be written by other users"),
                          (0o700, f"{job / 'tuner.pkl'} belongs to uid")]:
        job.chmod(mode)
        out = run_job_warm("tune_mlp.py", *resume)
        assert out.returncode == 2 and out.stderr.startswith(f"error: resume (--resume): {culprit}"), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and not marker.exists(), out.stderr


def test_a_task_file_in_a_folder_others_can_write_is_not_imported(world_tmp):
    """The task's folder goes on sys.path while it loads, so a module another user plants beside it would run."""
    shared = world_tmp("rh-tasks")
    shared.mkdir()
    shutil.copy(ROOT / "tests" / "tasks" / "dropout.py", shared / "task.py")
    shared.chmod(0o1777)
    out = run_job_warm("tune_mlp.py", "--task", f"{shared}/task.py:Dropout", "--num-samples", "1")
    assert out.returncode == 2, out.stderr
    assert out.stderr == (f"error: task (--task) {shared}/task.py:Dropout: {shared} (mode 1777) can be written "
                          f"by other users, so what it holds may not be yours, and it is not loaded; if it is: "
                          f"chmod -R go-w {shared}\n"), out.stderr


def test_ray_takes_its_file_locks_in_a_private_folder_not_in_the_machines_shared_one(ray_cluster):
    """Ray Tune and Train lock files in `<RAY_TMPDIR or /tmp>/_ray_lockfiles`, one folder for all users: whoever
    makes it first (0700) makes every other user's resume fail with PermissionError. The driver and the
    processes of the Ray it started lock in a 0700 folder of this user's (RAY_TMPDIR) instead."""
    from ray._common.utils import get_default_system_temp_dir  # where Ray's TempFileLock puts its locks

    def where() -> tuple[str, int, int]:
        folder = Path(get_default_system_temp_dir())
        return str(folder), stat.S_IMODE(folder.stat().st_mode), folder.stat().st_uid

    driver = where()
    assert driver == (os.environ["RAY_TMPDIR"], 0o700, os.getuid()) and Path(driver[0]).name.startswith("rayhpc-tmp-")
    assert ray.get(ray.remote(where).remote()) == driver  # the workers of the Ray the driver started: the same


def test_the_local_rays_dashboard_agent_listens_on_a_free_port_not_rays_fixed_one(ray_cluster):
    """Ray's default, 52365, is one port for every Ray on the node: where another user's Ray (or the user's own
    cluster) holds it, a job's agent retried it for 4-5 s of its start, then ran without its HTTP server."""
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    port = node["DashboardAgentListenPort"]
    assert port not in (0, 52365) and os.getuid() in listening_uids(port), port
