"""The adaptive rows of `jobs/bench_sweep.py --adaptive`: the default sweep (the built-in MLP task,
its own space) at N trials, random search, ASHA and Optuna, packed and unpacked, on one local Ray,
side by side: wall, wall over the packed random sweep's, best val_loss, early-stopped trials."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

ROWS = {  # name: (search, scheduler, pack: None = the default packing, 1 = unpacked)
    "random, packed": ("random", "fifo", None),
    "asha, packed": ("random", "asha", None),
    "optuna, packed": ("optuna", "fifo", None),
    "asha, unpacked": ("random", "asha", 1),
    "optuna, unpacked": ("optuna", "fifo", 1),
}


def adaptive_rows(trials: int, epochs: int, unpacked: bool) -> list[tuple[str, float, float, int, int]]:
    """(row, wall seconds, best val_loss, early-stopped trials, Tune trials) per sweep kind."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.sweep import run_sweep

    out = []
    with tempfile.TemporaryDirectory(prefix="bench_adaptive_") as work:
        for name, (search, scheduler, pack) in ROWS.items():
            if pack == 1 and not unpacked:
                continue
            cfg = SweepConfig(name=name.replace(", ", "-"), storage_path=Path(work), num_samples=trials, epochs=epochs,
                              search=search, scheduler=scheduler, pack=pack)
            start = time.perf_counter()
            table = run_sweep(cfg)
            wall = time.perf_counter() - start
            tune_trials = table["trial_id"].str.rsplit("-", n=1).str[0].nunique() if pack != 1 else len(table)
            out.append((name, wall, float(table["best_val_loss"].min()),
                        int((table["status"] == "early-stopped").sum()), tune_trials))
    return out


def print_adaptive(rows: list[tuple[str, float, float, int, int]], trials: int, epochs: int) -> None:
    base = next((wall for name, wall, *_ in rows if name == "random, packed"), math.nan)
    print(f"\nadaptive sweeps: {trials} trials of the default sweep, {epochs} epochs each\n")
    print(f"{'sweep':18s} {'wall':>8s} {'/ random':>9s} {'best val_loss':>14s} {'early-stopped':>14s} "
          f"{'Tune trials':>12s}")
    for name, wall, best, stopped, tune_trials in rows:
        print(f"{name:18s} {wall:7.1f}s {wall / base:8.2f}x {best:14.5f} {stopped:14d} {tune_trials:12d}", flush=True)
