"""Run the collectives benchmark: every primitive checked, then timed, at every size."""

from __future__ import annotations

import logging
import math
import time

import pandas as pd
import torch
import torch.distributed as dist

from rayhpc.collectives.config import CollectivesConfig
from rayhpc.collectives.primitives import bandwidths, make_case
from rayhpc.job import start_job
from rayhpc.workers.group import WorkerGroup

log = logging.getLogger(__name__)

RESULTS_FILE, PLOT_FILE = "collectives.parquet", "collectives_busbw.png"


def measure(ctx, name: str, size_bytes: int, warmup: int, iters: int) -> dict:
    """On every rank: run `name` once and check it; only if every rank's result is right, time it."""
    case = make_case(name, size_bytes, ctx.rank, ctx.world_size, ctx.device)
    try:
        case.run()
    except (RuntimeError, NotImplementedError) as exc:  # e.g. a primitive this backend lacks
        return {"seconds": math.nan, "size_bytes": case.size_bytes, "error": str(exc).splitlines()[0][:200]}
    wrong = case.check()
    flag = torch.tensor([1.0 if wrong else 0.0], device=ctx.device)
    dist.all_reduce(flag)  # every rank must agree on whether to go on to the timed loop
    if flag.item() > 0:
        return {"seconds": math.nan, "size_bytes": case.size_bytes, "error": wrong or "wrong on another rank"}
    _timed_runs(case, warmup, ctx.device)
    dist.barrier()
    return {"seconds": _timed_runs(case, iters, ctx.device), "size_bytes": case.size_bytes, "error": None}


def _timed_runs(case, iters: int, device: torch.device) -> float:
    """Mean seconds of `case.run()` over `iters` runs, its inputs refilled before each run outside the
    timing. On a GPU, CUDA events around each run: they time the collective on the device, not the
    host's launch (the host returns long before a large NCCL transfer is done)."""
    if iters == 0:
        return math.nan
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            case.refill()
            start.record()
            case.run()
            end.record()
        torch.cuda.synchronize(device)
        return sum(start.elapsed_time(end) for start, end in events) / 1000 / iters
    seconds = 0.0
    for _ in range(iters):
        case.refill()
        started = time.perf_counter()
        case.run()
        seconds += time.perf_counter() - started
    return seconds / iters


def run_collectives(cfg: CollectivesConfig, explicit: set[str] = frozenset(), log_level: int = logging.INFO) -> pd.DataFrame:
    """The results table (also written as Parquet and a PNG plot under the job's folder); each row is logged
    at `log_level` as it is measured."""
    cfg = start_job(cfg, explicit, workers=lambda c: c.compute.num_workers).cfg
    compute, rows = cfg.compute, []
    with WorkerGroup(compute.num_workers, cpus_per_worker=compute.cpus_per_worker, gpus_per_worker=float(compute.gpu),
                     timeout_s=cfg.timeout_s) as group:
        for name in cfg.primitives:
            for size in cfg.sizes:
                per_rank = group.run(measure, name, size, cfg.warmup, cfg.iters)
                rows.append(_row(name, per_rank, compute.num_workers, group.backend))
                log.log(log_level, format_row(rows[-1]))
    table = pd.DataFrame(rows)
    cfg.make_dir()
    table.to_parquet(cfg.experiment_dir / RESULTS_FILE, index=False)
    plot(table, cfg.experiment_dir / PLOT_FILE)
    return table


def _row(name: str, per_rank: list[dict], n: int, backend: str) -> dict:
    errors = [f"rank {r}: {p['error']}" for r, p in enumerate(per_rank) if p["error"]]
    seconds = max(p["seconds"] for p in per_rank)  # a collective is done when its slowest rank is
    size = per_rank[0]["size_bytes"]
    algbw, busbw = bandwidths(name, size, seconds, n) if not errors else (math.nan, math.nan)
    return {"primitive": name, "size_bytes": size, "ranks": n, "backend": backend,
            "time_us": seconds * 1e6 if not errors else math.nan, "algbw_GBps": algbw / 1e9,
            "busbw_GBps": busbw / 1e9, "correct": not errors, "error": "; ".join(errors) or None}


def format_row(row: dict) -> str:
    if not row["correct"]:
        return f"{row['primitive']:>14} {row['size_bytes']:>11,d} B  NOT TIMED: {row['error']}"
    return (f"{row['primitive']:>14} {row['size_bytes']:>11,d} B  {row['time_us']:>10.1f} us  "
            f"algbw {row['algbw_GBps']:7.3f} GB/s  busbw {row['busbw_GBps']:7.3f} GB/s")


def plot(table: pd.DataFrame, path) -> None:
    """Bus bandwidth against message size, one line per primitive."""
    import matplotlib  # plots only: about 0.5 s to import

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt  # plots only: about 0.5 s to import

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, rows in table[table["correct"]].groupby("primitive", sort=False):
        ax.plot(rows["size_bytes"], rows["busbw_GBps"], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    n, backend = int(table["ranks"].iloc[0]), table["backend"].iloc[0]
    ax.set_title(f"Collectives: {n} ranks, {backend}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
