"""The scale rows of `jobs/bench_sweep.py --scale`: the default sweep at 16 to 10,000 trials on one local
Ray, each driven by a fresh driver process (so that its CPU time and peak memory are the driver's alone),
with what it leaves under `storage_path`.

    python jobs/bench/scale_sweeps.py --trials N --epochs E --address ADDR --storage DIR [--kill-after S]

runs one sweep and prints one JSON line (what `scale_rows` reads); `--kill-after S` SIGKILLs that driver
S seconds in and resumes the sweep with a second one (`--resume`), counting the finished trials kept."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

SIZES = (16, 128, 1024, 10_000)


def measure_one(trials: int, epochs: int, address: str, storage: Path, resume: bool, study: bool = False,
                tracking: dict | None = None, name: str | None = None, samples: int | None = None,
                seeds: int = 1) -> dict:
    """Run the sweep in this process (the driver) and measure it; `study`: as the one slice of a study;
    `tracking`: its `tracking:` section (the runs' writes are waited for before the sweep returns); `seeds`:
    runs of each configuration (`repeats`)."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.results import RESULTS_FILE, write_results
    from rayhpc.tune.sweep import run_sweep

    cfg = SweepConfig(name=name or f"scale-{trials}", storage_path=storage, num_samples=trials, epochs=epochs,
                      address=address, resume=resume, study=storage / f"study-{trials}" if study else None,
                      tracking=tracking or {}, data={"synthetic": {"num_samples": samples}} if samples else {},
                      repeats=seeds)
    start = time.perf_counter()
    table = run_sweep(cfg, explicit={"resume"} if resume else set())
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # a tracked sweep's writer process, ended
    kept = cfg.study if study else cfg.experiment_dir  # what the sweep leaves on the filesystem
    t = time.perf_counter()  # the final write of the whole table, once more, timed
    write_results(table, kept, RESULTS_FILE + ".timed")
    write_s = time.perf_counter() - t
    (kept / (RESULTS_FILE + ".timed")).unlink()
    # Ray Tune's experiment state, which it saves whole after each trial checkpoint (a study: its slice's)
    state = sum(p.stat().st_size for p in kept.rglob("experiment_state*.json"))
    files, size = 0, 0
    for folder, _, names in os.walk(kept):
        files += len(names) + 1  # a folder is an inode too
        size += sum(os.path.getsize(os.path.join(folder, n)) for n in names)
    return {"trials": len(table), "finished": int((table["status"] == "finished").sum()), "wall_s": wall,
            "driver_cpu_s": usage.ru_utime + usage.ru_stime, "children_cpu_s": children.ru_utime + children.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024, "tune_state_bytes": state,
            "write_s": write_s, "files": files, "bytes": size, "best_val_loss": float(table["best_val_loss"].min())}


def run_driver(trials: int, epochs: int, address: str, storage: Path, *extra: str,
               kill_after: float | None = None) -> dict | None:
    """One driver process; its JSON line, or None when it was killed."""
    cmd = [sys.executable, __file__, "--trials", str(trials), "--epochs", str(epochs),
           "--address", address, "--storage", str(storage), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return None
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the {trials}-trial sweep's driver exited with {proc.returncode}: {out[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def scale_rows(sizes, epochs: int, address: str, storage: Path, study: bool = False) -> list[dict]:
    rows = []
    for n in sizes:
        row = run_driver(n, epochs, address, storage, *(["--study"] if study else []))
        rows.append(row)
        print_row(row, epochs)
    return rows


def resumed_row(trials: int, epochs: int, address: str, storage: Path, kill_after: float) -> dict:
    """Kill the driver `kill_after` s in, resume; the trials finished before the kill that were kept."""
    from rayhpc.tune.results import read_results

    exp = storage / f"scale-{trials}"
    assert run_driver(trials, epochs, address, storage, kill_after=kill_after) is None, "the sweep ended first"
    before = read_results(exp)
    done_before = before[before["status"] == "finished"].set_index("trial_id") if len(before) else before
    row = run_driver(trials, epochs, address, storage, "--resume")
    after = read_results(exp).set_index("trial_id")
    kept = (after.loc[done_before.index, "train_seconds"] == done_before["train_seconds"]).sum()
    return {**row, "killed_after_s": kill_after, "finished_before_kill": len(done_before), "kept": int(kept)}


HEADER = (f"{'trials':>7} {'wall':>8} {'driver CPU':>11} {'per trial':>10} {'peak RSS':>9} {'files':>7} "
          f"{'/trial':>7} {'MB':>7} {'kB/trial':>9} {'Tune state':>11} {'table write':>12} {'best val_loss':>14}")


def print_row(r: dict, epochs: int) -> None:
    n = r["trials"]
    print(f"{n:>7,} {r['wall_s']:>7.1f}s {r['driver_cpu_s']:>10.1f}s {1000 * r['driver_cpu_s'] / n:>8.2f}ms "
          f"{r['peak_rss_mb']:>7.0f}MB {r['files']:>7,} {r['files'] / n:>7.2f} {r['bytes'] / 1e6:>7.1f} "
          f"{r['bytes'] / n / 1e3:>9.2f} {r['tune_state_bytes'] / 1e6:>9.2f}MB {1000 * r['write_s']:>10.1f}ms "
          f"{r['best_val_loss']:>14.5f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--storage", type=Path, required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--study", action="store_true", help="the sweep as the one slice of a study")
    p.add_argument("--tracking", default="{}", help="the sweep's tracking: section, as JSON")
    p.add_argument("--name", help="the sweep's name (default scale-TRIALS)")
    p.add_argument("--samples", type=int, help="rows of the synthetic data (default 2048)")
    p.add_argument("--seeds", type=int, default=1, help="runs of each configuration (the sweep's repeats)")
    a = p.parse_args()
    import logging

    logging.getLogger("rayhpc").setLevel(logging.WARNING)
    print(json.dumps(measure_one(a.trials, a.epochs, a.address, a.storage, a.resume, a.study, json.loads(a.tracking),
                                 a.name, a.samples, a.seeds)), flush=True)


if __name__ == "__main__":
    main()
