"""Where one Slurm job's Ray cluster lives: its ports, temp dirs, log folder and head address.

Everything derives from the job id, so two jobs sharing a node never pick the same port
or folder, and a requeued job (same id) gets the same layout back. Standard library only:
the sbatch script runs `python -m rayhpc.slurm.layout` before anything else and `eval`s
the `export` lines it prints.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

PORT_BASE, PORT_MAX, BLOCK = 10000, 65535, 200  # a 200-port block per job, from 10000 up
EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"

# offsets inside a job's block; worker processes use the rest of the block
OFFSETS = {"gcs": 0, "node_manager": 1, "object_manager": 2, "dashboard": 3, "dashboard_agent_grpc": 4,
           "dashboard_agent_listen": 5, "metrics_export": 6, "runtime_env_agent": 7, "client_server": 8}
FIRST_WORKER, LAST_WORKER = 20, BLOCK - 1


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux default 32768-60999)."""
    try:
        low, high = map(int, Path(EPHEMERAL).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def block_bases(ephemeral: tuple[int, int] | None = None) -> list[int]:
    """First port of every block that lies wholly outside the ephemeral range: any outgoing
    connection on the node (srun's I/O, a client of another job) may hold a port in that range,
    and Ray's GCS then fails with "Address already in use" on its fixed port. Where the range
    leaves no room, every block (a collision is then possible, as before)."""
    low, high = ephemeral or ephemeral_range()
    blocks = range(PORT_BASE, PORT_MAX - BLOCK + 2, BLOCK)
    return [b for b in blocks if b + BLOCK <= low or b > high] or list(blocks)


def ports(job_id: int, ephemeral: tuple[int, int] | None = None) -> dict[str, int]:
    """Every port Ray opens for job `job_id`: block `job_id mod len(block_bases())` (135 blocks with
    Linux's default ephemeral range; jobs whose ids differ by that share a block: don't run them on
    one node at once)."""
    bases = block_bases(ephemeral)
    base = bases[job_id % len(bases)]
    out = {name: base + offset for name, offset in OFFSETS.items()}
    out.update(min_worker=base + FIRST_WORKER, max_worker=base + LAST_WORKER)
    return out


def temp_dir(job_id: int, node: str) -> str:
    """Ray's node-local temp dir: short, so its Unix socket paths stay far below 107 bytes
    (`/tmp/rh-<job>-<node>/session_<date>_<pid>/sockets/plasma_store` is about 75), and named by
    node too, for nodes that share /tmp."""
    return f"/tmp/rh-{job_id}-{node}"


def head_ip(override: str | None = None) -> str:
    """This (the head) node's address that other nodes reach: the override, else an address of
    this host's name that is configured on one of its interfaces, else its first non-loopback one."""
    if override:
        return override
    local = [a for a in _interface_addresses() if not ipaddress.ip_address(a).is_loopback]
    try:
        named = [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except socket.gaierror:
        named = []
    for address in named:
        if address in local:
            return address
    if local:
        return local[0]
    raise RuntimeError(f"no non-loopback address on {socket.gethostname()}; set ray.head_ip in the cluster config")


def _interface_addresses() -> list[str]:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [a for a in out.split() if ":" not in a]  # IPv4 only: Ray's --node-ip-address


def nodes_of(nodelist: str) -> list[str]:
    """Slurm's compressed node list (`node[1-2]`) expanded."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def shell_exports(env: dict[str, str]) -> dict[str, str]:
    """The layout of the current Slurm job, as RH_* shell variables."""
    job = int(env["SLURM_JOB_ID"])
    nodes = nodes_of(env["SLURM_JOB_NODELIST"])
    log_dir = env.get("RAYHPC_LOG_DIR") or os.path.join(env.get("SLURM_SUBMIT_DIR", os.getcwd()), "rayhpc-logs")
    out = {f"RH_{k.upper()}_PORT": str(v) for k, v in ports(job).items()}
    out.update(RH_JOB=str(job), RH_NODES=" ".join(nodes), RH_HEAD=nodes[0], RH_NNODES=str(len(nodes)),
               RH_HEAD_IP=head_ip(env.get("RAYHPC_HEAD_IP")), RH_JOB_DIR=os.path.join(log_dir, str(job)))
    return out


def main() -> int:
    try:
        exports = shell_exports(dict(os.environ))
    except (KeyError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"error: rayhpc.slurm.layout: {exc}", file=sys.stderr)
        return 2
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in exports.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
