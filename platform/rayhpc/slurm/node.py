"""One Ray node of a Slurm job, and the clean-up that finds every process the job started.

    python -m rayhpc.slurm.node run JOB_DIR -- [--head --port=0 ... | --address=...]  # per node, under srun
    python -m rayhpc.slurm.node reap JOB [JOB_DIR]                                  # per node, at the end

Ray rewrites its processes' titles (`ray::IDLE`) and some of them outlive their parents, so neither
command lines nor the process tree alone find them all. `run` starts Ray as every node the platform starts
(`rayhpc.ray_start.command`, in its `environment`: the container of RAYHPC_CONTAINER first, where set), with
`RAYHPC_RAY_NODE=<job>:<node>` (the sbatch startup starts the user's command with
`RAYHPC_COMMAND=<job>`), every process Ray forks inherits it, and `reap` kills this user's processes
that carry it *and* the job's `SLURM_JOB_ID`: a job submitted from inside the command inherits the
marker (sbatch exports the environment), but Slurm gives its processes their own job id, so they live
on when this job ends. A retitled process (setproctitle) may show a clobbered start of its
environment in /proc, marker included, so `reap` also kills every process below a marked one, and
`run` is the child subreaper of what it starts: processes that lose their parent become its
children (staying in the Slurm step, where Slurm's own tracking finds them too), and its own
clean-up kills everything below it.

Ray's temp dir (sockets, logs, object spilling) lives in a folder made by `mkdtemp` (0700, random
name, created exclusively) in node-local /tmp: Ray makes its own folders 0777, and inside this one
no other user can reach them. It is `<folder>/ray`, where Ray looks by default in processes whose
RAY_TMPDIR is that folder (all of this node's Ray): its state API in a worker finds this cluster there
(`ray_current_cluster`, written by `ray start` once the node is up), never another user's. Ray's
processes import nothing from their working folder (PYTHONSAFEPATH: `python -m` and `-c`, which Ray and
its workers use, would put it first on `sys.path`, and the submit folder may be anyone's to write).
Standard library and psutil (`rayhpc.processes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayhpc.private import OWN_TMPDIR_BASE, write_private
from rayhpc.processes import marked
from rayhpc.ray_start import (
    RAY_DIR,
    Stop,
    collect_zombies,
    command,
    environment,
    ignore_signals,
    stop_on_signals,
    stop_tree,
    supervisor,
)
from rayhpc.slurm.layout import node_ip

NODE_MARKER, COMMAND_MARKER = "RAYHPC_RAY_NODE", "RAYHPC_COMMAND"
TEMP_PREFIX = "rh-{job}-"  # short: Ray's socket paths under it must stay below 107 bytes


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def job_processes(job: str, markers: list[str], subreaper: bool = False) -> list[int]:
    """The processes of `job` that carry one of `markers` and every process below them; with `subreaper`
    (this process is the node's `run`: orphans of what it started become its children), everything below it."""
    return marked(*markers, job=job, below=(os.getpid(),) if subreaper else ())


def reap(job: str, markers: list[str], subreaper: bool = False, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process of `job` (`job_processes`) until none is left; the pids still there after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (pids := job_processes(job, markers, subreaper)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if subreaper:  # otherwise the dead are their parents' to wait for (a caller's own children included)
            collect_zombies()
        time.sleep(0.1)
    return pids


def temp_base() -> str:
    """Where Ray's temp folders go: node-local /tmp, or RAYHPC_TMPDIR."""
    return os.environ.get("RAYHPC_TMPDIR", "/tmp")


def remove_temp_roots(job: str) -> list[str]:
    """Remove this user's Ray temp folders of `job` (never through a link); the ones left."""
    left = []
    for entry in Path(temp_base()).glob(TEMP_PREFIX.format(job=job) + "*"):
        st = entry.lstat()
        if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode):
            continue  # someone else's, or a link: not ours to remove
        shutil.rmtree(entry, ignore_errors=True)
        if entry.exists():
            left.append(str(entry))
    return left


def secrets_of(job: str, job_dir: Path) -> list[Path]:
    """The job's token, connection file and Prometheus targets: they go when its Ray does."""
    return [job_dir / "auth_token", job_dir / "cluster.json", job_dir.parent / "prometheus" / f"{job}.json"]


def remove_stale(log_dir: Path) -> None:
    """Remove what this user's jobs no longer in the queue left: temp folders on this node, from a node lost
    mid-job (nothing ran its clean-up), and secrets in `log_dir`, where every node of a job was killed before
    its clean-up ran; when Slurm cannot be asked, nothing."""
    proc = subprocess.run(["squeue", "-h", "-u", str(os.getuid()), "-o", "%A"], capture_output=True, text=True)
    if proc.returncode:
        return
    live = set(proc.stdout.split())
    for job in {entry.name.split("-")[1] for entry in Path(temp_base()).glob(TEMP_PREFIX.format(job="*") + "*")}:
        if job.isdigit() and job not in live:
            remove_temp_roots(job)
    for token in log_dir.glob("*/auth_token"):
        job = token.parent.name  # only jobs whose Ray ran on this node: a log folder shared by two Slurm
        ran_here = (token.parent / "nodes" / f"{node_name()}.ray.json").exists()  # clusters holds both's jobs
        if job.isdigit() and job not in live and job != os.environ.get("SLURM_JOB_ID") and ran_here:
            for path in secrets_of(job, token.parent):
                path.unlink(missing_ok=True)


def report(job_dir: Path | None, name: str, data: dict) -> None:
    if job_dir is not None:
        (job_dir / "nodes").mkdir(mode=0o700, exist_ok=True)
        write_private(job_dir / "nodes" / f"{node_name()}.{name}.json", json.dumps(data) + "\n")


def node_records(job_dir: Path, hosts: list[str]) -> dict[str, dict]:
    """What each node's `run` wrote when it started Ray (`report(..., "ray", ...)`: address, temp dir)."""
    out = {}
    for host in hosts:
        path = job_dir / "nodes" / f"{host}.ray.json"
        if path.is_file():
            out[host] = json.loads(path.read_text())
    return out


def clean_up(job: str, job_dir: Path | None, root: str | None = None) -> dict:
    """Reap this node's Ray processes of `job` and remove its temp folder `root`; at the job's end
    (`root` None) also the command's processes and every temp folder of the job (where nodes share
    /tmp, one node's Ray ending early must not take another's). Reports what was left."""
    markers = [f"{NODE_MARKER}={job}:{node_name()}"] + ([f"{COMMAND_MARKER}={job}"] if root is None else [])
    left = reap(job, markers, subreaper=root is not None)  # `root`: called by `run`, the subreaper
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
    dirs = ([root] if os.path.exists(root) else []) if root is not None else remove_temp_roots(job)
    out = {"node": node_name(), "left_pids": left, "left_dirs": dirs, "time": time.time()}
    report(job_dir, "cleanup", out)
    return out


# a line Ray's C++ processes log as they abort: "[2026-11-27 03:12:45,980 C 2661 2661] (raylet) file.cc:33: ..."
FATAL = re.compile(r"^\[[-\d :,.]+ [CF] \d+ \d+\]")


def fatal_lines(root: Path) -> list[str]:
    """The check that failed, for each of this node's Ray processes that aborted (`ray start` shows only the
    last 20 lines of a dead raylet's log, its stack, and the folder holding the rest is removed at clean-up)."""
    found = []
    # session_latest is a link to the session: each log once
    for log in sorted({path.resolve() for path in root.glob(f"{RAY_DIR}/session_*/logs/*.out")}):
        with contextlib.suppress(OSError):
            found += [f"{log.name}: {line[:500]}" for line in log.read_text(errors="replace").splitlines()
                      if FATAL.match(line)]
    return found[-10:]


def _say(line: str) -> None:
    """A line to the job's log; the srun that carries it may be gone with a lost head node, which must not
    keep this node from cleaning up."""
    with contextlib.suppress(OSError):
        print(f"rayhpc: {node_name()}: {line}", flush=True)


# Ray's raylet waits a fixed 15 s (not configurable) for its dashboard agent's port files, then aborts; on a
# loaded node the agent's imports alone can take longer, and the node never joins. A worker node whose raylet
# aborted so is started again (the head is not: the nodes that joined it would go with it)
AGENT_TIMED_OUT, AGENT_RETRIES = "Timed out waiting for file", 3


def _ray_node(job: str, command: list[str], env: dict, root: Path, retries: int) -> tuple[int, bool]:
    """Run `ray start --block` (again, up to `retries` times, where its raylet gave up on a slow agent);
    its exit code, and whether the job is ending (SIGTERM, SIGINT or SIGHUP to this process)."""
    code, ending, proc = 0, False, None
    try:
        stop_on_signals()
        for attempt in range(retries + 1):
            proc = subprocess.Popen(command, env=env)
            code = proc.wait()
            fatal = fatal_lines(root) if code else []
            for line in fatal:
                _say(line)
            if attempt == retries or not any(AGENT_TIMED_OUT in line for line in fatal):
                break
            _say(f"Ray's agent took longer than the raylet waits for it (a loaded node): starting the node's Ray "
                 f"again ({attempt + 2} of {retries + 1})")
            reap(job, [f"{NODE_MARKER}={job}:{node_name()}"], subreaper=True)
            for session in root.glob(f"{RAY_DIR}/session_*"):  # the aborted start's logs are read: the next's are new
                shutil.rmtree(session, ignore_errors=True)
        ignore_signals()  # inside the `try`: a signal before this loop ends still counts
    except Stop:
        # the job is ending (Slurm gives KillWait, 10-30 s, before SIGKILL): no graceful drain, which
        # `ray start` would spend up to 30 s on; every process of this node's Ray is killed, the GCS last (the
        # caller's clean-up then kills whatever of the job is left)
        code, ending = 0, True
        if proc is not None:
            stop_tree(proc.pid)
    return code, ending


def run(job_dir: Path, args: list[str]) -> int:
    """Run this node's Ray (`ray start --block` with `args`, `--head ...` or `--address=...`), with its temp dir,
    address, CPUs and GPUs, and clean up after it, whether it ends by itself or by SIGTERM (scancel, the job's
    end)."""
    job = os.environ["SLURM_JOB_ID"]
    supervisor()
    root = tempfile.mkdtemp(prefix=TEMP_PREFIX.format(job=job), dir=temp_base())
    head = "--head" in args
    ip = node_ip(os.environ.get("RAYHPC_HEAD_IP") if head else None)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE") or "1"
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "0")
    store = os.environ.get("RAYHPC_OBJECT_STORE_BYTES")
    ray = (*shlex.split(os.environ.get("RAYHPC_CONTAINER", "")), "ray")  # inside the container, where there is one
    argv = command(root, *args, f"--node-ip-address={ip}", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
                   *([f"--object-store-memory={store}"] if store else []), ray=ray)
    # TMPDIR and RAY_TMPDIR for Ray and every worker it starts: this node's private folder, not /tmp, where
    # another user may make torch's compile caches or Ray's lock folder first (rayhpc.private.private_tmpdir);
    # the node's tmp for the compile caches every job of the user shares once checked (private_compile_caches)
    env = {**os.environ, **environment(root, NODE_MARKER, f"{job}:{node_name()}"), OWN_TMPDIR_BASE: temp_base()}
    report(job_dir, "ray", {"node": node_name(), "ip": ip, "temp_dir": f"{root}/{RAY_DIR}", "pid": os.getpid()})
    remove_stale(job_dir.parent)
    code, ending = _ray_node(job, argv, env, Path(root), retries=0 if head else AGENT_RETRIES)
    secrets = head or ending or head_gone(os.environ.get("RAY_ADDRESS", ""))
    if secrets:
        # the job's secrets and targets go with its head, and with every node when the job ends or its head is
        # gone: after a lost head node (the batch script died with it) the nodes that survive remove them.
        # Before the reap, which a loaded node may not finish within Slurm's KillWait (then SIGKILL)
        for path in secrets_of(job, job_dir):
            path.unlink(missing_ok=True)
    report(job_dir, "ended", {"node": node_name(), "code": code, "signalled": ending, "secrets_removed": secrets})
    clean_up(job, job_dir, root)
    return code


def head_gone(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the head's GCS port `address` (host:port) takes no connection within `timeout_s` (refused, no
    route, no answer: a lost head node gives any of them). A worker node whose Ray ended by itself keeps the
    job's token while the head runs on, and where it cannot tell (an address it cannot read, another user's
    socket on the freed port); the token stays 0600 either way."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return True
    return False


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"] and "--" in argv:
        return run(Path(argv[1]), argv[argv.index("--") + 1:])
    if argv[:1] == ["reap"] and len(argv) in (2, 3):
        out = clean_up(argv[1], Path(argv[2]) if len(argv) == 3 else None)
        print(f"{out['node']}: {len(out['left_pids'])} process(es) left {out['left_pids'] or ''}, "
              f"{len(out['left_dirs'])} temp folder(s) left {out['left_dirs'] or ''}".rstrip(), flush=True)
        return 1 if out["left_pids"] or out["left_dirs"] else 0
    print("usage: python -m rayhpc.slurm.node run JOB_DIR -- RAY_START_ARGS... | reap JOB [JOB_DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
