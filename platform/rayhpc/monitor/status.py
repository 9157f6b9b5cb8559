"""`rayhpc status --address ADDR`: what a running cluster is doing, read from the cluster itself:
nodes and resources in use, running jobs, and each running sweep's trial table."""

from __future__ import annotations

import pandas as pd

from rayhpc.monitor.board import read_boards


def cluster_status() -> str:
    """The status of the connected cluster, as printable text."""
    import ray  # Ray: only where a cluster is used (config checks and --help stay fast)
    from ray.util.state import list_jobs, list_nodes

    total, free = ray.cluster_resources(), ray.available_resources()
    used = ", ".join(f"{total[k] - free.get(k, 0.0):g}/{total[k]:g} {k}" for k in ("CPU", "GPU") if k in total)
    nodes = pd.DataFrame([{"node": n.node_name, "ip": n.node_ip, "head": n.is_head_node, "state": n.state,
                           "CPUs": n.resources_total.get("CPU", 0), "GPUs": n.resources_total.get("GPU", 0)}
                          for n in list_nodes(detail=True)])
    lines = [f"cluster {ray.get_runtime_context().gcs_address}: {len(nodes)} node(s); in use: {used or 'nothing'}",
             nodes.to_string(index=False)]
    me = ray.get_runtime_context().get_job_id()  # this status command is a job too
    running = [j for j in list_jobs() if str(j.status).endswith("RUNNING") and j.job_id != me]
    lines.append(f"running jobs: {len(running)}")
    lines += [f"  {j.job_id or j.submission_id}  {getattr(j.type, 'name', j.type)}  {_entrypoint(j)}" for j in running]
    for board in read_boards():
        lines += [""] + format_sweep(board).splitlines()
    return "\n".join(lines)


def format_sweep(board: dict) -> str:
    table = pd.DataFrame(board["rows"])
    if table.empty:
        return f"sweep {board['sweep']}: no trials yet"
    counts = board.get("counts") or table["status"].value_counts().to_dict()
    total = sum(counts.values())
    head = f"sweep {board['sweep']}: {total} trials (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")"
    if len(table) < total:
        head += f"; shown: the {len(table)} running or best"
    cols = ["trial_id", "status", *[c for c in table.columns if c.startswith("config.")],
            "iterations", "best_val_loss", *[c for c in ("pareto", "feasible") if c in table.columns], "node"]
    shown = table[cols].rename(columns=lambda c: c.removeprefix("config."))
    return head + "\n" + shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def _entrypoint(job) -> str:
    if job.entrypoint:
        return job.entrypoint
    info = job.driver_info
    return f"driver pid {info.pid} on {info.node_ip_address}" if info else ""
