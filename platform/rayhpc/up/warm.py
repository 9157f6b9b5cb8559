"""The warm starter of the user's cluster: one interpreter that has imported the platform, torch and Ray once,
and forks a child for each job command run on this machine while the cluster is up.

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
import selectors
import signal
import socket
import struct
import sys
import threading
from pathlib import Path

from rayhpc.up import connection

log = logging.getLogger(__name__)
# what the job commands import (rayhpc.cli imports each command's modules only when it runs)
MODULES = ("rayhpc.cli", "rayhpc.tune.sweep", "rayhpc.train.trainer", "rayhpc.parallel.trainer", "rayhpc.ps.driver",
           "rayhpc.collectives.bench", "rayhpc.scaling.study")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
MAX_REQUEST = 1 << 20


def fingerprint() -> str:
    """This Python and the platform's code as installed (every module file's path, size and mtime)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*.py"))
    return hashlib.sha256(json.dumps([sys.executable, sys.version, files]).encode()).hexdigest()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        conn.sendall(data)


def _receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """One message (a JSON line) and the file descriptors that came with it; None at the end of the stream."""
    data, fds = b"", []
    while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
        chunk, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * array.array("i").itemsize))
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
    path = connection.socket_path()
    if not path.exists() or os.environ.get("RAY_ADDRESS"):  # a cluster named otherwise: a process of its own
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        if _peer_uid(conn) != os.getuid():
            raise OSError("not this user's")
        _send(conn, {"main": main, "argv": argv, "sys_argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
                     "path": sys.path, "fingerprint": fingerprint()}, [0, 1, 2])
        reply, _ = _receive(conn)
    except OSError:  # gone meanwhile: this process runs the command
        conn.close()
        return None
    if reply is None or "pid" not in reply:
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
    reply, _ = _receive(conn)  # a signal handler runs meanwhile; the call resumes after it (PEP 475)
    conn.close()
    return 1 if reply is None else int(reply["status"])


def serve() -> None:
    """The starter's loop (`python -m rayhpc.up.warm`): a child per request, its status back when it ends."""
    import importlib

    for name in MODULES:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise SystemExit(f"rayhpc up: warm starter off: importing the platform started threads "
                         f"({threading.enumerate()}); fork is not safe")
    ours = fingerprint()
    path = connection.socket_path()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))  # in the user's 0700 folder; the umask (077) makes it 0600
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    print(f"rayhpc up: warm starter on {path}", flush=True)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    # once told to stop (SIGTERM): no new command, and on until every running command's status is sent
    while not stopping or any(key.fileobj is not listener for key in selector.get_map().values()):
        if stopping and listener.fileno() >= 0:  # those running end as `rayhpc down` tells them
            selector.unregister(listener)
            listener.close()
        for key, _ in selector.select(timeout=0.2):
            if key.fileobj is not listener:
                key.data(key.fileobj)
                continue
            child = _accept(listener, selector, ours)
            if child is not None:  # in the forked child: nothing of the starter's stays open in it
                for other in list(selector.get_map().values()):
                    with contextlib.suppress(OSError):
                        other.fileobj.close() if hasattr(other.fileobj, "close") else os.close(other.fileobj)
                selector.close()
                _child(*child)  # ends the process (the command's exit)


def _accept(listener: socket.socket, selector: selectors.BaseSelector, ours: str):
    """Serve one request: fork its child and watch it. In the child: (request, fds, connection)."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        if _peer_uid(conn) != os.getuid():
            raise OSError("another user")
        request, fds = _receive(conn)
        if request is None or request.get("fingerprint") != ours or len(fds) != 3:
            _send(conn, {"stale": True})
            raise OSError("not this code")
        pid = os.fork()
        if pid == 0:
            return request, fds, conn
        _send(conn, {"pid": pid})
    except OSError:
        conn.close()
        pid = None
    for fd in fds:  # the child has its copies
        os.close(fd)
    if pid is not None:
        _watch(selector, conn, pid)
    return None


def _watch(selector: selectors.BaseSelector, conn: socket.socket, pid: int) -> None:
    """The child's status to the command's process when it exits; SIGTERM to it if that process ends first."""
    pidfd = os.pidfd_open(pid)

    def ended(_fd) -> None:
        selector.unregister(pidfd)
        with contextlib.suppress(KeyError):
            selector.unregister(conn)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N, which a shell reports as 128 + N
        with contextlib.suppress(OSError):
            _send(conn, {"status": code if code >= 0 else 128 - code})
        conn.close()

    def hung_up(_conn) -> None:
        if not conn.recv(1):  # the command's process ended (killed): the job stops as on SIGTERM
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            selector.unregister(conn)

    selector.register(pidfd, selectors.EVENT_READ, ended)
    selector.register(conn, selectors.EVENT_READ, hung_up)


def _child(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the command's process (its files, folder, environment, path, argv) and run
    it; its exit (status, exit handlers) is the command's own."""
    conn.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the command's own handlers come with it (run_main)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    sys.argv[:] = request["sys_argv"]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):  # buffered as Python buffers a terminal or a file
        stream.reconfigure(line_buffering=stream.isatty(), write_through=unbuffered)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rayhpc import cli

    cli.run_main(getattr(cli, request["main"]), request["argv"], warm=False)


def main() -> None:
    """`python -m rayhpc.up.warm`, started by the process that holds the cluster; it ends with that process."""
    import ctypes

    os.umask(0o077)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the cluster's holder gone, this goes too
    from rayhpc.slurm.private import private_tmpdir

    private_tmpdir()  # before torch is imported, as every command does
    serve()


if __name__ == "__main__":
    main()
