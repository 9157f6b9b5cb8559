"""`rayhpc submit` and `rayhpc status`: render and submit the sbatch script; list the platform's jobs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from rayhpc.config import ConfigError
from rayhpc.private import UnsafePath, check_trusted, log_folder
from rayhpc.slurm.config import ClusterConfig
from rayhpc.slurm.render import render_sbatch


def sbatch(args: list[str], *, script: str | None = None, env: dict | None = None) -> str:
    """The one way the platform submits: `sbatch --parsable ARGS` (the script as a file in ARGS, on
    stdin as `script`, or `--wrap`); returns the job id, or raises a one-line `ConfigError`."""
    proc = subprocess.run(["sbatch", "--parsable", *args], input=script, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise ConfigError(f"sbatch {' '.join(args)}: {proc.stderr.strip() or 'failed'}".splitlines()[0])
    return proc.stdout.strip().split(";")[0]


def log_dir(cfg: ClusterConfig) -> Path:
    """The cluster's log folder, made if missing. One another user controls, or may create files in (sticky
    or not: Slurm appends each job's output to `<log_dir>/%x-%j.log`, a name they could create first as a
    FIFO or a file of theirs) is a one-line error."""
    try:
        return log_folder(cfg.log_dir)
    except (UnsafePath, OSError) as exc:
        raise ConfigError(f"log_dir {cfg.log_dir}: {exc}") from None


def submit(cfg: ClusterConfig, command: list[str], *, nodes: int | None = None, dry_run: bool = False) -> str:
    """Submit `command` on a Ray cluster of `cfg`'s shape; returns the job id (or the script, dry)."""
    if not command:
        raise ConfigError("command: nothing to run; put it after --, e.g. -- python -u jobs/tune_mlp.py")
    text = render_sbatch(cfg, command, nodes=nodes)
    if dry_run:
        return text
    log_dir(cfg)  # Slurm does not create the --output folder
    return sbatch([], script=text)  # on stdin: no file of a predictable name that someone could have made first


def jobs() -> list[dict]:
    """The platform's jobs in the queue (job names rayhpc-*), with head node and dashboard address."""
    # the name last: it is the one field a user chooses, and may hold the separator
    proc = subprocess.run(["squeue", "-h", "-o", "%i|%T|%N|%M|%j"], capture_output=True, text=True)
    if proc.returncode:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise ConfigError(f"squeue failed (exit {proc.returncode}): {why}")
    out = proc.stdout
    rows = []
    for line in out.splitlines():
        job_id, state, nodelist, elapsed, name = line.split("|", 4)
        if not name.startswith("rayhpc-"):
            continue
        info = cluster_info(job_id)
        rows.append({"job": job_id, "name": name, "state": state, "nodes": nodelist or "-", "elapsed": elapsed,
                     "head": info.get("head", "-"), "dashboard": info.get("dashboard", "-")})
    return rows


def slurm_job(job_id: str) -> dict[str, str]:
    """`scontrol show job` fields of `job_id`; empty once Slurm has forgotten it."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(part.split("=", 1) for part in out.split() if "=" in part)


def job_dir(job_id: str, fields: dict[str, str] | None = None) -> Path | None:
    """The job's private folder `<log_dir>/<job>` (next to its Slurm log), if there is one."""
    fields = slurm_job(job_id) if fields is None else fields
    for log_dir in (Path(fields.get("StdOut", "/nonexistent")).parent, Path(fields.get("WorkDir", "/")) / "rayhpc-logs"):
        try:
            if (log_dir / job_id).is_dir():
                return log_dir / job_id
        except OSError:  # another user's log folder
            continue
    return None


def cluster_info(job_id: str, fields: dict[str, str] | None = None) -> dict:
    """What the job's startup wrote to <log dir>/<job>/cluster.json once its cluster was ready (this run of
    it: the file's `restart` is Slurm's restart count); {} when there is none, or it is not this user's job,
    or the file is not in a private folder of this user's. Another user's file could name their own
    address, where `rayhpc status` would take the token it names."""
    fields = slurm_job(job_id) if fields is None else fields
    folder = job_dir(job_id, fields)
    if folder is None or fields.get("UserId", "").partition("(")[2].rstrip(")") != str(os.getuid()):
        return {}
    try:
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return {}
        check_trusted(folder / "cluster.json")
        info = json.loads((folder / "cluster.json").read_text())
    except (OSError, ValueError, UnsafePath):
        return {}
    return info if str(info.get("restart")) == fields.get("Restarts", "0") else {}


def format_jobs(rows: list[dict]) -> str:
    if not rows:
        return "no rayhpc jobs in the queue"
    keys = ["job", "name", "state", "elapsed", "nodes", "head", "dashboard"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.upper().ljust(widths[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)
