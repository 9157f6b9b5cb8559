"""The processes the platform started, found by what it put in their environment, and stopped with a Ray
cluster's GCS last (psutil, Ray's own dependency, reads /proc).

Ray's processes rewrite their titles (`ray::IDLE`, setproctitle), which may clobber the start of the
environment block /proc shows, so a marked process's descendants count as marked too. Ray's own shutdown
stops a cluster's GCS second, after the raylet: its dashboard, monitor, agents and workers then go on calling
the GCS port for seconds, each call carrying the cluster's token, to whoever binds the port once it is free.
So every other process of a cluster is killed, and gone, before its GCS.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil

GCS_EXECUTABLE = "gcs_server"


def descendants(*pids: int) -> list[int]:
    """Every process below `pids`, from one pass over the processes (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    found, todo = [], list(pids)
    while todo:
        below = [c for c in children.get(todo.pop(), []) if c not in found]
        found += below
        todo += below
    return found


def ancestors() -> set[int]:
    """This process and every process above it."""
    return {os.getpid(), *(p.pid for p in psutil.Process().parents())}


def carrying(*entries: str, job: str | None = None) -> list[int]:
    """This user's processes whose environment holds one of `entries` (`NAME=value`) and, with `job`, that
    Slurm job's SLURM_JOB_ID; never this process or its ancestors (which may carry them too: a job's clean-up
    step)."""
    wanted = [tuple(entry.split("=", 1)) for entry in entries]
    skip, uid, found = ancestors(), os.getuid(), []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            if proc.uids().real != uid:
                continue
            environ = proc.environ()
        except psutil.Error:  # gone, or not ours to read
            continue
        if (job is None or environ.get("SLURM_JOB_ID") == job) and any(environ.get(k) == v for k, v in wanted):
            found.append(proc.pid)
    return found


def marked(*entries: str, job: str | None = None, below: tuple[int, ...] = ()) -> list[int]:
    """The processes `carrying` one of `entries` (of `job`), and every process below them and below `below`;
    never this process or its ancestors. The tree counts because a marker can vanish from /proc/PID/environ:
    Ray's processes retitle themselves (setproctitle), which may overwrite the start of that block."""
    found = carrying(*entries, job=job)
    return sorted(set(found + descendants(*found, *below)) - ancestors())


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet waited for, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL `pids` and wait until they are gone (or `timeout_s`); those still there."""
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def is_gcs(pid: int) -> bool:
    try:
        return os.path.basename(psutil.Process(pid).exe()) == GCS_EXECUTABLE
    except psutil.Error:
        return False


def kill_gcs_last(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Kill `pids`, a Ray cluster's, every one but its GCS first and that one once they are gone (none
    of them then sends the token to the GCS port after it is free); those still there."""
    gcs = [p for p in pids if is_gcs(p)]
    left = kill([p for p in pids if p not in gcs], timeout_s)
    return left + kill(gcs, timeout_s)
