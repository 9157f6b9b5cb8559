"""`rayhpc status JOBID` and `rayhpc stop JOBID`: one job, as Slurm and as its Ray cluster see it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from rayhpc.config import ConfigError
from rayhpc.slurm.config import time_seconds
from rayhpc.slurm.layout import nodes_of
from rayhpc.slurm.submit import cluster_info, job_dir, slurm_job


def _seconds(value: str) -> int | None:
    try:
        return time_seconds(value)
    except ValueError:
        return None


def slurm_view(job_id: str, fields: dict[str, str]) -> str:
    state, run, limit = fields.get("JobState", "?"), fields.get("RunTime", "?"), fields.get("TimeLimit", "?")
    used, total = _seconds(run), _seconds(limit)
    left = f" ({(total - used) // 60} min left)" if used is not None and total is not None else ""
    return (f"job {job_id} ({fields.get('JobName', '?')}): {state}, {run} of {limit}{left}; nodes "
            f"{fields.get('NodeList', '-')}; restarts {fields.get('Restarts', '0')}")


def job_status(job_id: str) -> str:
    """Slurm's view (state, time left, nodes) and, once its cluster is up, Ray's (nodes alive, CPUs
    and GPUs in use, running jobs and sweeps), through the job's connection file and token."""
    fields = slurm_job(job_id)
    if not fields:
        raise ConfigError(f"job {job_id}: Slurm does not know it (not in the queue, nor recently ended)")
    lines = [slurm_view(job_id, fields)]
    info = cluster_info(job_id, fields)
    if not info or fields.get("JobState") != "RUNNING":
        lines.append("ray: no cluster running" + ("" if info else " (no connection file yet)"))
        return "\n".join(lines)
    lines.append(f"ray: {info['address']} (connection file {job_dir(job_id, fields)}/cluster.json)")
    if info.get("dashboard"):
        lines.append(f"dashboard: {info['dashboard']}; tunnel: {info['tunnel']}")
    # the job's own token, read before ray is imported (Ray reads its auth settings then); its address
    # for Ray's state API too, which otherwise looks for clusters on this node and stops at two
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=info["token_path"], RAY_ADDRESS=info["address"])
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)

    from rayhpc.monitor.status import cluster_status  # imports Ray: after the environment Ray reads

    try:
        ray.init(address=info["address"], logging_level="ERROR", log_to_driver=False)
        lines.append(cluster_status())
    except (ConnectionError, RuntimeError, ValueError) as exc:
        lines.append(f"ray: cannot reach the cluster: {exc}".splitlines()[0])
    finally:
        ray.shutdown()
    return "\n".join(lines)


def stop(job_id: str, timeout_s: float = 120.0) -> tuple[str, bool]:
    """Cancel the job, wait until it has left the queue, then read each node's clean-up report
    (written on the node by `rayhpc.slurm.node` after it reaped the job's processes); (text, clean)."""
    fields = slurm_job(job_id)
    if not fields:
        raise ConfigError(f"job {job_id}: Slurm does not know it (not in the queue, nor recently ended)")
    folder, nodes = job_dir(job_id, fields), nodes_of(fields["NodeList"]) if fields.get("NodeList") else []
    started = time.time()
    cancel = subprocess.run(["scancel", job_id], capture_output=True, text=True)
    if cancel.returncode:  # e.g. another user's job: "Access/permission denied"
        raise ConfigError(f"job {job_id}: scancel: {(cancel.stderr.strip() or 'failed').splitlines()[-1]}")
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            return f"job {job_id}: still in the queue {timeout_s:g} s after scancel", False
        time.sleep(0.5)
    lines, clean = [f"job {job_id}: cancelled"], True
    for node in nodes:
        lines.append(f"  {node}: " + (_node_report(folder, node, started) if folder else "no job folder to read"))
        clean &= lines[-1].endswith(": clean")
    return "\n".join(lines), clean


def _node_report(folder: Path, node: str, since: float) -> str:
    path = folder / "nodes" / f"{node}.cleanup.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"no clean-up report ({path}): the node may be down; check it with `ssh {node} pgrep -u $USER -a`"
    if report["time"] < since:
        return f"no clean-up report since the cancel (the last one is from {time.ctime(report['time'])})"
    left = [f"{len(report['left_pids'])} process(es) left: {report['left_pids']}"] if report["left_pids"] else []
    left += [f"temp folder(s) left: {', '.join(report['left_dirs'])}"] if report["left_dirs"] else []
    return "; ".join(left) if left else "clean"
