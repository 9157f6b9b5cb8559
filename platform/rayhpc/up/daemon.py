"""The process that holds the user's cluster, started in the background by `rayhpc up`:

    python -m rayhpc.up.daemon [--num-cpus N] [--num-gpus N] [--no-dashboard] [--no-warm]

It holds the cluster in a child of its own (`hold`), which starts a local Ray as every job does
(`cluster.start_local`: private temp folder, a token of its own, ports its processes choose), starts the
warm starter (`rayhpc.up.starter`: job commands run in children of one interpreter that has imported torch
and Ray already), writes the connection file, and waits. On SIGTERM, SIGINT or SIGHUP (`rayhpc down`), and
when the holder is killed, the child removes the connection file first (no new job joins), stops Ray (its
GCS last), and kills whatever process of the cluster is left: every process Ray started carries MARKER in
its environment.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

from rayhpc import cluster, processes
from rayhpc.monitor.startup import start_ticks
from rayhpc.up import connection

log = logging.getLogger(__name__)


def cluster_info(ctx, marker: str, holder: int) -> dict:
    """The connection file's fields (those of a Slurm job's cluster.json, and the holding process)."""
    address = ctx.address_info["gcs_address"]
    info = {"job": None, "restart": 0, "head": connection.host(), "head_ip": address.rsplit(":", 1)[0],
            "address": address, "ports": {"gcs": int(address.rsplit(":", 1)[1])},
            "nodes": {connection.host(): address.rsplit(":", 1)[0]},
            "token_path": str(cluster.local_token()),
            "pid": holder, "pid_start": start_ticks(holder), "marker": marker, "started": time.time(),
            "temp_dir": str(cluster.local_temp()), "ray_tmpdir": os.environ["RAY_TMPDIR"],
            "environment": connection.environment()}  # a job of another environment does not join (`find`)
    if ctx.dashboard_url:
        info.update(dashboard=f"http://{ctx.dashboard_url}",
                    tunnel=f"ssh -N -L {ctx.dashboard_url.rsplit(':', 1)[1]}:{ctx.dashboard_url} {connection.host()}")
        info["ports"]["dashboard"] = int(ctx.dashboard_url.rsplit(":", 1)[1])
    return info


WARM_START_TIMEOUT_S = 60.0  # its imports: seconds
WARM_STOP_TIMEOUT_S = 30.0  # its jobs' statuses sent to their commands: at once, once the jobs have ended


def start_warm(workers: bool = False) -> subprocess.Popen | None:
    """The warm starter (of commands, or of Ray's workers), once it listens (the cluster is announced after it:
    the first command is warm too); None, with a line in the log, where it did not start."""
    starter = subprocess.Popen([sys.executable, "-P", "-m", "rayhpc.up.starter", *(["--workers"] if workers else [])],
                               stdin=subprocess.DEVNULL, cwd=connection.folder())
    deadline = time.monotonic() + WARM_START_TIMEOUT_S
    while not (connection.workers_socket_path() if workers else connection.socket_path()).exists():
        if starter.poll() is not None or time.monotonic() > deadline:
            starter.kill()
            print(f"rayhpc up: no warm starter: each {'Ray worker' if workers else 'command'} imports torch itself",
                  flush=True)
            return None
        time.sleep(0.05)
    return starter


def stop_warm(starter: subprocess.Popen | None, path) -> None:
    """A warm starter ends once the processes it started have (`rayhpc down` stopped them first)."""
    if starter is None:
        return
    starter.terminate()
    try:
        starter.wait(timeout=WARM_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        starter.kill()
        starter.wait()
    path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """The holder: the process the connection file names. The cluster itself runs in a child of it (`hold`),
    which stops it when told (`rayhpc down`: SIGTERM to the holder, passed on) and also when the holder is
    killed (SIGKILL included: the child's parent-death signal). Ray ties a local cluster's processes to the
    process that started it, all at once: were that the holder, a killed holder would leave Ray's agents,
    workers and dashboard modules calling the dead GCS's port for seconds, with the token."""
    parser = argparse.ArgumentParser(prog="python -m rayhpc.up.daemon")
    parser.add_argument("--num-cpus", type=float)
    parser.add_argument("--num-gpus", type=float)
    parser.add_argument("--no-dashboard", action="store_true")
    parser.add_argument("--no-warm", action="store_true", help="without the warm starter (rayhpc.up.starter)")
    args = parser.parse_args(argv)
    os.umask(0o077)
    holder = os.getpid()
    child = os.fork()  # before Ray or torch is imported: no thread runs yet
    if child == 0:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != holder:  # the holder died before the signal was armed
            return 1
        return hold(args, holder)  # its exit runs its exit handlers (its private temp folder goes)
    def pass_on(_signum, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
            os.kill(child, signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    _, status = os.waitpid(child, 0)  # resumed after each signal passed on (PEP 475)
    return os.waitstatus_to_exitcode(status)


PR_SET_PDEATHSIG = 1


def hold(args: argparse.Namespace, holder: int) -> int:
    """The cluster, in the holder's child: start it, announce it, and on SIGTERM stop it (the connection file
    first: no new job joins; then the warm starter, Ray, and whatever process of the cluster is left: every
    process Ray started carries MARKER in its environment)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    marker = secrets.token_hex(8)
    os.environ[connection.MARKER] = marker  # every process Ray starts inherits it
    options = {k: v for k, v in (("num_cpus", args.num_cpus), ("num_gpus", args.num_gpus)) if v is not None}
    # its jobs' workers start from the cluster's own starter (below), not from one of this job's
    ctx = cluster.start_local(warm=False, logging_level=logging.WARNING, log_to_driver=False,
                              include_dashboard=not args.no_dashboard and cluster.dashboard_installed(), **options)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # ray.init replaced it
    starter = None if args.no_warm else start_warm()
    workers = None if args.no_warm else start_warm(workers=True)
    connection.write({**cluster_info(ctx, marker, holder), "warm_pid": starter and starter.pid,
                      "workers_pid": workers and workers.pid})
    print(f"rayhpc up: cluster at {ctx.address_info['gcs_address']} held by process {holder}", flush=True)
    while not stop.wait(1.0):
        pass
    with_file = connection.read()
    if with_file and with_file.get("pid") == holder:
        connection.path().unlink()
    stop_warm(starter, connection.socket_path())
    cluster.disconnect()  # Ray's workers end with it, then their starter
    stop_warm(workers, connection.workers_socket_path())
    processes.kill_gcs_last(connection.leftovers(marker))
    print("rayhpc down: cluster stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
