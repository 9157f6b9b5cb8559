"""Ctrl-C and SIGTERM stop every job kind the way users expect, on a shared cluster: the job ends with
130 (SIGINT) or 143 (SIGTERM), one line on stderr that says how to resume, its checkpoints kept, and no
actor or placement group of it left on the cluster; the printed command resumes it. A job whose clean
stop takes longer than the grace period is ended at once, within 10 s."""

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray.util.state import list_actors, list_jobs, list_placement_groups

from helpers import RAYHPC, ROOT
from rayhpc.interrupt import GRACE_VARIABLE
from rayhpc.processes import descendants
from rayhpc.tune.results import read_results

STOP_WITHIN_S = 10
# the kinds' test checks a *clean* stop (the line without "ended at once", a sweep's table written): on a
# node loaded by the rest of the suite that can take longer than GRACE_S (7 s), so its jobs get this much;
# the forced end within STOP_WITHIN_S is test_a_job_whose_clean_up_hangs_is_ended_at_once's
CLEAN_GRACE_S = 20
FORWARDED = re.compile(r"^(\x1b\[\d+m)?\(\S+ pid=\d+(, ip=\S+)?\)")
# Ray Train's autoscaling coordinator: one detached actor per cluster (0 CPUs), made by the first Train
# run and shared by every later one: a service of the cluster, not of the run
CLUSTER_SERVICES = {"_AutoscalingCoordinatorActor"}
# each job runs far longer than the test, and is stopped once it has saved a checkpoint (the glob); started each
# way a user starts one (the installed command, python -m, a job script): the printed command resumes it the same way
JOBS = {
    "tune": (["rayhpc", "tune", "--num-samples", "2", "--epochs", "100000"], "train_pack_*/pack/checkpoint_*"),
    "train": (["train_mlp.py", "--num-workers", "2", "--epochs", "100000"], "checkpoint_*/progress.json"),
    "parallel": (["train_parallel.py", "--tp", "2", "--steps", "1000000", "--checkpoint-every", "20"],
                 "checkpoint_*/progress.json"),
    "ps": (["python", "-m", "rayhpc", "ps", "--num-servers", "2", "--epochs", "100000"],
           "checkpoint_*/server_1/progress.json"),
}
# runs `python ARGS...` in its own process with SIGINT ignored, as `cmd &` in a script leaves it (exec keeps it)
IGNORING_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
STARTED: list[subprocess.Popen] = []  # the jobs the running test started


def start(command: list[str], out: Path, env: dict | None = None, terminal: bool = False) -> subprocess.Popen:
    """`command` (a job script and its flags, or a `python ...` or `rayhpc ...` command) in the background, as a
    script would run it (`cmd &` in a batch script, or a CI runner that started the suite so): SIGINT
    inherited *ignored*, which makes Python install no KeyboardInterrupt handler of its own; stdout and
    stderr to files in `out`. `terminal`: the leader of a process group of its own, as a shell's foreground job
    (`stop(..., terminal=True)` then signals the whole group, as a terminal's Ctrl-C does)."""
    if command[0] == "python":
        command = command[1:]
    elif command[0] == "rayhpc":
        command = [RAYHPC, *command[1:]]  # the installed command, run as its own script
    else:
        command = [str(ROOT / "jobs" / command[0]), *command[1:]]
    out.mkdir(exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONUNBUFFERED": "1", **(env or {})}
    job = subprocess.Popen([sys.executable, "-c", IGNORING_SIGINT, *command], cwd=ROOT,
                           stdout=open(out / "stdout", "w"), stderr=open(out / "stderr", "w"), env=env,
                           process_group=0 if terminal else None)
    STARTED.append(job)
    return job


@pytest.fixture(autouse=True)
def kill_what_the_test_started():
    """A test that fails before it stops its job leaves nothing running (a job of 100,000 epochs and the
    Ray it started would load the machine for the rest of the suite)."""
    yield
    for job in STARTED:
        if job.poll() is None:
            for pid in [job.pid, *descendants(job.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            job.wait()
    STARTED.clear()


def wait_for(job: subprocess.Popen, folder: Path, pattern: str, out: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(folder.glob(pattern)):
        assert job.poll() is None, f"the job ended ({job.returncode}):\n{(out / 'stderr').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern} in {folder} within {timeout_s:g} s"
        time.sleep(0.2)


def stop(job: subprocess.Popen, signum: int, out: Path, within_s: float = STOP_WITHIN_S,
         terminal: bool = False) -> str:
    """Send `signum` (`terminal`: to the job's whole process group); the job must end within `within_s` with
    128 + signum, writing one line to stderr from then on, which is returned."""
    written = (out / "stderr").stat().st_size
    if terminal:
        os.killpg(job.pid, signum)
    else:
        job.send_signal(signum)
    sent = time.monotonic()
    try:
        job.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
        pytest.fail(f"still running {within_s:g} s after {signal.Signals(signum).name}; stderr:\n"
                    + (out / "stderr").read_text()[-3000:])
    took = time.monotonic() - sent
    stderr = (out / "stderr").read_bytes()[written:].decode()
    assert job.returncode == 128 + signum, (job.returncode, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    # lines Ray forwards from the job's worker processes ("(train_pack pid=12) Restored on ...") may
    # arrive after the signal although written before it: the job's own lines are the others
    lines = [line for line in stderr.strip().splitlines() if not FORWARDED.match(line)]
    assert len(lines) == 1, f"expected one line on stderr after {took:.1f} s, got:\n{stderr[-3000:]}"
    return lines[0]


def ray_job_of(address: str, pid: int) -> str:
    """The Ray job id of the driver process `pid`."""
    ids = [j.job_id for j in list_jobs(address=address) if j.driver_info and j.driver_info.pid == str(pid)]
    assert len(ids) == 1, f"driver pid {pid}: Ray jobs {ids}"
    return ids[0]


def assert_nothing_left(address: str, pid: int, timeout_s: float = 10) -> None:
    """No live actor and no placement group of the job whose driver was `pid` (Ray reaps a finished
    driver's objects asynchronously: a few seconds' grace)."""
    job_id = ray_job_of(address, pid)
    deadline = time.monotonic() + timeout_s
    while True:
        actors = [(a.class_name, a.state) for a in list_actors(address=address, filters=[("job_id", "=", job_id)])
                  if a.state != "DEAD" and a.class_name not in CLUSTER_SERVICES]
        groups = [(g.placement_group_id, g.state) for g in
                  list_placement_groups(address=address, filters=[("creator_job_id", "=", job_id)])
                  if g.state != "REMOVED"]
        if not actors and not groups:
            return
        assert time.monotonic() < deadline, f"left on the cluster by job {job_id}: actors {actors}, groups {groups}"
        time.sleep(0.5)


# the kinds whose printed resume command is run too, and stopped by SIGTERM: Tune's restore and the PS
# driver's own, started as `rayhpc tune` and `python -m rayhpc ps` (a job script's printed command is run by
# test_user_cluster's warm-starter test); Ray Train's and the worker group's resume are test_train's and
# test_parallel's, and SIGTERM reaches every kind the same way (as SIGINT)
RESUMED = ("tune", "ps")


def started_as(script: str, flags: list[str]) -> list[str]:
    """The command a job of JOBS was started with, as its printed resume command must begin."""
    if script in ("rayhpc", "python"):
        return [script, *flags[:flags.index("rayhpc") + 2 if script == "python" else 1]]
    return ["python", str(ROOT / "jobs" / script)]


@pytest.mark.parametrize("kind", JOBS)
def test_ctrl_c_stops_the_job_and_sigterm_stops_its_resumed_run(kind, ray_address, tmp_path):
    (script, *flags), checkpoints = JOBS[kind]
    folder = tmp_path / kind
    patient = {GRACE_VARIABLE: str(CLEAN_GRACE_S)}
    job = start([script, *flags, "--name", kind, "--storage-path", str(tmp_path), "--address", ray_address],
                tmp_path / "first", patient)
    wait_for(job, folder, checkpoints, tmp_path / "first")
    line = stop(job, signal.SIGINT, tmp_path / "first", CLEAN_GRACE_S + 3)
    assert line.startswith("interrupted by SIGINT: ") and f"kept in {folder};" in line, line
    assert list(folder.glob(checkpoints)), f"the checkpoints are gone: {sorted(folder.iterdir())}"
    assert_nothing_left(ray_address, job.pid)
    if kind == "tune":  # the results table is written, the trials the signal stopped marked so
        table = read_results(folder)
        assert len(table) == 2 and set(table["status"]) == {"interrupted"}, table
    resume = shlex.split(line.split("resume with: ", 1)[1])
    assert resume == [*started_as(script, flags), "--name", kind, "--storage-path", str(tmp_path), "--address",
                      ray_address, "--resume"], line
    if kind not in RESUMED:
        return

    before = sorted(p.relative_to(folder) for p in folder.glob(checkpoints))
    again = start(resume, tmp_path / "again", patient)
    deadline = time.monotonic() + 180
    while not (new := {p.relative_to(folder) for p in folder.glob(checkpoints)} - set(before)):
        assert again.poll() is None, (tmp_path / "again" / "stderr").read_text()[-3000:]
        assert time.monotonic() < deadline, "the resumed run saved no checkpoint within 180 s"
        time.sleep(0.2)
    # it went on from where it stopped: each new checkpoint comes after the first run's last in its folder
    # (a trial's, or the run's; the names count steps, or are times)
    last = {p.parent: p for p in before}
    assert all(p > last[p.parent] for p in new if p.parent in last), (sorted(new), before)
    line = stop(again, signal.SIGTERM, tmp_path / "again", CLEAN_GRACE_S + 3)
    assert line.startswith("interrupted by SIGTERM: "), line
    assert_nothing_left(ray_address, again.pid)


# a sweep that stops cleanly, and a parameter-server run given no time to (RAYHPC_STOP_GRACE_S=0): ended
# at once, the processes of its Ray killed with it
@pytest.mark.parametrize("kind, grace_s", [("tune", None), ("ps", 0)])
def test_ctrl_c_stops_a_job_on_its_own_ray_and_every_process_it_started(kind, grace_s, tmp_path):
    """Without --address the job starts its own Ray: Ctrl-C ends the job and that Ray with it, its folder
    removed (by the forced exit too), its GCS stopped after every other process of it. Ctrl-C as a terminal
    sends it, to the job's whole process group: the job's Ray, in a session of its own, is stopped by the job
    once it is done with it (the sweep's clean stop, within its grace period), not under it."""
    (script, *flags), checkpoints = JOBS[kind]
    # the job's TMPDIR, where its private folder and its Ray's are made: short (Ray's socket paths must fit)
    tmp = Path(tempfile.mkdtemp(prefix="ri-", dir="/tmp"))
    env = {"TMPDIR": str(tmp), **({} if grace_s is None else {GRACE_VARIABLE: str(grace_s)})}
    job = start([script, *flags, "--name", kind, "--storage-path", str(tmp_path)], tmp_path / "out", env,
                terminal=True)
    wait_for(job, tmp_path / kind, checkpoints, tmp_path / "out")
    started = {pid: process_name(pid) for pid in descendants(job.pid)}
    assert "raylet" in started.values(), started
    # the job's Ray: `ray start` under the job's supervisor (rayhpc.ray_start), the job's child
    (supervisor,) = [pid for pid in started if cmdline(pid)[1:4] == ["-P", "-m", "rayhpc.ray_start"]]
    assert parent(supervisor) == job.pid and "gcs_server" in {process_name(p) for p in descendants(supervisor)}
    assert [pid for pid in started if cmdline(pid)[0].startswith("ray::")], f"no Ray worker of the job: {started}"
    line = stop(job, signal.SIGINT, tmp_path / "out", terminal=True)
    forced = "" if grace_s is None else f" (not stopped within {grace_s:g} s: ended at once)"
    assert line.startswith(f"interrupted by SIGINT{forced}: ") and "resume with: " in line, line
    deadline = time.monotonic() + STOP_WITHIN_S
    while alive := {pid: name for pid, name in started.items() if name and process_name(pid) == name}:
        assert time.monotonic() < deadline, f"left running {STOP_WITHIN_S} s after the job ended: {alive}"
        time.sleep(0.2)
    left = list(tmp.rglob("session_*"))
    shutil.rmtree(tmp, ignore_errors=True)
    assert not left, f"the job's Ray folder was left behind: {left}"


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])  # the name in (...) may hold spaces


def cmdline(pid: int) -> list[str]:
    """The arguments of process `pid` (as Ray's workers retitle themselves: `ray::train_pack`)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0") or [""]
    except OSError:
        return [""]


def process_name(pid: int) -> str | None:
    """The name of the live process `pid` (None if it is gone or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
    return None if state == "Z" else name


HANGING_CLEAN_UP = """
import time
from rayhpc.entry import run_main

def main(argv):
    try:
        time.sleep(120)  # the job
    finally:
        time.sleep(120)  # a clean-up that hangs (a cluster that stopped answering)

run_main(main, [])
"""


def test_a_job_whose_clean_up_hangs_is_ended_at_once(tmp_path):
    """After the grace period (GRACE_S, or RAYHPC_STOP_GRACE_S: here 1.5 s; a bad value is bad input)."""
    job = start(["python", "-c", HANGING_CLEAN_UP], tmp_path / "out", {GRACE_VARIABLE: "1.5"})
    time.sleep(3)  # past the imports: the handlers are installed
    sent = time.monotonic()
    line = stop(job, signal.SIGINT, tmp_path / "out")
    assert time.monotonic() - sent >= 1.5, "it ended before the grace period: the clean-up did not hang?"
    assert line == "interrupted by SIGINT (not stopped within 1.5 s: ended at once)", line
    job = start(["python", "-c", HANGING_CLEAN_UP], tmp_path / "bad", {GRACE_VARIABLE: "soon"})
    assert job.wait(timeout=60) == 2
    assert (tmp_path / "bad" / "stderr").read_text() == \
        f"error: {GRACE_VARIABLE} 'soon': expected seconds >= 0, e.g. {GRACE_VARIABLE}=30\n"
