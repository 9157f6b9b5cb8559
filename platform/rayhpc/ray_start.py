"""Starting Ray, the one way: a job's own local Ray, the user's cluster (`rayhpc up`) and each node of a Slurm
job run Ray's public `ray start --block` with the same flags and environment (`command`, `environment`), under
a supervisor of the platform's that stops it (`python -m rayhpc.ray_start`; on Slurm, `rayhpc.slurm.node run`).
Later processes connect with `ray.init(address=...)`, the address read from the file `ray start` writes into
the node's private folder once the node is up (`address`). Standard library and psutil (`rayhpc.processes`).

- Every port of Ray's that its processes call with the cluster's token is 0: bound by its owner, then
  published by Ray (a number given here would be visible in `ps` before Ray binds it, for another user to
  take). The Ray client server is the exception (Ray refuses 0; only `ray://` clients call it): its port is
  the caller's to choose and check (`rayhpc.slurm.layout`, `free_port`).
- Ray's files (sockets, logs, spilled objects) live in `<folder>/ray` inside a folder the caller made 0700:
  Ray makes its own folders 0777. The folder is TMPDIR and RAY_TMPDIR of every process Ray starts, so
  Ray's state API in a worker finds this cluster (`<RAY_TMPDIR>/ray/ray_current_cluster`), never another's.
- Ray's processes import nothing from their working folder (PYTHONSAFEPATH) and carry a marker in their
  environment, by which the platform finds every one of them.
- The supervisor stops the node with its GCS last: every other process first, then the GCS, so none of them
  calls a freed GCS port, with the token, for whoever binds it next. `ray start` ties its children to itself
  (Ray's parent-death signal) and stops the GCS second: it is held (SIGSTOP) meanwhile, and killed last.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rayhpc.processes import descendants, kill, kill_gcs_last

RAY_DIR = "ray"  # Ray's temp dir inside the node's folder: where Ray looks by default with RAY_TMPDIR the folder
ZERO_PORTS = ("--node-manager-port=0", "--object-manager-port=0", "--min-worker-port=0", "--max-worker-port=0",
              "--dashboard-agent-grpc-port=0", "--dashboard-agent-listen-port=0", "--metrics-export-port=0",
              "--runtime-env-agent-port=0")
START_TIMEOUT_S = 120.0  # Ray's start on a loaded node: seconds, not minutes
STOP_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def command(folder: Path | str, *args: str, ray: tuple[str, ...] = ("ray",)) -> list[str]:
    """`ray start --block` of a node whose files live in `folder`, with `args` (`--head --port=0 ...` or
    `--address=...`, resources). `ray`: how to run Ray's command line (in a container: its runtime first)."""
    return [*ray, "start", "--block", "--disable-usage-stats", *ZERO_PORTS, f"--temp-dir={folder}/{RAY_DIR}", *args]


def environment(folder: Path | str, marker: str, value: str) -> dict[str, str]:
    """What Ray's processes of the node in `folder` get in their environment, beside the caller's own."""
    return {"RAY_TMPDIR": str(folder), "TMPDIR": str(folder), "PYTHONSAFEPATH": "1", marker: value,
            **socket_polling()}


def socket_polling() -> dict[str, str]:
    """Ray's documented settings for how often its processes try a local socket that is not there yet: every
    50 ms, 200 times, where Ray's defaults are every 1000 ms, 10 times (the same 10 s in all). The raylet
    starts its object store in a thread and connects to it at once; the store binds a moment later, so with
    the defaults every Ray start slept a whole second there. A value the user set wins."""
    wanted = {"RAY_raylet_client_connect_timeout_milliseconds": "50", "RAY_raylet_client_num_connect_attempts": "200"}
    return {} if any(key in os.environ for key in wanted) else wanted


def address(folder: Path | str) -> str | None:
    """The GCS address `ray start` wrote into `folder` once every process of its node was up, if it has."""
    try:
        return (Path(folder) / RAY_DIR / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def free_port() -> int:
    """A port free now, for Ray's client server (which takes no 0): nothing of ours ever calls it,
    and a `ray start` whose client server cannot bind it (another process took it meanwhile) fails."""
    with socket.socket() as sock:
        sock.bind(("", 0))  # on every address: where the client server binds
        return sock.getsockname()[1]


@dataclass
class Node:
    """A Ray node this process started (`start`): its folder, its supervisor, its GCS address."""

    folder: Path
    supervisor: subprocess.Popen
    address: str


def start(folder: Path, args: list[str], env: dict[str, str], timeout_s: float = START_TIMEOUT_S) -> Node:
    """Start a Ray node in `folder` (`command` with `args`, in environment `env`) under a supervisor tied to this
    process (it stops the node when this process ends, killed or not), and wait until it is up. What Ray
    prints goes to `<folder>/ray-start.log`; a start that fails is a `RuntimeError` with its last lines, and
    leaves nothing running."""
    log = folder / "ray-start.log"
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        supervisor = subprocess.Popen(
            [sys.executable, "-P", "-m", "rayhpc.ray_start", str(os.getpid()), "--",
             *command(folder, *args, ray=(sys.executable, "-P", "-m", "ray.scripts.scripts"))],
            # in a session of its own: a terminal's Ctrl-C (SIGINT to the foreground group) stops the job, which
            # stops its Ray when it is done with it, not Ray under the job's last save
            env=env, cwd=folder, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    finally:
        os.close(out)
    node = Node(folder, supervisor, "")
    deadline = time.monotonic() + timeout_s
    while (found := address(folder)) is None:
        if supervisor.poll() is not None or time.monotonic() > deadline:
            stop(node)
            what = f"exited with status {supervisor.returncode}" if supervisor.returncode is not None else \
                f"was not up within {timeout_s:g} s"
            tail = log.read_text(errors="replace").strip().splitlines()[-8:]
            raise RuntimeError(f"ray start {what}; its log {log}: " + " | ".join(tail))
        time.sleep(0.02)
    node.address = found
    return node


def stop(node: Node, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop the node (its supervisor kills every process of it, the GCS last) and wait for it."""
    if node.supervisor.poll() is None:
        node.supervisor.terminate()
    try:
        node.supervisor.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        node.supervisor.kill()
        node.supervisor.wait()


def stop_tree(ray_start: int) -> list[int]:
    """Kill every process below this one, the GCS last and `ray start` (pid `ray_start`) after it; those left.
    `ray start`'s children die with it (Ray's parent-death signal), so it is held meanwhile: were it to end
    first, or to notice its raylet's end, it would stop the GCS before the rest."""
    with contextlib.suppress(OSError):
        os.kill(ray_start, signal.SIGSTOP)
    left = kill_gcs_last([pid for pid in descendants(os.getpid()) if pid != ray_start])
    left += kill([ray_start, *descendants(os.getpid())])
    collect_zombies()
    return left


def collect_zombies() -> None:
    """As a subreaper, orphans that die are ours to wait for."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(Exception):
    """Raised by `stop_on_signals`' handler, to leave a `wait()` at once."""


def _stop(signum, _frame):
    # only the first signal raises: a second one (Slurm's SIGTERM after a forwarded one, SIGHUP from a lost
    # srun) raised inside the `except` that handles the first would cut its clean-up short
    ignore_signals()
    raise Stop(signum)


def stop_on_signals() -> None:
    """From now on SIGTERM, SIGINT and SIGHUP raise `Stop` (once) in this process."""
    for signum in ENDING_SIGNALS:
        signal.signal(signum, _stop)


def ignore_signals() -> None:
    for signum in ENDING_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def supervisor() -> None:
    """This process is the child subreaper of what it starts: a process of Ray's that loses its parent becomes
    its child (and stays below it, for `stop_tree`)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def supervise(parent: int, argv: list[str]) -> int:
    """Run `argv` (a `ray start --block`) until it ends or this process is told to stop (SIGTERM, SIGINT,
    SIGHUP, or the end of process `parent`: its parent-death signal), then kill every process of it, GCS last.
    The child subreaper of what it starts: a process of Ray's that loses its parent becomes its child."""
    supervisor()
    proc = None
    try:
        stop_on_signals()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # it ended before the signal was armed
            return 1
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        return proc.wait()
    except Stop:
        return 0
    finally:
        ignore_signals()
        if proc is not None:
            stop_tree(proc.pid)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--" or not sys.argv[1].isdigit():
        print("usage: python -m rayhpc.ray_start PARENT_PID -- ray start --block ...", file=sys.stderr)
        sys.exit(2)
    sys.exit(supervise(int(sys.argv[1]), sys.argv[3:]))
