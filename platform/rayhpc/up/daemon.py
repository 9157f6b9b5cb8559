"""The process that holds the user's cluster, started in the background by `rayhpc up`:

    python -m rayhpc.up.daemon [--num-cpus N] [--num-gpus N] [--no-dashboard]

It starts a local Ray as every job does (`cluster.start_local`, which starts its node with `rayhpc.ray_start`:
private temp folder, a token of its own, ports its processes choose), writes the connection file, and waits.
On SIGTERM, SIGINT or SIGHUP (`rayhpc down`) it removes the connection file first (no new job joins), stops
Ray (its GCS last), and kills whatever process of the cluster is left: every process Ray started carries
MARKER in its environment. Killed (SIGKILL included), it takes its Ray with it: the node's supervisor stops
the node when the process that started it ends (its parent-death signal), the GCS last.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
import time

from rayhpc import cluster, processes, user_cluster
from rayhpc.monitor.startup import start_ticks

log = logging.getLogger(__name__)


def cluster_info(ctx, marker: str, holder: int) -> dict:
    """The connection file's fields (those of a Slurm job's cluster.json, and the holding process)."""
    address = ctx.address_info["gcs_address"]
    info = {"job": None, "restart": 0, "head": user_cluster.host(), "head_ip": address.rsplit(":", 1)[0],
            "address": address, "ports": {"gcs": int(address.rsplit(":", 1)[1])},
            "nodes": {user_cluster.host(): address.rsplit(":", 1)[0]},
            "token_path": str(cluster.local_token()),
            "pid": holder, "pid_start": start_ticks(holder), "marker": marker, "started": time.time(),
            "temp_dir": str(cluster.local_temp()), "ray_tmpdir": os.environ["RAY_TMPDIR"],
            "environment": user_cluster.environment()}  # a job of another environment does not join (`find`)
    if ctx.dashboard_url:
        info.update(dashboard=f"http://{ctx.dashboard_url}",
                    tunnel=f"ssh -N -L {ctx.dashboard_url.rsplit(':', 1)[1]}:{ctx.dashboard_url} {user_cluster.host()}")
        info["ports"]["dashboard"] = int(ctx.dashboard_url.rsplit(":", 1)[1])
    return info


def main(argv: list[str] | None = None) -> int:
    """The holder: the process the connection file names, and the Ray driver that started the cluster. It stops
    the cluster when told (`rayhpc down`: SIGTERM): the connection file first (no new job joins), then Ray, and
    whatever process of the cluster is left (every process Ray started carries MARKER in its environment)."""
    parser = argparse.ArgumentParser(prog="python -m rayhpc.up.daemon")
    parser.add_argument("--num-cpus", type=float)
    parser.add_argument("--num-gpus", type=float)
    parser.add_argument("--no-dashboard", action="store_true")
    args = parser.parse_args(argv)
    os.umask(0o077)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    marker = secrets.token_hex(8)
    os.environ[user_cluster.MARKER] = marker  # every process Ray starts inherits it
    ctx = cluster.start_local(num_cpus=args.num_cpus, num_gpus=args.num_gpus, logging_level=logging.WARNING,
                              log_to_driver=False,
                              include_dashboard=not args.no_dashboard and cluster.dashboard_installed())
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())  # ray.init replaced SIGTERM's
    user_cluster.write(cluster_info(ctx, marker, os.getpid()))
    print(f"rayhpc up: cluster at {ctx.address_info['gcs_address']} held by process {os.getpid()}", flush=True)
    while not stop.wait(1.0):
        pass
    with_file = user_cluster.read()
    if with_file and with_file.get("pid") == os.getpid():
        user_cluster.path().unlink()
    cluster.disconnect()
    processes.kill_gcs_last(user_cluster.leftovers(marker))
    print("rayhpc down: cluster stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
