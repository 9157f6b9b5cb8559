"""Readiness checks for the sbatch startup: poll, never sleep a fixed time.

    python -m rayhpc.slurm.wait head TIMEOUT JOB_DIR HEAD_STEP_PID   # prints this job's head's GCS address
    python -m rayhpc.slurm.wait nodes HOST:PORT TIMEOUT JOB_DIR n1 n2  # every node has joined; the connection file

The head's GCS binds a port of the system's choosing (0): `head` reads which from the kernel's socket table,
the port the job's own `gcs_server` process listens on (found by the job's marker in its environment), so the
other nodes start as soon as it listens. An open port proves nothing on a shared node, but this one was
bound by the job's GCS itself. `nodes` waits until the head is up (`ray start` writes the address into the
head's private temp folder then: it must be the same) and the client server's port (its number fixed in the
job's block: Ray will not bind it with 0) is held by the job's Ray, connects with the job's token, checks
that the cluster's head is the one this job started (its raylet socket lies in the job's private temp dir)
and waits for every node, then writes the connection file from what Ray published
(`rayhpc.slurm.connection`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rayhpc import ray_start
from rayhpc.processes import is_gcs
from rayhpc.slurm import connection
from rayhpc.slurm.layout import sockets
from rayhpc.slurm.node import NODE_MARKER, job_processes, node_records

POLL_S = 0.1


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` on this node (any address, v4 or v6)."""
    return {inode for _, p, state, inode in sockets(("tcp", "tcp6")) if p == port and state == "0A"}


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process `pid` holds (none where it is gone)."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return set()
    return {link[8:-1] for link in links if link.startswith("socket:[")}


def holders(inodes: set[str], pids: list[int]) -> list[int]:
    """Which of `pids` hold one of the sockets `inodes`."""
    return [pid for pid in pids if socket_inodes(pid) & inodes]


def listened_by(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on."""
    held = socket_inodes(pid)
    return {port for _, port, state, inode in sockets(("tcp", "tcp6")) if state == "0A" and inode in held}


def wait_head(timeout_s: float, job_dir: Path, step_pid: int) -> str:
    """This job's head's GCS address, once the job's GCS listens; `TimeoutError` naming what went wrong."""
    job, head = os.environ["SLURM_JOB_ID"], os.environ.get("RH_HEAD", "")
    deadline = time.monotonic() + timeout_s
    while True:
        gcs = [pid for pid in job_processes(job, [f"{NODE_MARKER}={job}:{head}"]) if is_gcs(pid)]
        ports = set().union(*map(listened_by, gcs))
        if len(ports) == 1:
            return f"{node_records(job_dir, [head])[head]['ip']}:{ports.pop()}"
        try:
            os.kill(step_pid, 0)
        except ProcessLookupError:
            raise TimeoutError(f"Ray on the head ({head}) exited before its GCS listened: see "
                               f"{job_dir}/ray-{head}.log") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray head's GCS ({head}) did not listen within {timeout_s:g} s: see "
                               f"{job_dir}/ray-{head}.log")
        time.sleep(POLL_S)


def held_by_the_job(port: int, name: str, job_dir: Path, head: str) -> bool:
    """Whether the job's processes on this node (the head) listen on `port` (of the job's block); `TimeoutError`
    naming it where another process holds it (another user bound it before Ray did)."""
    job = os.environ["SLURM_JOB_ID"]
    inodes = listening_inodes(port)
    if holders(inodes, job_processes(job, [f"{NODE_MARKER}={job}:{head}"])):
        return True
    if inodes:
        raise TimeoutError(f"port {port} ({name}) on the head is held by another process (another user's?), not "
                           f"this job's Ray: the job stops; see {job_dir}/ray-{head}.log")
    return False


def wait_nodes(address: str, job_dir: Path, hosts: list[str], timeout_s: float) -> tuple[float, dict]:
    """Seconds until a Ray node is alive at each host's address, and what Ray published of the ports its
    processes bound (`{"dashboard": host:port or "", "metrics_export": {node address: port}}`); names the
    missing hosts otherwise."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    started, deadline = time.monotonic(), time.monotonic() + timeout_s
    client = int(os.environ["RH_CLIENT_SERVER_PORT"]), "Ray's client server", job_dir, hosts[0]
    # connected once the head is up (its dashboard's address is published then), never while its client
    # server cannot bind (its `ray start` stops every process of the head a second later)
    head_dir = node_records(job_dir, hosts[:1])[hosts[0]]["temp_dir"]  # `ray start` writes the address there
    while not held_by_the_job(*client) or (head := ray_start.address(Path(head_dir).parent)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray head ({hosts[0]}) was not up within {timeout_s:g} s: see "
                               f"{job_dir}/ray-{hosts[0]}.log")
        time.sleep(POLL_S)
    if head != address:
        raise TimeoutError(f"the Ray head ({hosts[0]}) published {head}, not the address its GCS listens on "
                           f"({address}): see {job_dir}/ray-{hosts[0]}.log")
    ctx = ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        if not any(n.get("RayletSocketName", "").startswith(head_dir + "/") for n in nodes):
            raise TimeoutError(f"the cluster at {address} is not this job's: no node's raylet lives in {head_dir}")
        while True:
            records = node_records(job_dir, hosts)
            alive = {n["NodeManagerAddress"]: n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]}
            missing = [h for h in hosts if h not in records or records[h]["ip"] not in alive]
            if not missing:
                return time.monotonic() - started, {"dashboard": ctx.dashboard_url or "", "metrics_export": alive}
            if time.monotonic() > deadline:
                joined = [h for h in hosts if h not in missing]
                raise TimeoutError(f"node(s) {', '.join(missing)} did not join the Ray cluster within {timeout_s:g} s "
                                   f"({len(joined)} of {len(hosts)} joined: {', '.join(joined) or 'none'})")
            time.sleep(POLL_S)
    finally:
        ray.shutdown()


def main(argv: list[str]) -> int:
    try:
        if argv[0] == "head":
            print(wait_head(float(argv[1]), Path(argv[2]), int(argv[3])), flush=True)
            return 0
        seconds, published = wait_nodes(argv[1], Path(argv[3]), argv[4:], float(argv[2]))
        print(f"rayhpc: all {len(argv[4:])} node(s) joined in {seconds:.1f} s", flush=True)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return connection.main(published)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
