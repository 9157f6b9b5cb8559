"""The sbatch text for a cluster config and a command: `#SBATCH` lines from typed settings,
the environment set-up, then the platform's startup script (`ray_cluster.sbatch`, shipped inside the
package, so an installed rayhpc finds it; `cluster_configs/slurm/ray_cluster.sbatch` links to it)."""

from __future__ import annotations

import shlex
from pathlib import Path

from rayhpc.slurm.config import ClusterConfig

STARTUP = Path(__file__).resolve().parent / "ray_cluster.sbatch"


def sbatch_flags(cfg: ClusterConfig, nodes: int | None = None) -> list[str]:
    s = cfg.slurm
    flags = [f"--job-name=rayhpc-{cfg.name}", f"--nodes={nodes or s.nodes}", "--ntasks-per-node=1",
             f"--cpus-per-task={s.cpus_per_task}", f"--time={s.time}"]
    for key in ("partition", "account", "qos", "mem"):
        if getattr(s, key) is not None:
            flags.append(f"--{key}={getattr(s, key)}")
    if s.gpus_per_node:
        flags.append(f"--gpus-per-node={s.gpus_per_node}")
    # one log per job, appended to across requeues
    flags += [f"--output={cfg.log_dir}/%x-%j.log", "--open-mode=append"]
    if cfg.requeue.enabled:
        flags += ["--requeue", f"--signal=B:USR1@{cfg.requeue.signal_lead_s}"]
    else:
        flags.append("--no-requeue")
    return flags + s.extra


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


def render_sbatch(cfg: ClusterConfig, command: list[str], *, nodes: int | None = None,
                  startup: Path = STARTUP) -> str:
    """The whole batch script: submit it with `sbatch`, or read it (`rayhpc submit --dry-run`)."""
    q = shlex.quote
    lines = ["#!/bin/bash", f"# rendered by `rayhpc submit` from cluster config {cfg.name!r}"]
    lines += [f"#SBATCH {flag}" for flag in sbatch_flags(cfg, nodes)]
    lines += ["", "set -e", *setup_lines(cfg), "set +e"]
    lines += [f"export {k}={q(v)}" for k, v in startup_env(cfg).items()]
    lines += [f"exec bash {q(str(startup))} {' '.join(q(c) for c in command)}", ""]
    return "\n".join(lines)
