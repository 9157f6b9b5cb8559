"""A local job on a machine shared with another Unix user (a login node, a shared allocation): it starts
a Ray of its own in a private folder, and never joins the cluster someone else named first."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import ray

from helpers import (
    ATTACKER,
    ROOT,
    as_attacker,
    job_env,
    planted_folder,
    planted_imports,
    python_as_attacker,
    run_job,
    run_job_warm,
)
from rayhpc import cluster
from rayhpc.task.load import load_task
from rayhpc.user_cluster import listening_uids

# the sweep compiled: inductor builds its precompiled headers in the trial's process (every CPU kernel includes
# them; about 30 s of a core)
JOBS = {"sweep": ["tune_mlp.py", "--num-samples", "2", "--epochs", "1", "--compile", "model"],
        "training": ["train_mlp.py", "--num-workers", "1", "--epochs", "1"]}


@pytest.mark.newest  # CI: beside the Slurm tests, to balance its two sessions (pyproject's markers)
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
            output, _ = job.communicate(timeout=420)  # the compile, on a loaded machine
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
    if kind == "sweep":
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


# the other user tries every port the ranks listen on as a TCPStore (as torch's rendezvous store answers anyone):
# lists its keys, reads gloo's (the ranks' addresses), plants their own under the next process group's names
ATTACK_STORE = """
found = {}

def probe(address):
    host, port = address.rsplit(":", 1)
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=3),
                              wait_for_workers=False)
        found[address] = {"keys": store.list_keys(), "read": store.check(["0//cpu//0/0"])}
        store.set("0//1//cpu//0/0", b"the attacker's address")
        found[address]["planted"] = True
    except Exception as exc:
        found[address] = type(exc).__name__

for address in sys.argv[1:]:  # a port that is no store may never answer the handshake
    thread = threading.Thread(target=probe, args=(address,), daemon=True)
    thread.start()
    thread.join(4)
    found.setdefault(address, "no answer")
print(json.dumps(found), flush=True)
os._exit(0)
"""
# and the folder of a one-node group's store
ATTACK_FOLDER = """
for path in sys.argv[1:]:
    for attempt in (lambda: os.listdir(path), lambda: open(os.path.join(path, "store"), "rb").read(),
                    lambda: open(os.path.join(path, "planted"), "w").write("x")):
        try:
            attempt()
            print("reached", path)
        except OSError as exc:
            print(type(exc).__name__)
"""


def listening(pid: int) -> list[str]:
    """The addresses process `pid` listens on (TCP over IPv4 and IPv6; its sockets matched with /proc/net/tcp and
    tcp6), each as this machine reaches it: a socket on every address (IPv6's `::`, which takes IPv4 too) at
    127.0.0.1."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ip, port = fields[1].split(":")
                # the kernel writes the address as 32-bit words in host (little-endian) order
                raw = b"".join(bytes.fromhex(ip[i:i + 8])[::-1] for i in range(0, len(ip), 8))
                host = socket.inet_ntop(family, raw)
                host = "127.0.0.1" if host == "::" else host.removeprefix("::ffff:")
                found.append(f"{host}:{int(port, 16)}")
    return found


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank functions defined here


def new_group_sum(ctx) -> float:
    """A rendezvous after the other user's visit: a new process group (its addresses go through the store)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total, group=dist.new_group([0, 1]))
    return total.item()


def test_another_user_on_the_node_can_neither_list_read_nor_plant_the_worker_groups_rendezvous_keys(ray_cluster,
                                                                                                   attacker):
    """A TCPStore answers anyone who finds its port (/proc/net/tcp): `list_keys` gave the other user every key of a
    running TP job, gloo's rank addresses among them, and the names of the mesh subgroups' keys, which they
    planted before the ranks wrote them. A one-node group's store is a file in a private folder of rank 0's:
    no port of any rank answers as a store, the folder cannot be listed, read or written, the process
    groups made afterwards (a TP mesh's) work, and the folder goes with the group."""
    from rayhpc.workers.group import WorkerGroup

    with WorkerGroup(2, cpus_per_worker=0.5, timeout_s=60) as group:
        ports = [address for info in group.infos for address in listening(info["pid"])]
        attack = python_as_attacker(ATTACK_STORE, *ports, timeout=120,
                                    imports="import datetime, json, threading, torch.distributed as dist")
        answered = {a: r for a, r in json.loads(attack.stdout or "{}").items() if isinstance(r, dict)}
        assert attack.returncode == 0 and len(json.loads(attack.stdout)) == len(ports) and answered == {}, \
            (attack.stdout, attack.stderr[-2000:])
        kind, path = group.rendezvous
        folder = os.path.dirname(path)
        assert kind == "file" and stat.S_IMODE(os.stat(folder).st_mode) == 0o700, (kind, path)
        refused = python_as_attacker(ATTACK_FOLDER, folder, timeout=60)
        assert refused.stdout.split() == ["PermissionError"] * 3, refused.stdout + refused.stderr
        assert group.run(new_group_sum, timeout_s=30) == [3.0, 3.0]
    assert not os.path.exists(folder), "the rendezvous folder outlived the group"


def test_a_group_across_nodes_rendezvous_through_an_actor_of_its_own_ray(ray_cluster, monkeypatch):
    """Ranks on several nodes share no folder: their keys live in an actor of the job's Ray (every port of which
    asks for the cluster's token). Here on one node, told it spans several: the world forms, a collective and a
    process group made later (a mesh's) work through it, and the actor goes with the group."""
    import torch.distributed as dist

    from rayhpc.workers.group import WorkerGroup
    from rayhpc.workers.store import RayStore

    monkeypatch.setattr(WorkerGroup, "one_node", lambda self: False)
    with WorkerGroup(2, cpus_per_worker=0.5, timeout_s=60) as group:
        kind, server = group.rendezvous
        assert kind == "ray" and ray.get(server.num_keys.remote()) > 0
        assert group.run(new_group_sum, timeout_s=30) == [3.0, 3.0]
        store = RayStore(server, timedelta(seconds=0.5))  # TCPStore's semantics, where c10d relies on them
        assert store.compare_set("cas", "", "one") == b"one" and store.compare_set("cas", "two", "three") == b"one"
        assert store.compare_set("absent", "x", "y") == b"x" and not store.check(["absent"])
        assert store.add("count", 2) == 2 and store.add("count", 3) == 5 and store.get("count") == b"5"
        with pytest.raises(dist.DistStoreError, match="wait timeout after 0.5 s"):
            store.get("never-set")
    deadline = time.monotonic() + 30  # ray.kill is asynchronous: a call may still get through at first
    while True:
        try:
            ray.get(server.num_keys.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the group's store outlived it"
        time.sleep(0.1)


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


TASK_WITH_HELPER = """import helper
from dropout import Dropout  # noqa: F401 - the suite's task, from the task's folder too


class Helped(Dropout):
    hparams = {**Dropout.hparams, "scale": helper.SCALE}
"""


@pytest.mark.parametrize("breach", ["helper.py", "__pycache__ entry", "__pycache__ folder", "package folder", "none"])
def test_a_task_whose_folder_holds_code_another_user_can_write_is_not_imported(attacker, world_tmp, tmp_path,
                                                                                 breach):
    """The task's folder goes first on sys.path while it loads: a module beside it that another user can write
    (`helper.py` 0666, rewritten by them), a cached `.pyc` they can write (Python runs it in place of its
    source), or a package folder of theirs to add modules to, would run as the victim when the task imports it;
    so would a `.pyc` they put later in a `__pycache__` folder they can write. The job refuses in one line naming the entry and imports nothing; a folder of the victim's own is loaded."""
    tasks = world_tmp("rh-task")
    tasks.mkdir(mode=0o755)
    tasks.chmod(0o755)
    shutil.copy(ROOT / "tests" / "tasks" / "dropout.py", tasks / "dropout.py")
    (tasks / "task.py").write_text(TASK_WITH_HELPER)
    (tasks / "helper.py").write_text("SCALE = 2.0\n")
    marker = world_tmp("rh-ran")
    (tasks / "data").mkdir()  # a folder of data (no code): another user may write it
    (tasks / "data").chmod(0o777)
    culprit = {"helper.py": tasks / "helper.py", "__pycache__ entry": tasks / "__pycache__",
               "__pycache__ folder": tasks / "__pycache__", "package folder": tasks / "lib"}.get(breach)
    if breach == "helper.py":
        culprit.chmod(0o666)
        assert as_attacker("sh", "-c", f"echo 'open(\"{marker}\", \"w\"); SCALE = 2.0' > {culprit}").returncode == 0
    elif breach == "__pycache__ entry":
        culprit.mkdir(mode=0o755)
        culprit.chmod(0o755)
        (culprit / "helper.cpython-311.pyc").write_bytes(b"")
        (culprit / "helper.cpython-311.pyc").chmod(0o666)
        culprit = culprit / "helper.cpython-311.pyc"
    elif breach == "__pycache__ folder":  # empty: they would write the .pyc the victim's next import runs
        culprit.mkdir()
        culprit.chmod(0o777)
    elif breach == "package folder":
        culprit.mkdir()
        (culprit / "__init__.py").write_text("")
        culprit.chmod(0o777)
    if breach == "none":
        try:
            assert load_task(f"{tasks}/task.py:Helped").obj.hparams["scale"] == 2.0
        finally:
            sys.modules.pop("helper", None)
        return
    out = run_job_warm("tune_mlp.py", "--task", f"{tasks}/task.py:Helped", "--num-samples", "1", "--storage-path",
                       str(tmp_path))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    mode = f"{culprit.stat().st_mode & 0o7777:04o}"
    assert out.stderr.startswith(f"error: task (--task) {tasks}/task.py:Helped: {culprit} (mode {mode}) can be "
                                 "written by other users"), out.stderr
    assert not marker.exists(), "the planted helper ran"


# one job that runs the kinds of process the platform starts: its own Ray (dashboard and agents), and Ray
# Train's controller and ranks (a sweep's trial processes and warm ranks are Ray workers as these are)
PLANTED_JOB = ["train_mlp.py", "--epochs", "1"]


def test_a_job_run_in_a_folder_another_user_writes_imports_nothing_from_it(attacker, world_tmp, tmp_path):
    """The attack: the other user plants `rayhpc/__init__.py`, `torch.py` and `ray.py` in a folder anyone may
    write (/tmp, a shared scratch) where the victim starts a job. `python -m` and `-c`, which the platform and
    Ray start processes with, put the working folder first on `sys.path`, and Ray puts the driver's working
    folder first on every worker's: Ray's dashboard modules, Tune's trials and Train's ranks ran the planted
    code as the victim. The job (its own process is the user's: a script run by path) runs to its end, and no
    process it started imported anything from there."""
    folder, marks = planted_folder(world_tmp)
    proc = run_job(*PLANTED_JOB, "--storage-path", str(tmp_path), cwd=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert planted_imports(marks) == []


def test_ray_takes_its_file_locks_in_a_private_folder_not_in_the_machines_shared_one(ray_cluster):
    """Ray Tune and Train lock files in `<RAY_TMPDIR or /tmp>/_ray_lockfiles`, one folder for all users: whoever
    makes it first (0700) makes every other user's resume fail with PermissionError. The driver and the
    processes of the Ray it started lock in 0700 folders of this user's (RAY_TMPDIR) instead."""
    from ray._common.utils import get_default_system_temp_dir  # where Ray's TempFileLock puts its locks

    def where() -> tuple[str, int, int]:
        folder = Path(get_default_system_temp_dir())
        return str(folder), stat.S_IMODE(folder.stat().st_mode), folder.stat().st_uid

    driver = where()
    assert driver == (os.environ["RAY_TMPDIR"], 0o700, os.getuid()) and Path(driver[0]).name.startswith("rayhpc-tmp-")
    # the workers of the Ray the driver started: in that Ray's private folder
    assert ray.get(ray.remote(where).remote()) == (str(cluster.local_temp()), 0o700, os.getuid())


def test_the_local_rays_dashboard_agent_listens_on_a_free_port_not_rays_fixed_one(ray_cluster):
    """Ray's default, 52365, is one port for every Ray on the node: where another user's Ray (or the user's own
    cluster) holds it, a job's agent retried it for 4-5 s of its start, then ran without its HTTP server."""
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    port = node["DashboardAgentListenPort"]
    assert port not in (0, 52365) and os.getuid() in listening_uids(port), port


def private_folder(world_tmp, name: str) -> Path:
    folder = world_tmp(name)
    folder.mkdir(mode=0o700)
    return folder


def test_a_link_in_a_checked_folder_is_checked_where_it_leads(attacker, world_tmp):
    """The attack: the study folder is the user's alone, but its `asha_members.pkl` is a link (the user's own, say
    left by a tool) to a file the other user can write, holding their pickle. Every reader checks a link as what
    it leads to: the study is refused, naming the file; a link to a file of the user's alone, and a link that
    leads nowhere (whoever creates its target would choose what is loaded), each as it should be."""
    study = private_folder(world_tmp, "rh-study")
    shared = world_tmp("rh-shared")  # stands in for /tmp
    shared.mkdir()
    shared.chmod(0o1777)
    theirs = shared / "members.pkl"
    marker = shared / "planted-pickle-ran"
    assert python_as_attacker(PLANTED_PICKLE, str(theirs), str(marker), imports="import pickle").returncode == 0
    assert as_attacker("chmod", "666", str(theirs)).returncode == 0
    (study / "asha_members.pkl").symlink_to(theirs)
    (study / "ledger.jsonl").write_text("")  # a study no slice has joined yet
    (study / "sweep.yaml").write_text("num_samples: 2\n")
    out = run_job_warm("tune_mlp.py", "--study", str(study))
    assert out.returncode == 2 and out.stderr == (
        f"error: study (--study) {study}: {theirs} belongs to uid {pwd.getpwnam(ATTACKER).pw_uid}, not to you (uid "
        f"{os.getuid()}) or root: another user controls what is inside it; choose a folder of your own\n"), out.stderr
    ours = private_folder(world_tmp, "rh-ours") / "members.pkl"
    for target, refused in [(ours, None), (shared / "not-there.pkl", "which does not exist")]:
        if target == ours:
            target.write_bytes(b"")
        (study / "asha_members.pkl").unlink()
        (study / "asha_members.pkl").symlink_to(target)
        status = subprocess.run([sys.executable, "-m", "rayhpc", "status", "--study", str(study)], cwd=ROOT,
                                capture_output=True, text=True, env=job_env(None), timeout=60)
        if refused:
            assert status.returncode == 2 and status.stderr == (
                f"error: study (--study) {study}: {study / 'asha_members.pkl'} is a link to {target}, {refused}: "
                "whoever creates it would choose what is loaded; remove the link\n"), status.stderr
        else:
            assert status.returncode == 0, status.stderr
    assert not marker.exists()


@pytest.mark.parametrize("mode", [0o664, 0o606])
def test_init_from_checks_every_file_of_the_sweep_it_reads(world_tmp, mode):
    """`--init-from SWEEP_DIR` reads the sweep's table, plan and checkpoints: one that others may write (group- or
    world-writable) is refused, as `rayhpc export` refuses it, before anything of it is read."""
    sweep = private_folder(world_tmp, "rh-sweep")
    (sweep / "sweep.yaml").write_text("name: s\n")
    (sweep / "results.parquet").write_bytes(b"not read")
    (sweep / "results.parquet").chmod(mode)
    out = run_job_warm("train_mlp.py", "--init-from", str(sweep))
    assert out.returncode == 2 and out.stderr == (
        f"error: init_from (--init-from): {sweep / 'results.parquet'} (mode {mode:04o}) can be written by other "
        f"users, so what it holds may not be yours, and it is not loaded; if it is: chmod -R go-w "
        f"{sweep / 'results.parquet'}\n"), out.stderr


def test_sync_refuses_another_users_folder(attacker, world_tmp):
    """`rayhpc sync DIR` would upload the runs in DIR under this user's W&B key: another user's folder (or one with
    their runs in it) is refused with one line; the user's own is synced."""
    for owner in ("theirs", "ours"):
        folder = world_tmp(f"rh-{owner}")
        make = ["mkdir", "-m", "755", "-p", str(folder / "wandb" / "offline-run-1")]
        assert (as_attacker(*make) if owner == "theirs" else subprocess.run(make)).returncode == 0
        out = subprocess.run([sys.executable, "-m", "rayhpc", "sync", "--dry-run", str(folder)], cwd=ROOT,
                             capture_output=True, text=True, env=job_env(None), timeout=120)
        if owner == "theirs":
            assert out.returncode == 2 and out.stderr == (
                f"error: DIR {folder}: {folder} belongs to uid {pwd.getpwnam(ATTACKER).pw_uid}, not to you (uid "
                f"{os.getuid()}) or root: another user controls what is inside it; choose a folder of your own\n"), \
                out.stderr
        else:  # past the check (what wandb then does, where it is installed at all, is wandb's)
            assert f"error: DIR {folder}" not in out.stderr and "offline W&B run" in out.stdout + out.stderr or \
                "wandb" in out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("owner, mode", [("theirs", 0o755), ("ours", 0o777), ("ours", 0o770)])
def test_a_rayhpc_home_in_a_folder_another_user_controls_is_one_error_line(attacker, world_tmp, owner, mode):
    """RAYHPC_HOME in a folder another user owns, or one others can write (world- or group-writable, no sticky
    bit): they could swap the connection file the user's commands trust; `rayhpc up` refuses with one line,
    writing nothing."""
    folder = world_tmp("rh-home")
    make = ["mkdir", "-m", f"{mode:o}", str(folder)]
    assert (as_attacker(*make) if owner == "theirs" else subprocess.run(make)).returncode == 0
    if owner == "ours":
        folder.chmod(mode)  # past the umask
    home = folder / "h"
    out = subprocess.run([sys.executable, "-m", "rayhpc", "up"], cwd=ROOT, capture_output=True, text=True,
                         env=job_env({"RAYHPC_HOME": str(home)}), timeout=60)
    why = (f"belongs to uid {pwd.getpwnam(ATTACKER).pw_uid}, not to you (uid {os.getuid()}) or root: another user "
           "controls what is inside it; choose a folder of your own" if owner == "theirs" else
           f"(mode {mode:04o}) can be written by other users and has no sticky bit: they could replace what is "
           f"inside; chmod go-w {folder}")
    assert out.returncode == 2 and out.stderr == f"error: RAYHPC_HOME {home}: {folder} {why}\n", out.stderr
    assert list(folder.iterdir()) == []


def test_another_user_on_the_node_finds_no_rendezvous_store_of_a_ray_train_run(ray_address, attacker, tmp_path):
    """Ray Train's own rendezvous is a TCPStore on rank 0 at a port it finds free and hands to torch, for the
    whole run: the other user could list, read and plant its keys. A `rayhpc train` run (DDP on 2 ranks, on the
    suite's Ray) forms its world through a FileStore in a private folder instead: while it trains, no port of
    any rank answers as a store, and the run ends normally once stopped (Ctrl-C)."""
    from ray.util.state import list_actors

    job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "train_mlp.py"), "--address", ray_address,
                            "--num-workers", "2", "--cpus-per-worker", "0.5", "--epochs", "100000",
                            "--storage-path", str(tmp_path)], cwd=ROOT, env=job_env(None), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "mlp-train" / "metrics.parquet").exists():  # a row written: every rank trains
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.5)
        # the suite's Ray by its address: other Rays may run on the machine (CI's other session)
        alive = [("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
        ranks = [a.pid for a in list_actors(address=ray_address, filters=alive, detail=True)]
        ports = [address for pid in ranks for address in listening(pid)]
        assert len(ranks) == 2 and ports, (ranks, ports)  # gloo's own sockets listen on each rank
        attack = python_as_attacker(ATTACK_STORE, *ports, timeout=120,
                                    imports="import datetime, json, threading, torch.distributed as dist")
        answered = {a: r for a, r in json.loads(attack.stdout or "{}").items() if isinstance(r, dict)}
        assert attack.returncode == 0 and len(json.loads(attack.stdout)) == len(ports) and answered == {}, \
            (attack.stdout, attack.stderr[-2000:])
    finally:
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=120)
    assert job.returncode == 130 and "Traceback" not in err, (job.returncode, out, err)
