"""The table of `jobs/bench_ps.py`: parameter server (sync, async) against DDP on the same task, data
order and epochs, for several worker counts: throughput, time to a target validation loss, and the
bytes each worker moves per step beside the formulas (PS: pull + push = 2 x model; ring all-reduce:
2 (n - 1) / n x model, what DDP's gloo/NCCL ring sends and receives)."""

from __future__ import annotations

import logging
import tempfile

import pandas as pd

from rayhpc.config import validate
from rayhpc.ps.config import PSConfig
from rayhpc.ps.driver import run_ps
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training


def run_methods(n: int, base: dict, servers: int, staleness: int | None, gpu: bool) -> list[dict]:
    """PS sync, PS async and DDP with `n` workers; one row each (model bytes from the PS layout)."""
    rows, model_bytes = [], None
    for method in ("ps sync", "ps async", "ddp"):
        name = f"{method.replace(' ', '-')}-{n}{'-gpu' if gpu else ''}"
        if method == "ddp":
            cfg = validate(TrainConfig, {**base, "name": name, "compute": {"num_workers": n, "gpu": gpu}})
            metrics = run_training(cfg).metrics
            metrics = metrics[metrics["kind"] == "epoch"]
        else:
            mode = method.split()[1]
            extra = {"staleness": staleness} if mode == "async" and staleness is not None else {}
            cfg = validate(PSConfig, {**base, "name": name, "mode": mode, **extra,
                                      "compute": {"num_workers": n, "gpu": gpu, "num_servers": servers}})
            result = run_ps(cfg, log_level=logging.DEBUG)
            metrics, model_bytes = result.metrics, 4 * sum(result.layout.sizes())
        rows.append({"workers": n, "device": "gpu" if gpu else "cpu", "method": method, "metrics": metrics})
    for row in rows:
        row["model_bytes"] = model_bytes
    return rows


def summarise(rows: list[dict], target: float | None) -> tuple[pd.DataFrame, float]:
    """One line per run: median samples/s, seconds of training to `target` (default: the worst of the
    runs' best validation losses, so every run reaches it), bytes per step per worker and formula."""
    if target is None:
        target = max(r["metrics"]["val_loss"].min() for r in rows)
    out = []
    for r in rows:
        m, n = r["metrics"], r["workers"]
        reached = m[m["val_loss"] <= target * (1 + 1e-9)]
        formula = 2 * r["model_bytes"] if r["method"].startswith("ps") else 2 * (n - 1) / n * r["model_bytes"]
        out.append({"workers": n, "device": r["device"], "method": r["method"],
                    "samples_per_s": m["samples_per_s"].median(),
                    "seconds_to_target": reached["train_seconds"].iloc[0] if len(reached) else float("nan"),
                    "epochs_to_target": int(reached["epoch"].iloc[0]) if len(reached) else None,
                    "final_val_loss": m["val_loss"].iloc[-1],
                    "measured_bytes_per_step": m["bytes_per_step"].median() if "bytes_per_step" in m else None,
                    "pull_compute_push_ms": (tuple(m[f"{k}_ms"].median() for k in ("pull", "compute", "push"))
                                             if "pull_ms" in m else None),
                    "formula_bytes_per_step": formula})
    return pd.DataFrame(out), target


def format_table(table: pd.DataFrame, target: float) -> str:
    lines = [f"time to val_loss <= {target:.4g}; bytes each worker sends + receives per step (measured for the "
             "parameter server; the ring formula for DDP)",
             f"{'workers':>7} {'device':>6} {'method':>9} {'samples/s':>10} {'s to target':>11} {'epochs':>6} "
             f"{'final val':>9} {'MB/step measured':>16} {'MB/step formula':>15} {'pull/compute/push ms':>20}"]
    for r in table.to_dict("records"):
        measured = f"{r['measured_bytes_per_step'] / 1e6:.3f}" if r["pull_compute_push_ms"] else "-"
        split = "/".join(f"{v:.2f}" for v in r["pull_compute_push_ms"]) if r["pull_compute_push_ms"] else "-"
        lines.append(f"{r['workers']:>7} {r['device']:>6} {r['method']:>9} {r['samples_per_s']:>10,.0f} "
                     f"{r['seconds_to_target']:>11.2f} {r['epochs_to_target'] or '-':>6} {r['final_val_loss']:>9.4g} "
                     f"{measured:>16} {r['formula_bytes_per_step'] / 1e6:>15.3f} {split:>20}")
    return "\n".join(lines)


def compare(workers: list[int], base: dict, servers: int, staleness: int | None, gpu_counts: list[int],
            target: float | None) -> tuple[pd.DataFrame, float]:
    """Every method at every worker count on CPUs, then at `gpu_counts` on GPUs; the summary table."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rayhpc-bench-ps-") as storage:
        base = {**base, "storage_path": storage}
        for n in workers:
            rows += run_methods(n, base, servers, staleness, False)
        for n in gpu_counts:
            rows += run_methods(n, base, servers, staleness, True)
    return summarise(rows, target)
