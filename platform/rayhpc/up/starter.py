"""The warm starter's own process (`python -m rayhpc.up.starter`, started by `rayhpc up`): it imports the job
commands' modules once, then forks a child per command handed over (`rayhpc.up.warm`), which runs it as the
command's own process would (its files, folder, environment, arguments and exit status)."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import threading

from rayhpc.up import connection
from rayhpc.up.warm import fingerprint, peer_uid, receive, send

# what the job commands import (rayhpc.cli imports each command's modules only when it runs)
MODULES = ("rayhpc.cli", "rayhpc.tune.sweep", "rayhpc.train.trainer", "rayhpc.parallel.trainer", "rayhpc.ps.driver",
           "rayhpc.collectives.bench", "rayhpc.scaling.study")


def serve() -> None:
    """The starter's loop (`python -m rayhpc.up.starter`): a child per request, its status back when it ends."""
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
        if peer_uid(conn) != os.getuid():
            raise OSError("another user")
        request, fds = receive(conn)
        if request is None or request.get("fingerprint") != ours or len(fds) != 3:
            send(conn, {"stale": True})
            raise OSError("not this code")
        pid = os.fork()
        if pid == 0:
            return request, fds, conn
        send(conn, {"pid": pid})
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
            send(conn, {"status": code if code >= 0 else 128 - code})
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
    from rayhpc.entry import run_main

    run_main(getattr(cli, request["main"]), request["argv"], warm=False)


def main() -> None:
    """`python -m rayhpc.up.starter`, started by the process that holds the cluster; it ends with that process."""
    import ctypes

    os.umask(0o077)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the cluster's holder gone, this goes too
    from rayhpc.slurm.private import private_tmpdir

    private_tmpdir()  # before torch is imported, as every command does
    serve()


if __name__ == "__main__":
    main()
