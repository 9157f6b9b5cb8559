"""The rows of `jobs/bench_sweep.py --pack-choice TASK,...`: each task's sweep three ways on one local Ray, side by
side: the default (the sweep measures a packed step against the members' steps in turn and packs only where it is
faster), `--pack 1` (unpacked) and `--pack N` (forced packs that fill the CPUs once): wall, and the default's over
the faster of the other two (the goal: at most 1.0x, within the machine's noise)."""

from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path


def pack_choice_rows(tasks: list[str], trials: int, epochs: int, cpus: int) -> list[tuple[str, str, float, int]]:
    """(task, way, wall seconds, Tune trials) of each task's sweep, each way."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.sweep import run_sweep

    said = logging.getLogger("rayhpc.tune.sweep")  # the default's first line: which, and why
    said.setLevel(logging.INFO)
    said.addHandler(logging.StreamHandler())
    out = []
    with tempfile.TemporaryDirectory(prefix="bench_pack_choice_") as work:
        # untimed: the first sweep of a process pays for imports and Ray's first workers
        run_sweep(SweepConfig(name="warm-up", storage_path=Path(work), num_samples=2, epochs=1))
        for task in tasks:
            for way, pack in (("default", None), ("--pack 1", 1), (f"--pack {math.ceil(trials / cpus)}",
                                                                    math.ceil(trials / cpus))):
                cfg = SweepConfig(name=f"{len(out)}", task=task, storage_path=Path(work), num_samples=trials,
                                  epochs=epochs, pack=pack, search="random", space={"lr": {"loguniform": [1e-3, 1e-1]}})
                start = time.perf_counter()
                table = run_sweep(cfg)
                out.append((task, way, time.perf_counter() - start, int(table["pack_size"].count() / table["pack_size"].mean())))
    return out


def step_ratios(tasks: list[str], members: tuple[int, ...] = (2, 8)) -> None:
    """Print each task's packed training step over its members' steps in turn (`step_seconds`, what a sweep decides
    by) at batch 32 with one thread, for each of `members`."""
    from rayhpc.data import DataConfig
    from rayhpc.task import task_for
    from rayhpc.task.batches import collate
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.packing import step_seconds

    print("\na training step packed / the members' steps in turn (batch 32, 1 thread)\n")
    for spec in tasks:
        task = task_for(spec, DataConfig())
        hp = SweepConfig(task=spec).defaults(task.hp_model)
        batch = collate(task.split_data(hp, DataConfig())[0], range(8))  # the check batch: 8 samples
        cells = []
        for n in members:
            packed, alone = step_seconds(task, hp, batch, n, threads=1)
            cells.append(f"{n} members {packed * 1e3:.1f} / {alone * 1e3:.1f} ms = {packed / alone:.2f}x")
        print(f"{spec.rsplit('/', 1)[-1]:32s} " + "; ".join(cells), flush=True)


def print_pack_choice(rows: list[tuple[str, str, float, int]], trials: int, epochs: int) -> None:
    print(f"\npacked or not: {trials} trials of each task, {epochs} epochs each\n")
    print(f"{'task':40s} {'sweep':10s} {'wall':>8s} {'Tune trials':>12s} {'default / best other':>21s}")
    for task, way, wall, tune_trials in rows:
        others = [w for t, n, w, _ in rows if t == task and n != "default"]
        default = next(w for t, n, w, _ in rows if t == task and n == "default")
        ratio = f"{default / min(others):20.2f}x" if way == "default" else ""
        print(f"{task.rsplit('/', 1)[-1]:40s} {way:10s} {wall:7.1f}s {tune_trials:12d} {ratio}", flush=True)
