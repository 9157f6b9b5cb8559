"""64 small trials three ways on the same share of one machine, side by side: packed (one batched model, one
trial process holding the whole share), as Tune trials sharing it 8 at a time (Tune's fractional resources:
0.125 GPU each on a GPU, 1/8 of the CPUs each without), and one at a time (each trial the whole share). Trials
per hour each, and the packed run's over the other two (docs/gpu.md; HFTA reports up to 15x for packed small
models on one V100 or A100).

    python jobs/bench/packed_vs_fractional.py [--tasks mlp,gpt] [--trials 64] [--epochs 2] [--gpu]

Without `--gpu` the share is this machine's CPUs (a trial's CPUs are its torch threads). The MLP is the
built-in task; the GPT is `jobs/tasks/gpt.py:GPT` on the first 20,000 bytes of its corpus. One local Ray for
all runs, started first (its start is not counted); each run is `run_sweep` on it, random search, no scheduler.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

# the task, and its space (None: the task's own)
TASKS = {"mlp": ("mlp", None), "gpt": (str(Path(__file__).resolve().parents[1] / "tasks" / "gpt.py") + ":GPT",
                                       {"lr": {"loguniform": [1e-4, 3e-2]}, "corpus_bytes": {"choice": [20000]}})}


def ways(trials: int, share: float, gpu: bool) -> dict[str, dict]:
    """Each way's sweep settings: the share is one GPU, or `share` CPUs."""
    if gpu:
        return {"packed": {"pack": trials, "gpus_per_trial": 1.0, "max_concurrent": 1},
                "8 at a time": {"pack": 1, "gpus_per_trial": 0.125, "max_concurrent": 8},
                "one at a time": {"pack": 1, "gpus_per_trial": 1.0, "max_concurrent": 1}}
    return {"packed": {"pack": trials, "cpus_per_trial": share, "max_concurrent": 1},
            "8 at a time": {"pack": 1, "cpus_per_trial": share / 8, "max_concurrent": 8},
            "one at a time": {"pack": 1, "cpus_per_trial": share, "max_concurrent": 1}}


def run(task: str, space: dict | None, trials: int, epochs: int, how: dict, storage: Path) -> float:
    """Seconds of one sweep of `trials` trials, each `epochs` epochs, on the Ray this process started."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.sweep import run_sweep

    cfg = SweepConfig(task=task, space=space, num_samples=trials, epochs=epochs, storage_path=storage, name=f"{Path(task).stem}-{how['pack']}-{how['max_concurrent']}", **how)
    started = time.perf_counter()
    table = run_sweep(cfg)
    seconds = time.perf_counter() - started
    if (table["status"] != "finished").any():
        raise RuntimeError(f"{cfg.name}: not every trial finished: {table['status'].value_counts().to_dict()}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="mlp,gpt", help="of " + ", ".join(TASKS))
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="the share is one GPU (else this machine's CPUs)")
    args = parser.parse_args()
    import logging

    from rayhpc.cluster import disconnect, start_local

    logging.getLogger("rayhpc").setLevel(logging.WARNING)
    cpus = os.cpu_count() or 1
    share = "one GPU" if args.gpu else f"{cpus} CPUs"
    start_local(num_cpus=cpus, num_gpus=1 if args.gpu else 0, logging_level="WARNING", log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="packed-vs-fractional-") as tmp:
        try:
            print(f"{args.trials} trials of {args.epochs} epochs on {share}: trials per hour (seconds)", flush=True)
            for name in args.tasks.split(","):
                task, space = TASKS[name]
                seconds = {way: run(task, space, args.trials, args.epochs, how, Path(tmp) / "runs")
                           for way, how in ways(args.trials, cpus, args.gpu).items()}
                rates = {way: 3600 * args.trials / s for way, s in seconds.items()}
                cells = "  ".join(f"{way} {rates[way]:,.0f} ({seconds[way]:.1f} s)" for way in seconds)
                print(f"{name}: {cells}; packed over 8 at a time {rates['packed'] / rates['8 at a time']:.2f}x, "
                      f"over one at a time {rates['packed'] / rates['one at a time']:.2f}x", flush=True)
        finally:
            disconnect()


if __name__ == "__main__":
    main()
