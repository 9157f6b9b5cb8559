"""Training benchmark: rayhpc DDP against torchrun-launched plain DDP, side by side, on CPU (gloo).

    python jobs/bench_train.py [--workers 2] [--hidden 1024] [--in-features 256] [--batch 256] [--epochs 4]

Both train the same MLP (in -> hidden -> in) on the same data with the same
sampler and optimizer. Time to first step is from launching the command
(`torchrun ...` / `python jobs/train_mlp.py ...`) to the end of the first
optimizer step, Ray's start included. Throughput is the mean over epochs 2..N
(epoch 1 holds the warm-up). "Ray Train defaults" is the same job with Ray
Train's own start-up settings instead of the platform's. The three run in
turn, `--repeats` times; each figure is the median of its runs (this is a
shared machine: single runs vary by 10-20%).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
RAY_TRAIN_DEFAULTS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}


def torchrun(args, work: Path) -> dict:
    out = work / "torchrun.json"
    launcher = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    launch = time.time()
    subprocess.run([launcher, "--nproc_per_node", str(args.workers), "-m", "rayhpc.train.baseline",
                    "--out", str(out), "--launch-time", str(launch), "--in-features", str(args.in_features),
                    "--hidden", str(args.hidden), "--samples", str(args.samples), "--batch", str(args.batch),
                    "--epochs", str(args.epochs)], check=True, capture_output=True, env={**os.environ,
                                                                                          "OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    return {"first_step_s": result["first_step_s"], "samples_per_s": sum(result["samples_per_s"][1:])
            / (args.epochs - 1), "detail": ""}


def rayhpc(args, work: Path, name: str, env: dict | None = None) -> dict:
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "storage_path": str(work), "num_workers": args.workers, "epochs": args.epochs,
        "batch_size_per_worker": args.batch, "model": {"hidden": args.hidden},
        "data": {"synthetic": {"num_samples": args.samples, "in_features": args.in_features,
                               "out_features": args.in_features}}}))
    launch = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "train_mlp.py"), "--config", str(config)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"train_mlp.py failed:\n{proc.stdout}\n{proc.stderr}")
    metrics = pd.read_parquet(work / name / "metrics.parquet")
    epochs = metrics[metrics["kind"] == "epoch"]
    startup = re.search(r"start-up: (.*)", proc.stdout)
    return {"first_step_s": float(epochs["first_step_time"].iloc[0]) - launch,
            "samples_per_s": float(epochs["samples_per_s"].iloc[1:].mean()),
            "detail": startup.group(1) if startup else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--in-features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256, help="samples per step per worker")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=30720, help="rows of the synthetic task (80%% train)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    print(f"bench_train: MLP {args.in_features}-{args.hidden}-{args.in_features}, {args.workers} gloo workers x "
          f"{args.batch} samples/step, {args.epochs} epochs of {int(args.samples * 0.8)} samples", flush=True)
    runs: dict[str, list[dict]] = {"torchrun + plain DDP": [], "rayhpc DDP": [], "rayhpc DDP, Ray Train defaults": []}
    for i in range(args.repeats):
        runs["torchrun + plain DDP"].append(torchrun(args, work))
        runs["rayhpc DDP"].append(rayhpc(args, work, f"rayhpc{i}"))
        runs["rayhpc DDP, Ray Train defaults"].append(rayhpc(args, work, f"defaults{i}", RAY_TRAIN_DEFAULTS))
    rows = [(name, _median(results)) for name, results in runs.items()]
    base = rows[0][1]
    print(f"\n{'':32s} {'first step':>11s} {'vs torchrun':>12s} {'samples/s':>10s} {'vs torchrun':>12s}")
    for name, r in rows:
        print(f"{name:32s} {r['first_step_s']:10.1f}s {r['first_step_s'] / base['first_step_s']:11.2f}x "
              f"{r['samples_per_s']:10,.0f} {r['samples_per_s'] / base['samples_per_s']:11.3f}x")
    for name, results in list(runs.items())[1:]:
        print(f"{name}: " + " | ".join(r["detail"] for r in results))


def _median(results: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in results) for key in ("first_step_s", "samples_per_s")}


if __name__ == "__main__":
    main()
