"""Readiness checks for the sbatch startup: poll, never sleep a fixed time.

    python -m rayhpc.slurm.wait head PORT TIMEOUT JOB_DIR HEAD_STEP_PID   # this job's head listens on PORT
    python -m rayhpc.slurm.wait nodes HOST:PORT TIMEOUT JOB_DIR n1 n2     # every node has joined, as this job's cluster

An open port proves nothing on a shared node (anyone may hold it), so `head` waits until the port is
held by a process of this job's head Ray (the kernel's socket table and the process's environment),
and `nodes` connects with the job's token and checks that the cluster's head is the one this job
started (its raylet socket lies in the job's private temp dir).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rayhpc.slurm.layout import sockets
from rayhpc.slurm.node import NODE_MARKER, marked_processes

POLL_S = 0.1


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` on this node (any address, v4 or v6)."""
    return {inode for _, p, state, inode in sockets(("tcp", "tcp6")) if p == port and state == "0A"}


def holders(inodes: set[str], pids: list[int]) -> list[int]:
    """Which of `pids` hold one of the sockets `inodes`."""
    found = []
    for pid in pids:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            found.append(pid)
    return found


def wait_head(port: int, timeout_s: float, job_dir: Path, step_pid: int) -> None:
    job, head = os.environ["SLURM_JOB_ID"], os.environ.get("RH_HEAD", "")
    deadline = time.monotonic() + timeout_s
    while True:
        inodes = listening_inodes(port)
        if inodes:
            if holders(inodes, marked_processes(job, [f"{NODE_MARKER}={job}:{head}"])):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"port {port} on the head is held by a process that is not this job's Ray "
                                   f"(another user's?); see {job_dir}/ray-{head}.log")
        try:
            os.kill(step_pid, 0)
        except ProcessLookupError:
            held = f" (port {port} is held by another process: another user's?)" if listening_inodes(port) else ""
            raise TimeoutError(f"Ray on the head ({head}) exited before it listened on port {port}{held}: see "
                               f"{job_dir}/ray-{head}.log") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray head did not open its port {port} within {timeout_s:g} s")
        time.sleep(POLL_S)


def node_records(job_dir: Path, hosts: list[str]) -> dict[str, dict]:
    """What each node's `rayhpc.slurm.node run` wrote when it started Ray (address, temp dir)."""
    out = {}
    for host in hosts:
        path = job_dir / "nodes" / f"{host}.ray.json"
        if path.is_file():
            out[host] = json.loads(path.read_text())
    return out


def wait_nodes(address: str, job_dir: Path, hosts: list[str], timeout_s: float) -> float:
    """Seconds until a Ray node is alive at each host's address; names the missing hosts otherwise."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    started, deadline = time.monotonic(), time.monotonic() + timeout_s
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        head_dir = node_records(job_dir, hosts[:1])[hosts[0]]["temp_dir"]
        nodes = [n for n in ray.nodes() if n["Alive"]]
        if not any(n.get("RayletSocketName", "").startswith(head_dir + "/") for n in nodes):
            raise TimeoutError(f"the cluster at {address} is not this job's: no node's raylet lives in {head_dir}")
        while True:
            records = node_records(job_dir, hosts)
            alive = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
            missing = [h for h in hosts if h not in records or records[h]["ip"] not in alive]
            if not missing:
                return time.monotonic() - started
            if time.monotonic() > deadline:
                joined = [h for h in hosts if h not in missing]
                raise TimeoutError(f"node(s) {', '.join(missing)} did not join the Ray cluster within {timeout_s:g} s "
                                   f"({len(joined)} of {len(hosts)} joined: {', '.join(joined) or 'none'})")
            time.sleep(POLL_S)
    finally:
        ray.shutdown()


def main(argv: list[str]) -> int:
    what, timeout, job_dir = argv[0], float(argv[2]), Path(argv[3])
    try:
        if what == "head":
            wait_head(int(argv[1]), timeout, job_dir, int(argv[4]))
        else:
            seconds = wait_nodes(argv[1], job_dir, argv[4:], timeout)
            print(f"rayhpc: all {len(argv[4:])} node(s) joined in {seconds:.1f} s", flush=True)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
