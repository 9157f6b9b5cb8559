"""The connection file of the user's own cluster on this machine: where it is, what it says, whether its
cluster is alive, and the jobs that joined it.

The file is trusted only where it is this user's (0600, in a 0700 folder of theirs): it names the address
every command sends its token to. A cluster is alive while the process that holds it runs (the same pid
*and* start time: a pid alone may be another process's later) and a socket of this user's listens on its
GCS port (/proc/net/tcp: another user cannot take over a port that went free). Both are read from /proc,
so a cluster that is gone is noticed at once, without a connection attempt and its time-out.
Standard library and psutil (`rayhpc.processes`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import socket
import sys
from importlib import metadata
from pathlib import Path

from rayhpc import processes
from rayhpc.monitor.startup import start_ticks
from rayhpc.private import UnsafePath, check_trusted, private_dir, write_private

log = logging.getLogger(__name__)
HOME_VARIABLE = "RAYHPC_HOME"
MARKER = "RAYHPC_UP"  # in the environment of every process of the cluster: `rayhpc down` finds them by it


def home() -> Path:
    """The user's rayhpc folder: RAYHPC_HOME, else ~/.rayhpc."""
    return Path(os.environ.get(HOME_VARIABLE) or Path.home() / ".rayhpc").expanduser()


def host() -> str:
    return socket.gethostname().split(".")[0]


def path() -> Path:
    """This machine's connection file (home directories are shared between a cluster's nodes)."""
    return home() / "clusters" / f"{host()}.json"


def log_path() -> Path:
    """What the process holding the cluster prints (its start, its stop)."""
    return path().with_suffix(".log")


def folder() -> Path:
    """The folder of the connection files, made private (0700) where missing; `UnsafePath` naming RAYHPC_HOME
    where another user could swap it or what is in it."""
    return _private(path().parent)


def jobs_dir() -> Path:
    """Where each job that joined the cluster leaves a file named `<pid>-<start ticks>` while it runs."""
    return _private(folder() / f"{host()}.jobs")


def _private(folder: Path) -> Path:
    try:
        return private_dir(folder)
    except UnsafePath as exc:
        where = HOME_VARIABLE if os.environ.get(HOME_VARIABLE) else f"~/.rayhpc ({HOME_VARIABLE})"
        raise UnsafePath(f"{where} {home()}: {exc}") from None


def read(file: Path | None = None) -> dict | None:
    """What the connection file says, or None where there is none. `UnsafePath` where it is not this
    user's alone (another user could name an address that collects the token)."""
    file = file or path()
    if not file.exists():
        return None
    check_trusted(file)
    if file.stat().st_mode & 0o077 or file.stat().st_uid != os.getuid():
        raise UnsafePath(f"{file} (mode {file.stat().st_mode & 0o777:04o}) is not yours alone: it is not used; "
                         f"remove it and run rayhpc up again")
    return json.loads(file.read_text())


def write(info: dict, file: Path | None = None) -> Path:
    file = file or path()
    folder()
    return write_private(file, json.dumps(info, indent=1) + "\n")


def listening_uids(port: int) -> set[int]:
    """The uids of the sockets listening on TCP `port` in this network namespace."""
    uids = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    uids.add(int(fields[7]))
    return uids


def process_alive(pid: int, ticks: int) -> bool:
    """Whether process `pid`, started at `ticks`, still runs as this user (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and start_ticks(pid) == ticks and os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def problem(info: dict) -> str | None:
    """Why the cluster of `info` cannot be joined (it is gone), or None where it is alive."""
    if not process_alive(info["pid"], info["pid_start"]):
        return f"its process {info['pid']} has ended"
    port = info["ports"]["gcs"]
    uids = listening_uids(port)
    if os.getuid() not in uids:
        return f"nothing of yours listens on its port {port}" + (f" (uid {sorted(uids)} does)" if uids else "")
    return None


def leftovers(marker: str) -> list[int]:
    """This user's processes that carry the cluster's marker, and everything below them (not this one)."""
    return processes.marked(f"{MARKER}={marker}")


def remove_remains(info: dict) -> list[int]:
    """What is left of the cluster of `info` once its process is gone (killed, say): its processes
    (killed; returned), its folders, its connection file."""
    left = leftovers(info["marker"])
    processes.kill_gcs_last(left)
    for folder in (info["temp_dir"], info["ray_tmpdir"]):
        shutil.rmtree(folder, ignore_errors=True)
    for file in (path(), log_path()):
        with contextlib.suppress(OSError):
            file.unlink()
    return left


class OtherEnvironment(Exception):
    """The user's cluster runs another Python environment than this process: a job's workers there would run
    the cluster's interpreter and packages, not this one's."""


def environment() -> dict[str, str | None]:
    """What a job's workers on the cluster run with: this Python environment, its version, and the versions of
    the platform (and where it is imported from), Ray and torch, as installed (no import)."""
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"prefix": os.path.realpath(sys.prefix), "python": ".".join(map(str, sys.version_info[:3])),
            "rayhpc": version("rayhpc"), "rayhpc_at": str(Path(__file__).resolve().parents[1]),
            "ray": version("ray"), "torch": version("torch")}


def describe_environment(env: dict | None) -> str:
    if not env:
        return "unknown (a cluster started by an earlier rayhpc)"
    return (f"Python {env['python']} in {env['prefix']}, rayhpc {env['rayhpc']} from {env['rayhpc_at']}, "
            f"ray {env['ray']}, torch {env['torch']}")


def other_environment(info: dict) -> str | None:
    """Why a job of this process may not join the cluster of `info` (its environment is another), or None."""
    theirs, ours = info.get("environment"), environment()
    if theirs == ours:
        return None
    rayhpc = f"{shlex.quote(sys.executable)} -m rayhpc"
    command = f"{rayhpc} down && {rayhpc} up"
    return (f"your cluster (rayhpc up, {path()}) runs {describe_environment(theirs)}; this command runs "
            f"{describe_environment(ours)}: its workers would run the cluster's Python and packages, not this "
            f"one's. Start one from this environment ({command}), or join it anyway with "
            f"RAY_AUTH_TOKEN_PATH={info['token_path']} and --address {info['address']}")


def find(same_environment: bool = True) -> tuple[str, Path] | None:
    """The address of the user's cluster on this machine and its token file, where it is up; None otherwise.
    A connection file whose cluster is gone is removed, with one line saying so. The token file is the
    cluster's own (in its private folder); `UnsafePath` where another user could have put or changed it;
    `OtherEnvironment` where the cluster runs another environment than this process (`same_environment`)."""
    file = path()
    info = read(file)
    if info is None:
        return None
    why = problem(info)
    if why is not None:
        log.info(f"ray: the cluster of `rayhpc up` in {file} is gone ({why}); this job starts a Ray of its own")
        remove_remains(info)
        return None
    if same_environment and (other := other_environment(info)) is not None:
        raise OtherEnvironment(other)
    token = Path(info["token_path"])
    check_trusted(token)
    return info["address"], token


def register_job() -> Path:
    """This process as a job of the cluster, until it exits: `rayhpc down` stops it first (SIGTERM, as
    scancel does), so that it saves its checkpoints and results and says that the cluster went away."""
    entry = jobs_dir() / f"{os.getpid()}-{start_ticks()}"
    write_private(entry, "")
    return entry


def jobs() -> list[int]:
    """The pids of the jobs on the cluster that still run (stale entries are removed)."""
    try:
        entries = list(jobs_dir().iterdir())
    except (OSError, UnsafePath):
        return []
    pids = []
    for entry in entries:
        pid, _, ticks = entry.name.partition("-")
        if pid.isdigit() and ticks.isdigit() and process_alive(int(pid), int(ticks)):
            pids.append(int(pid))
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    return pids
