"""Every batch script the platform submits, rendered from one cluster config's typed settings: `#SBATCH`
lines, the environment set-up, then the job's work. The cluster job runs the platform's startup script
(`ray_cluster.sbatch`, shipped inside the package, so an installed rayhpc finds it;
`cluster_configs/slurm/ray_cluster.sbatch` links to it); an array sweep's tasks each train one trial, and
its collect job gathers their results."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from rayhpc.slurm.config import ClusterConfig

STARTUP = Path(__file__).resolve().parent / "ray_cluster.sbatch"


def account_flags(cfg: ClusterConfig, *, mem: bool = True) -> list[str]:
    """Where every job of this cluster runs and who pays: partition, account, qos (and memory, for jobs that
    do the work)."""
    keys = ("partition", "account", "qos", "mem") if mem else ("partition", "account", "qos")
    return [f"--{key}={getattr(cfg.slurm, key)}" for key in keys if getattr(cfg.slurm, key) is not None]


def requeue_flags(cfg: ClusterConfig, *, warned: bool) -> list[str]:
    """Requeued when preempted or failed by a node, as the config says; `warned`: with USR1 ahead of the end
    (the startup stops the job cleanly on it; a process that does not catch USR1 would die of it)."""
    if not cfg.requeue.enabled:
        return ["--no-requeue"]
    return ["--requeue", *([f"--signal=B:USR1@{cfg.requeue.signal_lead_s}"] if warned else [])]


def sbatch_flags(cfg: ClusterConfig, nodes: int | None = None) -> list[str]:
    s = cfg.slurm
    flags = [f"--job-name=rayhpc-{cfg.name}", f"--nodes={nodes or s.nodes}", "--ntasks-per-node=1",
             f"--cpus-per-task={s.cpus_per_task}", f"--time={s.time}", *account_flags(cfg)]
    if s.gpus_per_node:
        flags.append(f"--gpus-per-node={s.gpus_per_node}")
    # one log per job, appended to across requeues
    flags += [f"--output={cfg.log_dir}/%x-%j.log", "--open-mode=append", *requeue_flags(cfg, warned=True)]
    return flags + s.extra


def array_flags(cfg: ClusterConfig, sweep, n_trials: int) -> list[str]:
    """An array of `n_trials` one-process tasks (`sweep.max_concurrent` at once), each the CPUs and GPU of one
    trial; a requeued task trains its trial again from the start."""
    s = cfg.slurm
    limit = f"%{sweep.max_concurrent}" if sweep.max_concurrent else ""
    flags = [f"--job-name=rayhpc-{cfg.name}-array", f"--array=0-{n_trials - 1}{limit}", "--nodes=1", "--ntasks=1",
             f"--cpus-per-task={math.ceil(sweep.cpus_per_trial)}", f"--time={s.time}", *account_flags(cfg)]
    if sweep.gpus_per_trial:
        flags.append(f"--gpus-per-task={math.ceil(sweep.gpus_per_trial)}")
    flags += [f"--output={cfg.log_dir}/%x-%A_%a.log", "--open-mode=append", *requeue_flags(cfg, warned=False)]
    return flags + s.extra


def collect_flags(cfg: ClusterConfig, array_id: str) -> list[str]:
    """The one-CPU job that gathers an array's results once every task has ended (`afterany`: failed ones
    become error rows): the cluster's partition, account and qos, none of the tasks' memory, GPUs or extra
    flags."""
    return [f"--job-name=rayhpc-{cfg.name}-collect", f"--dependency=afterany:{array_id}", "--ntasks=1",
            f"--time={cfg.slurm.time}", *account_flags(cfg, mem=False), f"--output={cfg.log_dir}/%x-%j.log"]


def setup_lines(cfg: ClusterConfig) -> list[str]:
    st, q = cfg.setup, shlex.quote
    lines = [f"module load {' '.join(q(m) for m in st.modules)}"] if st.modules else []
    if st.conda_env:
        lines += ['source "$(conda info --base)/etc/profile.d/conda.sh"', f"conda activate {q(st.conda_env)}"]
    if st.venv:
        activate = str(Path(st.venv) / "bin" / "activate")
        # ~ expands on the compute node (the same home everywhere), not where the script is rendered
        lines.append('source "$HOME"/' + q(activate[2:]) if activate.startswith("~/") else f"source {q(activate)}")
    lines += [f"export {k}={q(v)}" for k, v in st.env.items()]
    return lines


def startup_env(cfg: ClusterConfig) -> dict[str, str]:
    """Settings the startup script reads (RAYHPC_*)."""
    r = cfg.ray
    env = {"RAYHPC_LOG_DIR": str(cfg.log_dir), "RAYHPC_JOIN_TIMEOUT_S": f"{r.join_timeout_s:g}",
           "RAYHPC_DASHBOARD": "1" if r.dashboard else "0", "RAYHPC_DASHBOARD_HOST": r.dashboard_host,
           "RAYHPC_REQUEUE": "1" if cfg.requeue.enabled else "0"}
    if r.head_ip:
        env["RAYHPC_HEAD_IP"] = r.head_ip
    if r.object_store_gb:
        env["RAYHPC_OBJECT_STORE_BYTES"] = str(int(r.object_store_gb * 1e9))
    if cfg.container:
        c = cfg.container
        binds = [f"--bind {shlex.quote(b)}" for b in c.binds]
        gpu = ["--nv"] if c.gpu and cfg.slurm.gpus_per_node else []
        env["RAYHPC_CONTAINER"] = " ".join([c.runtime, "exec", *gpu, *binds, shlex.quote(c.image)])
    return env


def script(cfg: ClusterConfig, flags: list[str], body: list[str], by: str = "rayhpc submit") -> str:
    """A batch script: `#SBATCH` lines, the cluster's environment set-up, then `body`."""
    lines = ["#!/bin/bash", f"# rendered by `{by}` from cluster config {cfg.name!r}"]
    lines += [f"#SBATCH {flag}" for flag in flags]
    return "\n".join([*lines, "", "set -e", *setup_lines(cfg), *body, ""])


def render_sbatch(cfg: ClusterConfig, command: list[str], *, nodes: int | None = None,
                  startup: Path = STARTUP) -> str:
    """The whole batch script: submit it with `sbatch`, or read it (`rayhpc submit --dry-run`)."""
    q = shlex.quote
    body = ["set +e", *(f"export {k}={q(v)}" for k, v in startup_env(cfg).items())]
    body.append(f"exec bash {q(str(startup))} {' '.join(q(c) for c in command)}")
    return script(cfg, sbatch_flags(cfg, nodes), body)


def render_array(cfg: ClusterConfig, sweep, n_trials: int, out_dir: Path, task_spec: str | None = None) -> str:
    """The array job's script: one trial per task (`rayhpc.tune.single`), its result as JSON in `out_dir`."""
    q = shlex.quote
    task = f" --task {q(task_spec)}" if task_spec else ""
    command = (f"exec python -P -m rayhpc.tune.single --config {q(str(sweep.saved_file))} "
               f"--index \"$SLURM_ARRAY_TASK_ID\" --out {q(str(out_dir))}{task}")
    return script(cfg, array_flags(cfg, sweep, n_trials), [command], by="rayhpc submit --array")


def render_study_array(cfg: ClusterConfig, sweep, n_tasks: int, study: Path, task_spec: str | None = None) -> str:
    """An array job of `n_tasks` slices of a study without Ray (`rayhpc.tune.study_array`): each trains the study's
    trials one at a time until none is left; no collecting job (each task writes the study's table)."""
    q = shlex.quote
    task = f" --task {q(task_spec)}" if task_spec else ""
    command = f"exec python -P -m rayhpc.tune.study_array --study {q(str(study))}{task}"
    return script(cfg, array_flags(cfg, sweep, n_tasks), [command], by="rayhpc submit --array --study")


def render_collect(cfg: ClusterConfig, array_id: str, sweep_dir: Path) -> str:
    """The script of the job that writes an array sweep's results.parquet once the array has ended."""
    body = [f"exec python -P -m rayhpc.tune.array {shlex.quote(str(sweep_dir))}"]
    return script(cfg, collect_flags(cfg, array_id), body, by="rayhpc submit --array")
