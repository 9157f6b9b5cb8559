"""Training benchmarks, side by side in one run.

    python jobs/bench_train.py [--workers 2] [--hidden 1024] [--in-features 256] [--batch 256] [--epochs 4]
    python jobs/bench_train.py --llama [--gpt-bytes 200000]
    python jobs/bench_train.py --strategies [--gpu] [--hidden 8192 --depth 4 --in-features 8192 --batch 8192]
    python jobs/bench_train.py --gpt-options [--workers 1]
    python jobs/bench_train.py --metrics-overhead

Default: rayhpc DDP against torchrun-launched plain DDP on CPU (gloo); `--llama`: the same comparison on the
Hugging Face Llama example (jobs/tasks/llama.py, needs `rayhpc[hf]`), its model, data and loss in both, tokens/s.
`--strategies`: raw PyTorch (one process, no Ray, no wrapper) against our DDP and our
FSDP2 (one worker, or `--workers N` with `--gpu`: one per GPU): steady-state samples/s,
and the time from fit() to done; with `--gpu` on CUDA, NCCL and bf16 autocast, raw
PyTorch's data on the GPU as a careful user puts it there (a per-sample DataLoader and
pageable copies would make it, not the GPU, the bottleneck).
`--gpt-options`: the example GPT task (jobs/tasks/gpt.py) trained eager, with each block
compiled (`--compile blocks`), and with full and selective activation checkpointing:
tokens/s as ratios to eager (the compile time falls in epoch 1, which is not counted).
`--metrics-overhead`: the Hugging Face Llama example (jobs/tasks/llama.py, needs `rayhpc[hf]`) on 2 DDP
workers with a metrics row per epoch, and with one every step (`metrics_every_steps: 1`): tokens/s of each,
the second as a ratio to the first (what a row per step costs).

All runs train the same MLP (in -> hidden ... -> in) on the same data with the same
sampler and optimizer. Time to first step is from launching the command
(`torchrun ...` / `python jobs/train_mlp.py ...`) to the end of the first
optimizer step, Ray's start included. Throughput is the mean over epochs 2..N
(epoch 1 holds the warm-up). "Ray Train defaults" is the same job with Ray
Train's own start-up settings instead of the platform's; "plain Ray Train" is
the baseline's loop in a `TorchTrainer` on a `ray.init()` of Ray's defaults,
as Ray Train's docs write it. The runs take
turns, `--repeats` times; each figure is the median of its runs (this is a
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

BENCH = Path(__file__).resolve().parent / "bench"  # the plain-PyTorch baseline, run as a script

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")
RAY_TRAIN_DEFAULTS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}


def baseline(args, work: Path, raw: bool = False, ray_train: bool = False) -> dict:
    """Plain PyTorch: torchrun + DDP on `--workers` CPU ranks, or (`raw`) one process on the chosen device, or
    (`ray_train`) plain Ray Train: a TorchTrainer of `--workers` workers on a `ray.init()` of its defaults."""
    out = work / "baseline.json"
    launcher = [] if raw or ray_train else [shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun")),
                                            "--nproc_per_node", str(args.workers)]
    device = ["--device", "cuda", "--bf16"] if raw and args.gpu else []
    launch = time.time()
    task = ["--task", LLAMA, "--corpus-bytes", str(args.gpt_bytes)] if args.llama else []
    subprocess.run([*(launcher or [sys.executable]), str(BENCH / "train_baseline.py"), "--out", str(out),
                    "--launch-time", str(launch), "--in-features", str(args.in_features), "--hidden",
                    str(args.hidden), "--depth", str(args.depth), "--samples", str(args.samples), "--batch",
                    str(args.batch), "--epochs", str(args.epochs), *device, *task,
                    *(["--ray-train", str(args.workers)] if ray_train else [])],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    later = {key: statistics.mean(result[key][1:]) for key in ("samples_per_s", "data_wait_share")}  # epoch 1: warm-up
    return {"first_step_s": result["first_step_s"], **later, "detail": "", "fit_s": NAN, "mfu": NAN}


def rayhpc(args, work: Path, name: str, env: dict, strategy: str = "ddp",
           job: dict | None = None) -> dict:
    """`train_mlp.py` on the MLP of `args` (or `job`: the config's other keys, e.g. another task)."""
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "storage_path": str(work), "compute": {"num_workers": args.workers, "gpu": args.gpu},
        "epochs": args.epochs, "strategy": strategy, "batch_size_per_worker": args.batch,
        "precision": "bf16" if args.gpu else "tf32",  # as the raw baseline: bf16 autocast on GPUs
        **(job or {"hparams": {"hidden": args.hidden, "depth": args.depth},
                   "data": {"synthetic": {"num_samples": args.samples, "in_features": args.in_features,
                                          "out_features": args.in_features}}})}))
    launch = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "train_mlp.py"), "--config", str(config)],
                          capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode:
        raise SystemExit(f"train_mlp.py failed:\n{proc.stdout}\n{proc.stderr}")
    metrics = pd.read_parquet(work / name / "metrics.parquet")
    epochs = metrics[metrics["kind"] == "epoch"]
    startup = re.search(r"start-up: (.*)", proc.stdout)
    fit = re.search(r"in ([0-9.]+) s from fit\(\) to done", proc.stdout)
    later = epochs.iloc[1:]  # epoch 1 holds the warm-up
    return {"first_step_s": float(epochs["first_step_time"].iloc[0]) - launch,
            "samples_per_s": float(later["tokens_per_s" if job else "samples_per_s"].mean()),
            "detail": startup.group(1) if startup else "", "fit_s": float(fit.group(1)) if fit else NAN,
            "mfu": float(later["mfu"].mean()) if "mfu" in later else NAN,
            "data_wait_share": float(later["data_wait_share"].mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", action="store_true", help="raw PyTorch vs our DDP vs our FSDP, 1 worker")
    parser.add_argument("--gpu", action="store_true", help="with --strategies: CUDA, NCCL, bf16 autocast")
    parser.add_argument("--gpt-options", action="store_true", help="the GPT task: eager vs compiled vs activation "
                        "checkpointing, tokens/s")
    parser.add_argument("--metrics-overhead", action="store_true", help="the Llama task: a metrics row per epoch "
                        "vs one every step, tokens/s")
    parser.add_argument("--llama", action="store_true", help="the default comparison with torchrun on the Llama "
                        "task instead of the MLP")
    parser.add_argument("--workers", type=int, help="DDP ranks (default 2; with --strategies 1, or with "
                        "--strategies --gpu one per GPU you give, each compared with raw PyTorch on one GPU)")
    parser.add_argument("--in-features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=2, help="Linear layers")
    parser.add_argument("--batch", type=int, default=256, help="samples per step per worker")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=30720, help="rows of the synthetic task (80%% train)")
    parser.add_argument("--gpt-bytes", type=int, default=200_000, help="--gpt-options, --metrics-overhead, "
                        "--llama: corpus bytes (90%% train)")
    parser.add_argument("--json", help="also write the table (medians per run) to this file")
    args = parser.parse_args()
    if args.gpu and not args.strategies:
        parser.error("--gpu: only with --strategies (the torchrun comparison is CPU, gloo)")
    if args.epochs < 2:
        parser.error(f"--epochs {args.epochs}: need >= 2 (epoch 1 holds the warm-up)")
    if args.workers is None or (args.strategies and not args.gpu):
        args.workers = 1 if args.strategies else 2
    if args.llama and (args.strategies or args.gpt_options or args.metrics_overhead):
        parser.error("--llama: only with the default comparison (torchrun)")
    tokens = args.gpt_options or args.metrics_overhead or args.llama
    if tokens:
        args.batch = 32 if args.batch == 256 else args.batch  # windows of 64 bytes per sample
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    widths = "-".join(map(str, [args.in_features] + [args.hidden] * (args.depth - 1) + [args.in_features]))
    model = f"{'GPT' if args.gpt_options else 'Llama'} task, {args.gpt_bytes} corpus bytes" \
        if tokens else f"MLP {widths}"
    print(f"bench_train: {model}, {args.workers} "
          f"{'NCCL' if args.gpu else 'gloo'} worker(s) x {args.batch} samples/step, {args.epochs} epochs"
          + ("" if tokens else f" of {int(args.samples * 0.8)} samples"), flush=True)
    from bench.first_result import cluster_up, cold

    rows = plan(args, cold(work))
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    for i in range(args.repeats):  # the cold runs first: the user's cluster, idle, would load the machine
        for name, run in rows.items():
            if name != UP:
                runs[name].append(run(work, i))
    if UP in rows:  # then the same job joining the user's cluster (`rayhpc up`)
        with cluster_up(work, args.workers) as up:
            runs[UP] = [rows[UP](work, i, up) for i in range(args.repeats)]
    print_table(runs, "tokens/s" if tokens else "samples/s",
                args.workers if args.strategies else 1)
    if args.json:
        Path(args.json).write_text(json.dumps({name: _median(results) for name, results in runs.items()}, indent=1))


def print_table(runs: dict[str, list[dict]], unit: str, per: int = 1) -> None:
    """Medians over the repeats, each beside the first (baseline) row; `per` > 1: the ratio per worker (GPU) of
    the rows after the baseline (raw PyTorch on one GPU)."""
    rows = [(name, _median(results)) for name, results in runs.items()]
    base = rows[0][1]
    print(f"\n{'':32s} {'first step':>11s} {'vs ' + rows[0][0].split()[0]:>12s} {unit:>10s} "
          f"{'ratio' if per == 1 else 'per GPU':>7s} {'fit() to done':>14s} {'MFU':>6s} {'data wait':>10s}")
    for i, (name, r) in enumerate(rows):
        ratio = r["samples_per_s"] / (per if i else 1) / base["samples_per_s"]
        print(f"{name:32s} {r['first_step_s']:10.1f}s {r['first_step_s'] / base['first_step_s']:11.2f}x "
              f"{r['samples_per_s']:10,.0f} {ratio:6.3f}x "
              + _cell(r["fit_s"], "13.1f", 14, "s") + " " + _cell(r["mfu"], "6.1%", 6) + " "
              + _cell(r["data_wait_share"], "10.1%", 10))
    for name, results in list(runs.items())[1:]:
        print(f"{name}: " + " | ".join(r["detail"] for r in results))


def _cell(value: float, spec: str, width: int, unit: str = "") -> str:
    """`value` formatted, or "-" in the same width where it is NaN (not measured by that run)."""
    return f"{value:{spec}}{unit}" if value == value else f"{'-':>{width}s}"


UP = "rayhpc DDP, your cluster up"
LLAMA = str(ROOT / "jobs" / "tasks" / "llama.py") + ":Llama"


def plan(args, cold: dict) -> dict:
    """The runs of one repeat, the baseline first. `cold`: the environment of a job that starts its own Ray;
    the UP row's run takes the environment of one that joins the user's cluster."""
    if args.gpt_options:
        def gpt(extra: dict):
            job = {"task": str(ROOT / "jobs" / "tasks" / "gpt.py") + ":GPT",
                   "optim": {"optimizer": "adamw", "lr": 1e-3}, "hparams": {"corpus_bytes": args.gpt_bytes}, **extra}
            return lambda work, i: rayhpc(args, work, f"gpt-{'-'.join(map(str, extra.values())) or 'eager'}{i}",
                                          cold, job=job)
        return {"GPT eager": gpt({}), "GPT compiled blocks": gpt({"compile": "blocks"}),
                "GPT full AC": gpt({"activation_checkpointing": "full"}),
                "GPT selective AC": gpt({"activation_checkpointing": "selective"})}
    if args.metrics_overhead:
        def llama(every: int | None):
            job = {"task": LLAMA, "optim": {"optimizer": "adamw"},
                   "hparams": {"corpus_bytes": args.gpt_bytes}, "metrics_every_steps": every}
            return lambda work, i: rayhpc(args, work, f"llama-{every or 'epochs'}-{i}", cold, job=job)
        return {"Llama, a row per epoch": llama(None), "Llama, a row every step": llama(1)}
    if args.strategies:
        return {"raw PyTorch": lambda work, i: baseline(args, work, raw=True),
                "rayhpc DDP": lambda work, i: rayhpc(args, work, f"ddp{i}", cold),
                "rayhpc FSDP2": lambda work, i: rayhpc(args, work, f"fsdp{i}", cold, strategy="fsdp")}
    # the Llama task as the baseline runs it: its own hyperparameters, the corpus of --gpt-bytes, Adam (the default)
    job = {"task": LLAMA, "hparams": {"corpus_bytes": args.gpt_bytes}} if args.llama else None
    return {"torchrun + plain DDP": lambda work, i: baseline(args, work),
            "rayhpc DDP": lambda work, i: rayhpc(args, work, f"rayhpc{i}", cold, job=job),
            "plain Ray Train TorchTrainer": lambda work, i: baseline(args, work, ray_train=True),
            UP: lambda work, i, up: rayhpc(args, work, f"up{i}", up, job=job),
            "rayhpc DDP, Ray Train defaults": lambda work, i: rayhpc(args, work, f"defaults{i}",
                                                                    {**cold, **RAY_TRAIN_DEFAULTS}, job=job)}


def _median(results: list[dict]) -> dict:
    keys = ("first_step_s", "samples_per_s", "fit_s", "mfu", "data_wait_share")
    return {**{key: statistics.median(r[key] for r in results) for key in keys},
            "detail": " | ".join(r["detail"] for r in results if r["detail"])}  # where each run's start-up went


if __name__ == "__main__":
    main()
