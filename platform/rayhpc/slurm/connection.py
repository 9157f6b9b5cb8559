"""The connection file of a running job, `<log_dir>/<job>/cluster.json`, and its Prometheus targets.

Written by the sbatch startup once every node has joined (`rayhpc.slurm.wait nodes`; again after each
requeue: ports and nodes may differ): the address, the ports (the GCS's and the dashboard's as Ray bound
and published them, the job's fixed block), each node's address and metrics endpoint, the dashboard URL
and the ssh tunnel to it, and where the token is. `rayhpc status JOBID` and `rayhpc stop JOBID` read it.
Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rayhpc.private import UnsafePath, owned_dir, write_private
from rayhpc.slurm.layout import OFFSETS
from rayhpc.slurm.node import node_records


def connection(env: dict[str, str], published: dict) -> dict:
    """The connection file's fields, from the startup's environment and what Ray published once every node
    had joined (`published`: `rayhpc.slurm.wait.wait_nodes`)."""
    job_dir, nodes = Path(env["RH_JOB_DIR"]), env["RH_NODES"].split()
    ips = {n: node_records(job_dir, nodes).get(n, {}).get("ip") for n in nodes}
    ports = {"gcs": int(env["RAY_ADDRESS"].rsplit(":", 1)[1]),
             **{name: int(env[f"RH_{name.upper()}_PORT"]) for name in OFFSETS}}
    metrics = published["metrics_export"]
    out = {"job": int(env["RH_JOB"]), "restart": int(env.get("SLURM_RESTART_COUNT") or 0), "head": env["RH_HEAD"],
           "head_ip": env["RH_HEAD_IP"], "address": env["RAY_ADDRESS"], "ports": ports, "nodes": ips,
           "metrics": {n: f"{ip}:{metrics[ip]}" for n, ip in ips.items() if ip in metrics},
           "token_path": env["RAY_AUTH_TOKEN_PATH"]}
    if published.get("dashboard"):
        host = env.get("RAYHPC_DASHBOARD_HOST", "127.0.0.1")
        ip = "127.0.0.1" if host == "127.0.0.1" else env["RH_HEAD_IP"]
        login = env.get("SLURM_SUBMIT_HOST") or "<login-node>"
        port = ports["dashboard"] = int(published["dashboard"].rsplit(":", 1)[1])
        jump = f"-J {login} {env['RH_HEAD']}" if ip == "127.0.0.1" else login
        out.update(dashboard=f"http://{ip}:{port}", tunnel=f"ssh -N -L {port}:{ip}:{port} {jump}")
    return out


def prometheus_targets(info: dict, env: dict[str, str]) -> list[dict]:
    """File service discovery for Prometheus (cluster_configs/monitoring/prometheus.yml): every node's
    metrics endpoint, labelled with the job."""
    return [{"targets": sorted(info["metrics"].values()),
             "labels": {"slurm_job": str(info["job"]), "cluster": env.get("SLURM_JOB_NAME", "ray")}}]


def main(published: dict) -> int:
    env = dict(os.environ)
    info = connection(env, published)
    job_dir = Path(env["RH_JOB_DIR"])
    write_private(job_dir / "cluster.json", json.dumps(info, indent=1) + "\n")
    try:  # read by the user's Prometheus: the user's own folder, not necessarily a private one
        sd = owned_dir(job_dir.parent / "prometheus") / f"{info['job']}.json"
    except UnsafePath as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_private(sd, json.dumps(prometheus_targets(info, env)) + "\n")
    fixed = sorted(info["ports"][name] for name in OFFSETS)
    print(f"rayhpc: connection file {job_dir / 'cluster.json'}; GCS at {info['address']}, fixed ports "
          f"{fixed[0]}-{fixed[-1]}", flush=True)
    if "dashboard" in info:
        port = info["ports"]["dashboard"]
        print(f"rayhpc: dashboard {info['dashboard']} on {info['head']} (sign in with the token in "
              f"{info['token_path']}); from your machine: {info['tunnel']}, then open http://localhost:{port}",
              flush=True)
    return 0
