"""The warm starter's own process (`python -m rayhpc.up.starter`, started by `rayhpc up`): it imports the job
commands' modules once, then forks a child per command handed over (`rayhpc.up.warm`), which runs it as the
command's own process would (its files, folder, environment, arguments and exit status).

With `--workers`, the same for the Ray worker processes of the jobs on the cluster (`rayhpc.up.worker`): it
imports torch and the libraries Ray Tune and Ray Train load, but not Ray itself. Ray's core reads the job a
worker serves and its raylet's pid from the environment once, as it loads (the internal flags of its
`RayConfig`), and a worker forked from a process that had loaded Ray with other values aborts. So at a job's
first worker it forks a starter of that job's workers (`_job_starter`), which takes that worker's environment,
loads Ray, Ray Tune and Ray Train, and forks that worker and the job's next ones: 1 s of CPU less in each
(a training run starts 7). The libraries read their settings from the environment as they load, the
starter's; a worker whose environment sets any of them otherwise starts as a process of its own
(`warm.differing`)."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from rayhpc.slurm.private import write_private
from rayhpc.up import connection
from rayhpc.up.warm import COMMAND_SETTINGS, LOAD_SETTINGS, differing, fingerprint, peer_uid, receive, send
from rayhpc.up.worker import WORKER_EXTRAS

# what a Ray worker of a sweep or a training run imports, Ray excepted (see above): about 1.5 s of its 2.5 s;
# torch._dynamo: DistributedDataParallel(...) imports it (and sympy) as it is made, 0.9 s of each rank's start
# and the libraries Ray (and its Tune and Train) requires and imports as it loads, short of its own modules and
# grpc (whose C core is not safe to fork): in each of the 5-6 processes of a training run's start (its controller
# and other actors)
WORKER_MODULES = ("torch", "numpy", "pandas", "pyarrow", "rayhpc.tune.trainable", "rayhpc.engine.loop", "rayhpc.fsdp",
                  "torch._dynamo", "click", "fsspec", "google.protobuf.json_format", "jsonschema", "msgpack",
                  "requests")
# what the job commands import (rayhpc.cli imports each command's modules only when it runs)
MODULES = ("rayhpc.cli", "ray", "rayhpc.collectives.bench", *WORKER_MODULES)
# and Ray Tune and Ray Train (Ray Data and AIR with them), 0.5-0.6 s more of each command, loaded without
# seeding Ray core's generator of random IDs (`_class_ids_from_the_kernel`): seeded, every child forked after it
# draws the same IDs, and two commands started at once collided in Ray's own start-up check (its object store's
# warm-up object). `serve` checks that it stays unseeded.
RAY_LIBRARIES = ("ray.tune", "ray.train", "ray.train.torch")
# what a job's workers share and Ray, its libraries and gRPC's core read as they load: the job and its raylet's
# pid (RAY_JOB_ID, RAY_RAYLET_PID), the job's settings of Ray, Ray Tune and gRPC, its temp folder. Workers
# whose values are all the same share a starter of a job's workers (`_job_starter`)
JOB_SETTINGS = ("RAY_", "TUNE_", "GRPC_", "TMPDIR")
# a starter of a job's workers ends after this long with no worker to start or running (the job has ended)
JOB_STARTER_IDLE_S = 60.0


def serve(workers: bool = False, extras: tuple[str, ...] = WORKER_EXTRAS) -> None:
    """The starter's loop (`python -m rayhpc.up.starter [--workers [--extras A,B]]`): a child per request, its
    status back when it ends. `extras`: those of `WORKER_EXTRAS` a starter of workers loads where installed."""
    # as the libraries read them (some set their own as they load: torch its compile cache's folder)
    prefixes = LOAD_SETTINGS if workers else COMMAND_SETTINGS
    settings = {name: value for name, value in os.environ.items() if name.startswith(prefixes)}
    path = connection.workers_socket_path() if workers else connection.socket_path()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with starting(path):
        _load(workers, extras)
        ours = fingerprint()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))  # in the user's 0700 folder; the umask (077) makes it 0600
        listener.listen(16)
    print(f"rayhpc up: warm starter{' of workers' if workers else ''} on {path}", flush=True)
    # the starters of jobs' workers: our end of the channel to each (None: it failed, none again for that job)
    jobs: dict[tuple, socket.socket | None] | None = {} if workers else None

    def stop_jobs() -> None:  # each ends once its workers have ended
        for channel in filter(None, (jobs or {}).values()):
            channel.close()

    child = _loop(listener, lambda selector: _accept(listener, selector, ours, settings, prefixes, jobs), stop_jobs)
    if child is not None:  # in a forked child (a command, a worker, a job's starter): it ends the process
        child[0](*child[1:])


def _loop(source: socket.socket, take, on_stop=lambda: None, idle_s: float | None = None) -> tuple | None:
    """Serve the requests that come on `source` (`take(selector)`: start one's child and watch it) until told
    to stop (SIGTERM, or the end of `source`), or `idle_s` with no child running, and on until every running
    child's status is sent. In a forked child: what it runs and its arguments, nothing of the loop's left open."""
    selector = selectors.DefaultSelector()
    selector.register(source, selectors.EVENT_READ)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
    last = time.monotonic()
    while not stopping or any(key.fileobj is not source for key in selector.get_map().values()):
        if stopping and source.fileno() >= 0:  # those running end as `rayhpc down` tells them
            selector.unregister(source)
            source.close()
            on_stop()
        ready = selector.select(timeout=0.2)
        for key, _ in ready:
            if key.fileobj is not source:
                key.data(key.fileobj)
                continue
            try:
                child = take(selector)
            except EOFError:  # the starter that passed the requests has stopped
                stopping.append(0)
                continue
            if child is not None:  # in the forked child: nothing of the starter's stays open in it
                for other in list(selector.get_map().values()):
                    with contextlib.suppress(OSError):
                        other.fileobj.close() if hasattr(other.fileobj, "close") else os.close(other.fileobj)
                selector.close()
                return child
        if ready or len(selector.get_map()) > 1:
            last = time.monotonic()
        elif idle_s is not None and time.monotonic() - last > idle_s:
            stopping.append(0)
    return None


def _load(workers: bool, extras: tuple[str, ...]) -> None:
    """Import what the processes it starts import; SystemExit where forking them after that would not be safe."""
    import importlib.util

    installed = [name for name in extras if importlib.util.find_spec(name.split(".")[0])]
    for name in [*WORKER_MODULES, *installed] if workers else MODULES:
        importlib.import_module(name)
    if workers and "ray" in sys.modules:
        raise SystemExit(f"rayhpc up: warm starter of workers off: {[*WORKER_MODULES, *installed]} imported Ray")
    if not workers:
        _load_ray()
    _fork_safe()


def _load_ray() -> None:
    """Import Ray, Ray Tune and Ray Train, the latter two without seeding Ray core's generator of random IDs."""
    import importlib

    importlib.import_module("ray")
    with _class_ids_from_the_kernel():
        for name in RAY_LIBRARIES:
            importlib.import_module(name)


def _fork_safe() -> None:
    """SystemExit where children forked from this process would not be safe: an import started a thread, or
    seeded Ray core's generator of random IDs (every child would draw the same IDs)."""
    if threading.active_count() != 1:
        raise SystemExit(f"rayhpc up: warm starter off: importing the platform started threads "
                         f"({threading.enumerate()}); fork is not safe")
    if "ray" in sys.modules and len({_forked_random_id() for _ in range(2)}) != 2:
        raise SystemExit("rayhpc up: warm starter off: two children forked from it drew the same random Ray ID "
                         f"(a module of {RAY_LIBRARIES} seeded Ray core's generator); fork is not safe")


@contextlib.contextmanager
def starting(path: Path):
    """Inside: `path`'s `.starting` file names this process, which will listen on `path` (`warm.waiting_for`)."""
    flag = path.with_suffix(".starting")
    write_private(flag, str(os.getpid()))
    try:
        yield
    finally:
        flag.unlink(missing_ok=True)


@contextlib.contextmanager
def _class_ids_from_the_kernel():
    """While Ray Tune and Ray Train load: each class they make a Ray actor class as they load (`@ray.remote` at
    module level: Ray Data's memory tracer is the first) draws its ID from Ray core's generator of random IDs,
    which seeds it, once per process. Ray stores that ID and never reads it (`ray.actor`'s
    `ActorClassMetadata.class_id`), and has no public way to make an actor class without drawing one: for the
    imports' length only, `ray.actor`'s name for the ID class gives IDs drawn from the kernel instead."""
    import ray.actor

    real = ray.actor.ActorClassID

    class FromKernel:
        @staticmethod
        def from_random():
            return real(os.urandom(real.size()))

    ray.actor.ActorClassID = FromKernel
    try:
        yield
    finally:
        ray.actor.ActorClassID = real


def _forked_random_id() -> str:
    """A random Ray ID as a child forked from this process draws it (Ray's generator is per process, seeded on
    its first use: forked after that, children share it)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # whatever happens, the child never goes on as a second starter
            import ray

            os.write(write, ray.ObjectRef.from_random().hex().encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as drawn:
        return drawn.read()


def _accept(listener: socket.socket, selector: selectors.BaseSelector, ours: str, settings: dict[str, str],
            prefixes: tuple[str, ...], jobs: dict[tuple, socket.socket | None] | None):
    """Serve one request: fork its child and watch it, or (a starter of workers, `jobs`) pass it to its job's
    starter, forked for it where it has none. In a forked child: what it runs and its arguments."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        if peer_uid(conn) != os.getuid():
            raise OSError("another user")
        request, fds = receive(conn)
        if request is None or request.get("fingerprint") != ours or len(fds) != 3:
            send(conn, {"stale": True})
            raise OSError("not this code")
        other = differing(request["env"], settings, prefixes)
        if other:  # its own process loads them as it has them
            send(conn, {"settings": other})
            raise OSError("other settings")
    except OSError:
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    key = _job_key(request["env"]) if jobs is not None else None
    if key is not None and key not in jobs:
        child = _fork_job_starter(jobs, key, request["env"], selector)
        if child is not None:  # in the job's starter
            conn.close()
            for fd in fds:
                os.close(fd)
            return child
    channel = jobs.get(key) if key is not None else None
    if channel is not None and _pass(channel, request, fds, conn):
        return None
    return _fork(selector, conn, request, fds, _worker if jobs is not None else _child)


def _fork(selector: selectors.BaseSelector, conn: socket.socket, request: dict, fds: list[int], run):
    """Fork the request's child and watch it. In the child: `run` and its arguments."""
    pid = os.fork()
    if pid == 0:
        return run, request, fds, conn
    for fd in fds:  # the child has its copies
        os.close(fd)
    with contextlib.suppress(OSError):  # the requesting process gone: `_watch` ends the child
        send(conn, {"pid": pid})
    _watch(selector, conn, pid)
    return None


def _job_key(env: dict[str, str]) -> tuple | None:
    """What the workers one starter of a job's workers forks share (JOB_SETTINGS); None where Ray gave the worker
    no job or raylet."""
    if not env.get("RAY_JOB_ID") or not env.get("RAY_RAYLET_PID"):
        return None
    return tuple(sorted((name, value) for name, value in env.items() if name.startswith(JOB_SETTINGS)))


def _fork_job_starter(jobs: dict[tuple, socket.socket | None], key: tuple, env: dict[str, str],
                      selector: selectors.BaseSelector):
    """Fork the starter of the workers that share `key` (`jobs[key]`) and watch it; once one has failed (not
    ended idle), none again for them. In the forked starter: `_job_starter` and its arguments."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # a message per request
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        ours.close()
        for channel in filter(None, jobs.values()):  # they end when the starter of workers closes them
            channel.close()
        return _job_starter, theirs, env, parent
    theirs.close()
    ours.setblocking(False)  # a full queue: the worker is forked here instead (`_pass`)
    jobs[key] = ours
    pidfd = os.pidfd_open(pid)

    def ended(_fd) -> None:
        selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        ours.close()
        if os.waitstatus_to_exitcode(status) == 0:  # idle: another where the job comes back
            del jobs[key]
        else:
            jobs[key] = None

    selector.register(pidfd, selectors.EVENT_READ, ended)
    return None


def _pass(channel: socket.socket, request: dict, fds: list[int], conn: socket.socket) -> bool:
    """Pass the request, its files and its connection to its job's starter, which forks and watches the worker;
    False where that starter takes no more (ended, or its queue full)."""
    try:
        send(channel, request, [*fds, conn.fileno()])
    except OSError:
        return False
    for fd in fds:  # the job's starter has its copies
        os.close(fd)
    conn.close()
    return True


def _job_starter(channel: socket.socket, env: dict[str, str], parent: int) -> None:
    """The starter of one job's workers, forked by the starter of workers at the job's first worker: it takes
    that worker's environment, loads Ray, Ray Tune and Ray Train with it, as the worker would, and forks the
    workers passed to it (`_pass`) until the starter of workers stops, or for JOB_STARTER_IDLE_S no worker has
    come or run (the job has ended)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the starter of workers gone, this goes too
    if os.getppid() != parent:
        return
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    _load_ray()
    _fork_safe()
    child = _loop(channel, lambda selector: _take(channel, selector), idle_s=JOB_STARTER_IDLE_S)
    if child is not None:  # in a forked worker: it ends the process
        child[0](*child[1:])


def _take(channel: socket.socket, selector: selectors.BaseSelector):
    """In a job's starter: fork and watch the worker of the next request passed to it (`_pass`); EOFError where
    the starter of workers has stopped."""
    request, fds = receive(channel, max_fds=4)
    if request is None or len(fds) != 4:
        for fd in fds:
            os.close(fd)
        if request is None:
            raise EOFError
        return None
    conn = socket.socket(fileno=fds.pop())
    return _fork(selector, conn, request, fds, _worker)


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


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the requesting process's files (stdin, stdout, stderr), folder, environment,
    path and argv."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    if "ray" in sys.modules:  # loaded by the starter: what Ray's import does to the path (its bundled psutil)
        bundled = os.path.join(os.path.dirname(os.path.abspath(sys.modules["ray"].__file__)), "thirdparty_files")
        sys.path[:0] = [bundled] if bundled not in sys.path else []
    sys.argv[:] = request["sys_argv"]
    # a fork shares the starter's random state: Python's `random` reseeds itself in a forked child, numpy's
    # global generator (seeded once, as torch loaded it) does not, and two jobs' unseeded draws would be the same
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _child(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the command's process (its files, folder, environment, path, argv) and run
    it; its exit (status, exit handlers) is the command's own."""
    conn.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the command's own handlers come with it (run_main)
    _become(request, fds)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):  # buffered as Python buffers a terminal or a file
        stream.reconfigure(line_buffering=stream.isatty(), write_through=unbuffered)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rayhpc import cli
    from rayhpc.entry import run_main

    run_main(getattr(cli, request["main"]), request["argv"], warm=False)


class _ThreadsFollowOMP(type(os.environ)):
    """os.environ in a forked worker. Ray sets OMP_NUM_THREADS, its share of CPUs for a task, as it gives the
    worker one; torch reads it once, when it is loaded, which in a worker of its own comes after. Here torch
    was loaded before: its threads follow the variable as it is set."""

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        if key == "OMP_NUM_THREADS" and value.isdigit() and int(value) > 0:
            import torch

            torch.set_num_threads(int(value))


def _drop_lost_exit(unraisable) -> None:
    """`sys.unraisablehook` in a forked worker. Ray's SIGTERM handler (a worker Ray ends) raises SystemExit
    wherever the worker's main thread is; in a forked worker that was a weakref callback 3 times in 10 default
    sweeps (never in 10 with workers of their own), where Python cannot raise it and prints its traceback, which
    Ray forwarded to the user's terminal at the end of a sweep that went well. That SystemExit is dropped
    without a word (the worker goes on as it did when it was printed, until Ray kills it); anything else is
    printed as before."""
    if unraisable.exc_type is not SystemExit:
        sys.__unraisablehook__(unraisable)


def _worker(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the Ray worker process Ray started (`rayhpc.up.worker`: its files, folder,
    environment and arguments) and run Ray's worker script as its `__main__`."""
    import runpy

    conn.close()
    # Ray gives each worker a process group of its own and ends a worker by its group (killpg): in the
    # starter's group, the starter and the cluster's holder would go with it
    os.setsid()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    _become(request, fds)
    tempfile.tempdir = None  # read from the worker's TMPDIR, as in a process of its own
    sys.unraisablehook = _drop_lost_exit
    os.environ.__class__ = _ThreadsFollowOMP
    if "OMP_NUM_THREADS" in os.environ:
        os.environ["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


def main() -> None:
    """`python -m rayhpc.up.starter [--workers [--extras A,B]]`, started by the process that holds the cluster; it
    ends with that process."""
    import argparse
    import ctypes

    parser = argparse.ArgumentParser(prog="python -m rayhpc.up.starter")
    parser.add_argument("--workers", action="store_true", help="the starter of Ray workers")
    parser.add_argument("--extras", type=lambda names: tuple(filter(None, names.split(","))), default=WORKER_EXTRAS,
                        help=f"which of {','.join(WORKER_EXTRAS)} it loads where installed (default: all)")
    parser.add_argument("--parent", type=int, help="the pid of the process that starts it, which it ends with")
    args = parser.parse_args()

    os.umask(0o077)
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the cluster's holder gone, this goes too
    if args.parent is not None and os.getppid() != args.parent:  # it ended before that: no signal will come
        raise SystemExit(f"rayhpc up: warm starter off: the process that started it ({args.parent}) has ended")
    from rayhpc.slurm.private import private_tmpdir

    private_tmpdir()  # before torch is imported, as every command does
    serve(workers=args.workers, extras=args.extras)


if __name__ == "__main__":
    main()
