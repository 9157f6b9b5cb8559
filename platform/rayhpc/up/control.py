"""`rayhpc up` and `rayhpc down`: start the user's cluster in the background, stop it and check that
nothing of it is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rayhpc import processes, user_cluster
from rayhpc.config import ConfigError
from rayhpc.private import UnsafePath

START_TIMEOUT_S = 120.0  # Ray's start on a loaded node: seconds, not minutes
JOB_STOP_TIMEOUT_S = 60.0  # a job told to stop saves its state and ends (interrupt: within its grace period)


def current() -> dict | None:
    """The user's cluster on this machine where it is up (a stale connection file is removed)."""
    try:
        info = user_cluster.read()
    except UnsafePath as exc:
        raise ConfigError(str(exc)) from None
    if info is not None and user_cluster.problem(info) is not None:
        user_cluster.remove_remains(info)
        return None
    return info


def describe(info: dict) -> str:
    """The cluster of `info` in a few lines: address, process, since when, dashboard."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
    lines = [(f"your cluster (rayhpc up) on {info['head']}: {info['address']}, held by process {info['pid']} "
              f"since {since}; connection file {user_cluster.path()}")]
    if info.get("dashboard"):
        lines.append(f"dashboard {info['dashboard']} (token: {info['token_path']})")
    return "\n".join(lines)


def up(num_cpus: float | None = None, num_gpus: float | None = None, dashboard: bool = True) -> str:
    """Start the cluster in a background process of its own session (it outlives this command) and
    wait for its connection file; the text to print."""
    info = current()
    if info is not None:
        return "already up: " + describe(info)
    folder = user_cluster.folder()
    log_file = user_cluster.log_path()
    with contextlib.suppress(FileNotFoundError):
        log_file.unlink()
    command = [sys.executable, "-P", "-m", "rayhpc.up.daemon"]
    for flag, value in (("--num-cpus", num_cpus), ("--num-gpus", num_gpus)):
        if value is not None:
            command.append(f"{flag}={value:g}")
    if not dashboard:
        command.append("--no-dashboard")
    with open(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as log:
        # in a session of its own (not stopped by this terminal's Ctrl-C or hang-up), and in its private folder:
        # its Ray's processes and workers start there, never in a folder another user may write
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=folder)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = user_cluster.read()
        if info is not None and info["pid"] == proc.pid:
            return "started " + describe(info) + "\ncommands on this machine join it; `rayhpc down` stops it"
        if proc.poll() is not None:
            raise RuntimeError(f"rayhpc up: the cluster did not start (exit {proc.returncode}); its log "
                               f"{log_file}:\n{log_file.read_text()[-2000:]}")
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"rayhpc up: no cluster within {START_TIMEOUT_S:g} s; its log: {log_file}")


def down(timeout_s: float = JOB_STOP_TIMEOUT_S) -> tuple[str, bool]:
    """Stop the jobs on the cluster (each saves its state and says the cluster went away), then the
    cluster; kill what is left of it. The text to print, and whether nothing was left."""
    try:
        info = user_cluster.read()
    except UnsafePath as exc:
        raise ConfigError(str(exc)) from None
    if info is None:
        return f"no cluster of yours is up on {user_cluster.host()} (no {user_cluster.path()})", True
    lines = []
    user_cluster.write({**info, "stopping": True})  # the jobs' stop lines say the cluster went away
    jobs = user_cluster.jobs()
    if jobs:
        lines.append(f"stopping {len(jobs)} job(s) on it (SIGTERM: each saves its state): pids "
                     + " ".join(map(str, jobs)))
        _stop_and_wait(jobs, timeout_s)
    if user_cluster.process_alive(info["pid"], info["pid_start"]):
        _stop_and_wait([info["pid"]], timeout_s)
    left = user_cluster.remove_remains(info)
    if left:
        lines.append(f"killed {len(left)} process(es) of the cluster that outlived it: {' '.join(map(str, left))}")
    with contextlib.suppress(OSError):
        user_cluster.jobs_dir().rmdir()  # empty: every job on it has ended
    alive = user_cluster.leftovers(info["marker"])
    gone = not alive and not any(Path(info[k]).exists() for k in ("temp_dir", "ray_tmpdir"))
    lines.append(f"stopped your cluster at {info['address']}" + ("" if gone else f"; still there: {alive}"))
    return "\n".join(lines), gone


def _stop_and_wait(pids: list[int], timeout_s: float) -> None:
    """SIGTERM each of `pids`, then wait (up to `timeout_s`) until they are gone; SIGKILL the rest."""
    starts = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            starts[pid] = user_cluster.start_ticks(pid)
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(user_cluster.process_alive(p, t) for p, t in starts.items()):
        time.sleep(0.1)
    processes.kill([p for p, t in starts.items() if user_cluster.process_alive(p, t)])
