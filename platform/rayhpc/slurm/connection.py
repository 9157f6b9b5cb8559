"""The connection file of a running job, `<log_dir>/<job>/cluster.json`, and its Prometheus targets.

Written by the sbatch startup once every node has joined (again after each requeue: ports and
nodes may differ): the address, every port, each node's address, the dashboard URL and the ssh
tunnel to it, and where the token is. `rayhpc status JOBID` and `rayhpc stop JOBID` read it.
Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rayhpc.slurm.layout import BLOCK, OFFSETS
from rayhpc.slurm.private import UnsafePath, owned_dir, write_private
from rayhpc.slurm.wait import node_records


def connection(env: dict[str, str]) -> dict:
    job_dir, nodes = Path(env["RH_JOB_DIR"]), env["RH_NODES"].split()
    records = node_records(job_dir, nodes)
    ports = {name: int(env[f"RH_{name.upper()}_PORT"]) for name in OFFSETS}
    ports["workers"] = f"{env['RH_MIN_WORKER_PORT']}-{env['RH_MAX_WORKER_PORT']}"
    out = {"job": int(env["RH_JOB"]), "restart": int(env.get("SLURM_RESTART_COUNT") or 0), "head": env["RH_HEAD"],
           "head_ip": env["RH_HEAD_IP"], "address": env["RAY_ADDRESS"], "ports": ports,
           "nodes": {n: records.get(n, {}).get("ip") for n in nodes}, "token_path": env["RAY_AUTH_TOKEN_PATH"]}
    if env.get("RAYHPC_DASHBOARD", "1") == "1":
        host = env.get("RAYHPC_DASHBOARD_HOST", "127.0.0.1")
        ip = "127.0.0.1" if host == "127.0.0.1" else env["RH_HEAD_IP"]
        login = env.get("SLURM_SUBMIT_HOST") or "<login-node>"
        port = ports["dashboard"]
        jump = f"-J {login} {env['RH_HEAD']}" if ip == "127.0.0.1" else login
        out.update(dashboard=f"http://{ip}:{port}", tunnel=f"ssh -N -L {port}:{ip}:{port} {jump}")
    return out


def prometheus_targets(info: dict, env: dict[str, str]) -> list[dict]:
    """File service discovery for Prometheus (cluster_configs/monitoring/prometheus.yml): every node's
    metrics endpoint, labelled with the job."""
    port = info["ports"]["metrics_export"]
    return [{"targets": [f"{ip}:{port}" for ip in info["nodes"].values() if ip],
             "labels": {"slurm_job": str(info["job"]), "cluster": env.get("SLURM_JOB_NAME", "ray")}}]


def main() -> int:
    env = dict(os.environ)
    info = connection(env)
    job_dir = Path(env["RH_JOB_DIR"])
    write_private(job_dir / "cluster.json", json.dumps(info, indent=1) + "\n")
    try:  # read by the user's Prometheus: the user's own folder, not necessarily a private one
        sd = owned_dir(job_dir.parent / "prometheus") / f"{info['job']}.json"
    except UnsafePath as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_private(sd, json.dumps(prometheus_targets(info, env)) + "\n")
    print(f"rayhpc: connection file {job_dir / 'cluster.json'}; ports {info['ports']['gcs']}-"
          f"{info['ports']['gcs'] + BLOCK - 1} (a block of {BLOCK})", flush=True)
    if "dashboard" in info:
        print(f"rayhpc: dashboard {info['dashboard']} on {info['head']} (sign in with the token in "
              f"{info['token_path']}); from your machine: {info['tunnel']}, then open "
              f"http://localhost:{info['ports']['dashboard']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
