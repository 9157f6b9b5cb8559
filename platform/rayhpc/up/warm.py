"""The warm starter of the user's cluster, the command's side: one interpreter that has imported the platform,
torch and Ray once (`rayhpc.up.starter`) forks a child for each job command run on this machine while the
cluster is up.

A command otherwise spends about 2 s importing torch, Ray Tune and Ray Train before its first line. With the
cluster up, `run_main` hands the command over instead (`run`): its arguments, environment, working folder,
`sys.path`, and its stdin, stdout and stderr themselves (passed over a Unix socket, SCM_RIGHTS). The child
runs the command exactly as the process would have, writing to the user's terminal; the command's process
waits for its exit status and exits with it, and passes on every stop signal it gets (Ctrl-C, SIGTERM,
SIGUSR1, SIGHUP), so Ctrl-C, scancel and `rayhpc down` stop the job as before. A command whose process ends
meanwhile (killed) ends its child too (SIGTERM).

Only where the starter runs this very code, from this very Python (`fingerprint`): after an upgrade or an edit
of the platform the command runs in its own process, saying so once. The socket is in the user's 0700
folder, and the starter serves only its own user (SO_PEERCRED). The starter never connects to Ray: fork is
safe only in a process without threads, which importing these modules does not start (checked).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from rayhpc.slurm.private import UnsafePath
from rayhpc.up import connection

log = logging.getLogger(__name__)

# the settings the libraries a starter of workers loads read from the environment as they load (`differing`):
# torch, its compiler and its C libraries (OpenMP, MKL, OpenBLAS), sympy and mpmath (torch._dynamo's), Hugging
# Face's caches and switches, and those of Ray's libraries (protobuf's implementation, fsspec's configuration,
# msgpack's pure-Python switch)
LOAD_SETTINGS = ("TORCH", "PYTORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "SYMPY_", "MPMATH_", "HF_",
                 "HUGGINGFACE_", "TRANSFORMERS_", "XDG_CACHE_HOME", "PROTOCOL_BUFFERS_", "FSSPEC_", "MSGPACK_")
# what Ray Data, Ray Tune and AIR read from the environment as they load (Ray Data's defaults, mostly): a
# command that sets them otherwise runs in a process of its own
COMMAND_SETTINGS = ("RAY_DATA_", "TUNE_", "RAY_AIR_")
# a worker's own by design: Ray's CPU share for its task, which torch follows in the child (_ThreadsFollowOMP)
OWN_SETTINGS = frozenset({"OMP_NUM_THREADS"})
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
MAX_REQUEST = 1 << 20


def fingerprint() -> str:
    """This Python and the platform's code as installed (every module file's path, size and mtime)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*.py"))
    return hashlib.sha256(json.dumps([sys.executable, sys.version, files]).encode()).hexdigest()


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        conn.sendall(data)


def receive(conn: socket.socket, max_fds: int = 3) -> tuple[dict | None, list[int]]:
    """One message (a JSON line) and the file descriptors that came with it; None at the end of the stream. Read
    whole at once where it fits: a message socket (SOCK_SEQPACKET) would drop the rest."""
    data, fds = b"", []
    while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
        chunk, ancillary, _, _ = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(max_fds * array.array("i").itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", payload[:len(payload) - len(payload) % 4]).tolist()
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


def run(main: str, argv) -> int | None:
    """Run the command `main(argv)` in the warm starter of the user's cluster; its exit status, or None where
    there is no starter (or not one of this code): the caller then runs it itself."""
    if os.environ.get("RAY_ADDRESS"):  # a cluster named otherwise: a process of its own
        return None
    try:  # a cluster of another environment: the job, in its own process, says so as it looks for a cluster
        info = connection.read()
    except (OSError, ValueError, UnsafePath):
        return None
    if info is None or connection.other_environment(info) is not None:
        return None
    return hand_over(connection.socket_path(), {"main": main, "argv": argv, "sys_argv": sys.argv})


def waiting_for(path: Path, timeout_s: float = 60.0) -> None:
    """Return once a starter listens on `path`, or none is starting there (`starter.starting`), or after
    `timeout_s`. A worker Ray starts while the starter of its cluster imports is forked sooner than it would
    import itself: the starter began first (`cluster.own_warm_workers`: before Ray)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        try:
            os.kill(int(path.with_suffix(".starting").read_text()), 0)
        except (OSError, ValueError):  # none starting, or it ended
            return
        time.sleep(0.05)


def hand_over(path: Path, request: dict, sys_path: list[str] | None = None) -> int | None:
    """This process's `request` run by the starter listening on `path`, in a child with this process's files,
    folder, environment and `sys_path` (else its own); the child's exit status, or None where there is no
    starter there (or not one of this code)."""
    if not path.exists():
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        if peer_uid(conn) != os.getuid():
            raise OSError("not this user's")
        send(conn, {**request, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys_path or sys.path,
                    "fingerprint": fingerprint()}, [0, 1, 2])
        reply, _ = receive(conn)
    except OSError:  # gone meanwhile: this process runs the command
        conn.close()
        return None
    if reply is None or "pid" not in reply:
        if reply and reply.get("settings"):
            log.info("rayhpc: %s set otherwise than when `rayhpc up` started its warm starter: this process loads "
                     "its libraries itself", ", ".join(reply["settings"]))
        if reply and reply.get("stale"):
            log.info("rayhpc: your cluster's warm starter runs other code than this command (an upgrade or an edit "
                     "since `rayhpc up`): the command runs in its own process; rayhpc down && rayhpc up to refresh")
        conn.close()
        return None
    return _wait(conn, reply["pid"])


def _wait(conn: socket.socket, pid: int) -> int:
    """Pass this process's stop signals on to the command's child until its exit status comes."""
    def forward(signum, _frame):
        with contextlib.suppress(OSError):
            os.kill(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    reply, _ = receive(conn)  # a signal handler runs meanwhile; the call resumes after it (PEP 475)
    conn.close()
    return 1 if reply is None else int(reply["status"])


def differing(env: dict[str, str], settings: dict[str, str], prefixes: tuple[str, ...] = LOAD_SETTINGS) -> list[str]:
    """The libraries' settings (those named by `prefixes`: LOAD_SETTINGS, or the starter of commands'
    COMMAND_SETTINGS) that `env` sets otherwise than the starter's environment did as it loaded them
    (`settings`)."""
    names = {name for name in (*env, *settings) if name.startswith(prefixes)} - OWN_SETTINGS
    return sorted(name for name in names if env.get(name) != settings.get(name))
