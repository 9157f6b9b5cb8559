"""The starter of workers (`python -m rayhpc.up.starter --workers`) forks, at each job's first worker, a starter of
that job's workers, which loads Ray, Ray Tune and Ray Train with that worker's environment (Ray's core reads the
job and its raylet's pid once, as it loads) and forks the job's workers. Driven here as Ray drives it, by worker
processes (`python -P -m rayhpc.up.worker SCRIPT`) whose environment names the job, without a Ray cluster: each
worker's script reports who forked it and what it found loaded."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from helpers import ROOT
from rayhpc.up import starter as starter_module
from rayhpc.up.warm import waiting_for

REPORT = """
import json, os, sys, time
parent = os.getppid()
grandparent = int(open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[1])
while os.environ.get("T_WAIT_FOR") and not os.path.exists(os.environ["T_WAIT_FOR"]):
    time.sleep(0.05)
ray = {"ray.tune", "ray.train.torch"} <= set(sys.modules)
print(json.dumps({"parent": parent, "grandparent": grandparent, "ray": ray, "job": os.environ.get("RAY_JOB_ID"),
                  "path": sys.path}))
"""


@pytest.fixture()
def workers_starter(tmp_path):
    """A starter of workers of its own (with a RAYHPC_HOME of its own), and what a worker's environment holds."""
    # not in `tmp_path`, which may be too deep for a socket's path (107 bytes) once the suite's TMPDIR is private
    home = Path(tempfile.mkdtemp(prefix="rayhpc-home-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYHPC_HOME"))}
    env.update(RAYHPC_HOME=str(home), PYTHONPATH=str(ROOT / "platform"))
    (home / "clusters").mkdir(mode=0o700)  # as `rayhpc up` makes it
    proc = subprocess.Popen([sys.executable, "-m", "rayhpc.up.starter", "--workers", "--extras", ""], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock = home / "clusters" / f"{socket.gethostname().split('.')[0]}-workers.sock"
    deadline = time.monotonic() + 120
    while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
        waiting_for(sock, timeout_s=1)
    assert sock.exists(), "the starter of workers did not start"
    (tmp_path / "report.py").write_text(REPORT)
    yield proc, env
    proc.kill()
    proc.wait()
    shutil.rmtree(home)


def worker(env: dict, folder, job: str | None, **extra: str) -> subprocess.Popen:
    """A Ray worker process of `job` (raylet pid 1), as Ray starts one: `python -P -m rayhpc.up.worker SCRIPT`."""
    names = {"RAY_JOB_ID": job, "RAY_RAYLET_PID": "1"} if job else {}
    return subprocess.Popen([sys.executable, "-P", "-m", "rayhpc.up.worker", str(folder / "report.py")],
                            env={**env, **names, **extra}, stdout=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return json.loads(out.splitlines()[-1])


def test_each_jobs_workers_are_forked_by_a_starter_of_that_job_that_loaded_ray(workers_starter, tmp_path):
    proc, env = workers_starter
    first, second = (report(worker(env, tmp_path, "01000000")) for _ in range(2))
    # forked by the job's starter, the starter of workers' child, which loaded Ray's libraries with the job
    assert first["grandparent"] == second["grandparent"] == proc.pid, (first, second, proc.pid)
    assert first["parent"] == second["parent"] and first["ray"] and first["job"] == "01000000", first
    other_job = report(worker(env, tmp_path, "02000000"))
    assert other_job["grandparent"] == proc.pid and other_job["parent"] != first["parent"], other_job
    assert other_job["ray"] and other_job["job"] == "02000000", other_job
    # the same job with another setting of Ray's: it read it as it loaded, so another starter
    setting = report(worker(env, tmp_path, "01000000", RAY_DEDUP_LOGS="0"))
    assert setting["grandparent"] == proc.pid and setting["parent"] not in (first["parent"], other_job["parent"])
    # no job (Ray's workers started ahead of any): forked by the starter of workers itself, Ray not loaded
    no_job = report(worker(env, tmp_path, None))
    assert no_job["parent"] == proc.pid and not no_job["ray"], no_job
    # the path as Ray's import makes it in a worker of its own: its bundled packages first, once
    bundled = [entry for entry in first["path"] if entry.endswith(os.path.join("ray", "thirdparty_files"))]
    assert len(bundled) == 1 and not any(entry.endswith("thirdparty_files") for entry in no_job["path"]), first


def test_a_job_starter_that_ended_is_replaced_and_one_that_failed_is_not(workers_starter, tmp_path):
    proc, env = workers_starter
    first = report(worker(env, tmp_path, "01000000"))
    os.kill(first["parent"], signal.SIGTERM)  # it ends as it does when idle: the next worker gets another
    wait_gone(first["parent"])
    again = report(worker(env, tmp_path, "01000000"))
    assert again["grandparent"] == proc.pid and again["parent"] != first["parent"] and again["ray"], again
    os.kill(again["parent"], signal.SIGKILL)  # it failed: the job's workers are forked by the starter of workers
    wait_gone(again["parent"])
    after = report(worker(env, tmp_path, "01000000"))
    assert after["parent"] == proc.pid and not after["ray"], after


def test_stopped_the_starters_end_once_their_running_workers_have_ended(workers_starter, tmp_path):
    proc, env = workers_starter
    release = tmp_path / "release"
    running = worker(env, tmp_path, "01000000", T_WAIT_FOR=str(release))
    deadline = time.monotonic() + 60
    while len(children(proc.pid)) < 1 or not children(children(proc.pid)[0]):
        assert time.monotonic() < deadline, "the worker was not forked"
        time.sleep(0.1)
    job_starter = children(proc.pid)[0]
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert proc.poll() is None and os.path.exists(f"/proc/{job_starter}"), "a starter ended before its worker"
    release.touch()
    assert report(running)["parent"] == job_starter
    assert proc.wait(timeout=30) == 0
    wait_gone(job_starter)


def test_a_job_starter_stops_after_idle_s_without_a_worker_and_at_the_end_of_its_channel():
    """`_loop` as a job's starter runs it: idle (no request, no worker running) for `idle_s`, or once the starter
    of workers closes its end of the channel, it returns."""
    def never_returned(_signum, _frame):
        raise AssertionError("the loop did not return")

    before = signal.getsignal(signal.SIGTERM), signal.signal(signal.SIGALRM, never_returned)
    signal.alarm(20)
    try:
        for idle_s, close in ((0.5, False), (None, True)):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            if close:
                ours.close()
            began = time.monotonic()
            assert starter_module._loop(theirs, lambda _selector: starter_module._take(theirs, _selector),
                                        idle_s=idle_s) is None
            waited = time.monotonic() - began
            assert (0.5 <= waited < 5) if idle_s else waited < 1, (idle_s, waited)
            ours.close()
        # busy (a request's child running, watched until 1.5 s) it is not idle: it takes a request at 1 s
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        read, write = os.pipe()
        taken = []

        def take(selector: selectors.BaseSelector) -> None:
            taken.append(theirs.recv(10))
            if len(taken) == 1:
                selector.register(read, selectors.EVENT_READ, selector.unregister)

        ours.send(b"first")
        threading.Timer(1.0, ours.send, (b"second",)).start()
        threading.Timer(1.5, os.write, (write, b"ended")).start()
        began = time.monotonic()
        assert starter_module._loop(theirs, take, idle_s=0.3) is None
        assert 1.5 <= time.monotonic() - began < 10 and taken == [b"first", b"second"], taken
        for end in (read, write):
            os.close(end)
        ours.close()
        theirs.close()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGALRM, before[1])


def children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    return [int(p) for p in open(path).read().split()] if os.path.exists(path) else []


def wait_gone(pid: int, timeout_s: float = 30) -> None:
    """Until `pid` has ended and its parent (the starter of workers) has reaped it."""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"{pid} did not end"
        time.sleep(0.05)
