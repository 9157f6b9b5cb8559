"""Where one Slurm job's Ray cluster lives: its fixed ports, log folder, token and node addresses.

Every port that Ray's own processes call with the job's token is bound by its owner with port 0 and
published by Ray after it is bound (the sbatch startup's `ray start` lines): the GCS, each raylet's node
and object managers, the dashboard and its agents, the runtime-env agent, the metrics export, the
workers. A port number chosen here and handed to Ray could be taken first by another user, who would
then receive those calls. Three ports Ray cannot bind so, which none of its processes sends the token
to, form the job's block (`OFFSETS`): the Ray client server (Ray refuses port 0; only `ray://` clients
call it) and the autoscaler's and dashboard's Prometheus endpoints (their numbers are what Ray publishes
for Prometheus to scrape). The block is chosen at start time: the first, from block `job id mod blocks`
on, whose every port is unused on every node of the allocation (the startup asks each node which ports
are in use, `python -m rayhpc.slurm.layout busy`), so two jobs sharing a node never collide. Blocks
start at 20000, clear of Ray's defaults that plain Ray users on the node take from (GCS 6379, client
server 10001, workers 10002-19999, dashboard 8265), and stay outside the kernel's ephemeral range.
Standard library only: the sbatch startup runs `python -m rayhpc.slurm.layout` before anything else
and `eval`s the `export` lines it prints.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from rayhpc.private import UnsafePath, log_folder, private_dir, write_private

# offsets inside a job's block: the ports Ray cannot bind with 0 (why each is safe to fix: docs/security.md).
# The two metrics ports are fixed in Ray (44217, 44227) unless set by environment variable: the startup sets them.
OFFSETS = {"client_server": 0, "autoscaler_metrics": 1, "dashboard_metrics": 2}
PORT_BASE, PORT_MAX, BLOCK = 20000, 65535, len(OFFSETS)  # a block per job, from 20000 up
EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"


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
    leaves no room, every block (busy ports are still avoided at start time)."""
    low, high = ephemeral or ephemeral_range()
    blocks = range(PORT_BASE, PORT_MAX - BLOCK + 2, BLOCK)
    return [b for b in blocks if b + BLOCK <= low or b > high] or list(blocks)


def ports_at(base: int) -> dict[str, int]:
    return {name: base + offset for name, offset in OFFSETS.items()}


def ports(job_id: int, busy: set[int] = frozenset(), ephemeral: tuple[int, int] | None = None) -> dict[str, int]:
    """The fixed ports of job `job_id`: the first block from `job_id mod len(block_bases())` on with no port in
    `busy` (the ports in use on any node of the job)."""
    bases = block_bases(ephemeral)
    first = job_id % len(bases)
    for base in bases[first:] + bases[:first]:
        if not busy.intersection(range(base, base + BLOCK)):
            return ports_at(base)
    raise RuntimeError(f"no free block of {BLOCK} ports between {PORT_BASE} and {PORT_MAX} outside the ephemeral "
                       f"range {ephemeral or ephemeral_range()} on this job's nodes ({len(busy)} ports in use)")


def sockets(kinds: tuple[str, ...] = ("tcp", "tcp6", "udp", "udp6")) -> list[tuple[str, int, str, str]]:
    """(kind, local port, state, inode) of every socket of `kinds` in this node's network namespace,
    read from /proc/net (state 0A is a TCP listener)."""
    rows = []
    for kind in kinds:
        try:
            lines = Path("/proc/net", kind).read_text().splitlines()[1:]
        except OSError:
            continue
        for fields in (line.split() for line in lines if line.strip()):
            rows.append((kind, int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]))
    return rows


def busy_ports() -> set[int]:
    """Local ports in use on this node (any state: listening, connected, bound), TCP and UDP, v4 and v6."""
    return {port for _, port, _, _ in sockets()}


def node_ip(override: str | None = None) -> str:
    """This node's address that other nodes reach: the override, else an address of this host's name
    that is configured on one of its interfaces, else its first non-loopback one. Never loopback:
    resolving the name alone can give 127.0.0.1 (Debian's `127.0.1.1 <hostname>` line does)."""
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
    raise RuntimeError(f"no non-loopback address on {socket.gethostname()}; set ray.head_ip in the cluster "
                       "config")


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


def log_dir_of(env: dict[str, str]) -> str:
    """The job's log folder: RAYHPC_LOG_DIR (`rayhpc submit` sets the cluster config's), else `rayhpc-logs` in the
    folder it was submitted from."""
    return env.get("RAYHPC_LOG_DIR") or os.path.join(env.get("SLURM_SUBMIT_DIR", os.getcwd()), "rayhpc-logs")


def job_log(env: dict[str, str]) -> Path:
    """Where a job submitted without an output file of its own (`sbatch ray_cluster.sbatch ...` directly: its
    `--output` is /dev/null) writes its log: `<log_dir>/<job name>-<job id>.log`, as `rayhpc submit` names it,
    in a log folder no other user can create files in (`log_folder`)."""
    return log_folder(log_dir_of(env)) / f"{env.get('SLURM_JOB_NAME', 'rayhpc-ray')}-{env['SLURM_JOB_ID']}.log"


def shell_exports(env: dict[str, str], busy: set[int]) -> dict[str, str]:
    """The layout of the current Slurm job, as RH_* shell variables; creates the job's private folder
    (`<log_dir>/<job>`, 0700) and a fresh token in it (0600, never printed)."""
    job = int(env["SLURM_JOB_ID"])
    nodes = nodes_of(env["SLURM_JOB_NODELIST"])
    log_dir = log_dir_of(env)
    out = {f"RH_{k.upper()}_PORT": str(v) for k, v in ports(job, busy).items()}
    ip = node_ip(env.get("RAYHPC_HEAD_IP"))
    job_dir = private_dir(Path(log_dir) / str(job))  # last: nothing is left behind when a check above fails
    token = write_private(job_dir / "auth_token", secrets.token_hex(32) + "\n")
    out.update(RH_JOB=str(job), RH_NODES=" ".join(nodes), RH_HEAD=nodes[0], RH_NNODES=str(len(nodes)),
               RH_HEAD_IP=ip, RH_JOB_DIR=str(job_dir), RH_TOKEN=str(token))
    return out


def main(argv: list[str]) -> int:
    """`busy`: this node's ports in use, one per line. `log`: the job's own log file (`job_log`). No argument:
    the job's exports, reading every node's busy ports from stdin."""
    if argv[:1] == ["busy"]:
        print("\n".join(map(str, sorted(busy_ports()))))
        return 0
    if argv[:1] == ["log"]:
        try:
            print(job_log(dict(os.environ)))
        except (KeyError, OSError, UnsafePath) as exc:
            print(f"error: log_dir {log_dir_of(dict(os.environ))}: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        busy = {int(word) for word in sys.stdin.read().split()} if not sys.stdin.isatty() else busy_ports()
        exports = shell_exports(dict(os.environ), busy)
    except (KeyError, RuntimeError, OSError, UnsafePath, subprocess.CalledProcessError) as exc:
        print(f"error: rayhpc.slurm.layout: {exc}", file=sys.stderr)
        return 2
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in exports.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
