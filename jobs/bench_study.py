"""Study benchmark: one TPE sweep run as K slices (K local Ray clusters of 1 CPU each, one study folder) against
the same sweep in one driver, and against a packed random sweep of the same slices; side by side, one run.

    python jobs/bench_study.py [--trials 1024] [--slices 4] [--epochs 10]
    python jobs/bench_study.py --ledger 100000 --slices 8 [--pack 64]   # the study folder's own costs, no training
    python jobs/bench_study.py --trials 100000 --slices 8 --random-only    # the random study alone, end to end

Rows: the single-driver packed TPE sweep (one local Ray of K CPUs), the TPE study of K slices, the random study
of K slices. Each: wall from the first command's start to the last one's end, the best validation loss, and the
study's own costs (ledger and checkpoint bytes per trial, files per trial). Goals: the sliced TPE's best within
2% of the single driver's, its wall at most 1.25x the sliced random sweep's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

JOBS = Path(__file__).resolve().parent


def tune(args: list[str], cpus: int) -> subprocess.Popen:
    env = {**os.environ, "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": cpus}), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # each command its own local Ray
    return subprocess.Popen([sys.executable, str(JOBS / "tune_mlp.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen], started: float) -> float:
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"a sweep failed (exit {proc.returncode}):\n{out[-3000:]}")
    return time.perf_counter() - started


def single(work: Path, sweep: list[str], cpus: int) -> dict:
    started = time.perf_counter()
    wall = finish([tune([*sweep, "--storage-path", str(work), "--name", "single"], cpus)], started)
    table = pd.read_parquet(work / "single" / "results.parquet")
    return {"wall_s": wall, "best": table["best_val_loss"].min(), "trials": len(table)}


def sliced(work: Path, name: str, sweep: list[str], slices: int) -> dict:
    study = work / name
    started = time.perf_counter()
    wall = finish([tune([*sweep, "--study", str(study)], 1) for _ in range(slices)], started)
    table = pd.read_parquet(study / "results.parquet")
    files = [p for p in study.rglob("*") if p.is_file()]
    by_slice = pd.Series([json.loads(line)["slice"] for line in (study / "ledger.jsonl").read_text().splitlines()
                          if json.loads(line)["event"] == "finish"]).value_counts()
    return {"wall_s": wall, "best": table["best_val_loss"].min(), "trials": len(table),
            "ledger_bytes_per_trial": (study / "ledger.jsonl").stat().st_size / len(table),
            "bytes_per_trial": sum(p.stat().st_size for p in files) / len(table),
            "files_per_trial": len(files) / len(table), "packs_per_slice": by_slice.tolist()}


def _claimer(folder: str, name: str, row: dict) -> None:
    """A slice that trains nothing: claims packs and finishes each with rows the size of real ones."""
    from rayhpc.study.folder import Study

    study = Study(Path(folder))
    study.join(name, ("val_loss", "min"))
    while True:
        with study.locked():
            pack = study.claim(name, None, 0, 0)
        if pack is None:
            return
        with study.locked():
            study.finish(name, pack["pack"], [{**row, "trial_id": f"{pack['pack']}-{j}", "config.lr": m["lr"]}
                                              for j, m in enumerate(pack["members"])])


def ledger(trials: int, slices: int, pack: int) -> None:
    """The study folder's own costs at `trials` trials: `slices` processes claim and finish packs of `pack`
    (no training); then a late slice's first look (the whole ledger replayed) and the union table's write."""
    import multiprocessing

    from rayhpc.study.folder import LEDGER_FILE, Study

    work = Path(tempfile.mkdtemp(prefix="bench_study_"))
    study = Study(work)
    with study.locked():
        study.ensure_plan(lambda: [[{"lr": 1e-3 * (i * pack + j)} for j in range(pack)]
                                   for i in range(math.ceil(trials / pack))])
    row = {"status": "finished", "config.hidden": 64, "val_loss": 0.01, "best_val_loss": 0.01, "iterations": 10,
           "train_seconds": 3.2, "node": "node1", "pack_size": pack, "error": None}
    started = time.perf_counter()
    procs = [multiprocessing.get_context("fork").Process(target=_claimer, args=(str(work), f"s{i}", row))
             for i in range(slices)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    wall = time.perf_counter() - started
    started = time.perf_counter()
    late = Study(work)
    with late.locked():
        replay = time.perf_counter() - started
        started = time.perf_counter()
        late.write_results()
        write = time.perf_counter() - started
    packs = math.ceil(trials / pack)
    print(f"ledger: {trials:,} trials in {packs:,} packs of {pack}, {slices} slices claiming and finishing: "
          f"{wall:.1f} s, {1000 * wall / packs:.2f} ms per pack ({1e6 * wall / trials:.0f} us per trial); "
          f"ledger {(work / LEDGER_FILE).stat().st_size / trials:.0f} bytes per trial; a late slice's first look "
          f"(the whole ledger) {replay:.2f} s; the union table's write {write:.2f} s")


def random_only(r: dict, args: argparse.Namespace) -> None:
    print(f"{args.slices} slices, random: {r['trials']:,} trials in {r['wall_s']:.1f} s, "
          f"{1000 * r['wall_s'] / r['trials']:.2f} ms per trial of wall; best val_loss {r['best']:.5f}; "
          f"ledger {r['ledger_bytes_per_trial']:.0f} B, study {r['bytes_per_trial']:.0f} B and "
          f"{r['files_per_trial']:.3f} files per trial; packs per slice {r['packs_per_slice']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1024)
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--ledger", type=int, metavar="N", help="instead: the study folder's own costs at N trials "
                        "(--slices processes claiming and finishing packs of --pack, no training)")
    parser.add_argument("--pack", type=int, default=64, help="with --ledger: trials per pack")
    parser.add_argument("--random-only", action="store_true", help="only the random study of --slices slices "
                        "(at sizes where TPE and one driver would take hours)")
    args = parser.parse_args()
    if args.ledger:
        return ledger(args.ledger, args.slices, args.pack)
    work = Path(tempfile.mkdtemp(prefix="bench_study_"))
    base = ["--num-samples", str(args.trials), "--epochs", str(args.epochs), "--seed", "0"]
    print(f"bench_study: {args.trials} trials of the default MLP sweep, {args.epochs} epochs, {args.slices} slices "
          f"of 1 CPU (single driver: 1 cluster of {args.slices} CPUs), {os.cpu_count()} cores here", flush=True)
    if args.random_only:
        return random_only(sliced(work, "random", [*base, "--search", "random"], args.slices), args)
    rows = {"single driver, TPE": single(work, [*base, "--search", "optuna"], args.slices),
            f"{args.slices} slices, TPE": sliced(work, "tpe", [*base, "--search", "optuna"], args.slices),
            f"{args.slices} slices, random": sliced(work, "random", [*base, "--search", "random"], args.slices)}
    print(f"{'':22s} {'wall':>8s} {'best val_loss':>14s} {'trials':>7s} {'ledger B/trial':>15s} "
          f"{'B/trial':>9s} {'files/trial':>12s}  packs per slice")
    for name, r in rows.items():
        extra = (f"{r['ledger_bytes_per_trial']:15.0f} {r['bytes_per_trial']:9.0f} {r['files_per_trial']:12.3f}  "
                 f"{r['packs_per_slice']}" if "ledger_bytes_per_trial" in r else "")
        print(f"{name:22s} {r['wall_s']:7.1f}s {r['best']:14.5f} {r['trials']:7d} {extra}")
    tpe, single_tpe = rows[f"{args.slices} slices, TPE"], rows["single driver, TPE"]
    random_ = rows[f"{args.slices} slices, random"]
    print(f"sliced TPE best / single driver's: {tpe['best'] / single_tpe['best']:.4f} (goal <= 1.02); "
          f"sliced TPE wall / sliced random's: {tpe['wall_s'] / random_['wall_s']:.2f}x (goal <= 1.25)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
