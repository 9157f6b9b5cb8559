"""The pipeline-bubble and GPT-layout tables of `jobs/bench_parallel.py`.

Bubble: the measured idle share per pipeline rank for every schedule at several microbatch
counts, beside the schedule's formula (`bench.bubble`), on an MLP whose layers are
spread over p x v stages (v stages per rank for the interleaved and zero-bubble schedules; the
whole model is the same for every schedule). GPT: the example task's training throughput
(tokens/s) under each layout that fits the cluster, and its validation bits per byte.
"""

from __future__ import annotations

import logging
import statistics
import tempfile

from bench.bubble import measure_bubble
from rayhpc.parallel import ParallelConfig, run_parallel
from rayhpc.parallel.pp import SCHEDULES
from rayhpc.workers import WorkerGroup


def bubble_configs(pp: int, counts: list[int], microbatch_size: int, hidden: int, steps: int,
                   gpu: bool) -> list[ParallelConfig]:
    """One config per (schedule, microbatch count) that torch's schedule accepts: 1F1B, the interleaved
    and zero-bubble schedules need at least one microbatch per stage, the interleaved ones a count that
    their rounds divide."""
    base = dict(steps=steps, compute={"gpu": gpu}, hparams={"hidden": hidden, "depth": 4 * pp},
                data={"synthetic": {"num_samples": 2 * microbatch_size * max(counts) + 8}})
    cfgs = []
    for schedule in SCHEDULES:
        for m in counts:
            if schedule != "gpipe" and m < pp:
                continue
            if schedule.startswith("interleaved") and m % max(1, m // pp):
                continue
            cfgs.append(ParallelConfig(parallelism={"pp": pp, "schedule": schedule, "microbatches": m},
                                       global_batch_size=m * microbatch_size, **base))
    return cfgs


def print_bubble_table(cfgs: list[ParallelConfig], data, gpu: bool) -> None:
    pp = cfgs[0].parallelism.pp
    print(f"{'schedule':>15} {'v':>2} {'m':>3} {'step ms':>8} {'idle by rank':>14} {'idle':>6} {'formula':>8} "
          f"{'diff':>7} {'F/B/W ms per chunk':>20}")
    with WorkerGroup(pp, cpus_per_worker=1.0, gpus_per_worker=float(gpu), timeout_s=300) as group:
        for cfg in cfgs:
            r = measure_bubble(group, cfg, data)
            ranks = " ".join(f"{v:.3f}" for v in r["idle"].values())
            chunk = "/".join(f"{r['chunk_ms'][k]:.2f}" for k in "FBW")
            p = cfg.parallelism
            print(f"{p.schedule:>15} {p.per_rank_stages:>2} {p.n_microbatches:>3} {r['step_s'] * 1e3:>8.1f} "
                  f"{ranks:>14} {r['mean_idle']:>6.3f} {r['formula']:>8.3f} {r['mean_idle'] - r['formula']:>+7.3f} "
                  f"{chunk:>20}", flush=True)


GPT_LAYOUTS = {  # name: (degrees and schedule, ranks)
    "1 process": ({}, 1),
    "tp2": ({"tp": 2}, 2),
    "fsdp2": ({"fsdp": 2}, 2),
    "pp2 1f1b": ({"pp": 2, "schedule": "1f1b"}, 2),
    "pp2 interleaved1f1b": ({"pp": 2, "schedule": "interleaved1f1b"}, 2),
    "pp2 zbv": ({"pp": 2, "schedule": "zbv"}, 2),
    "tp2 x pp2": ({"tp": 2, "pp": 2, "schedule": "1f1b"}, 4),
    "fsdp2 x tp2": ({"fsdp": 2, "tp": 2}, 4),
}


def print_gpt_table(task: str, hparams: dict, steps: int, batch_size: int, microbatches: int, cpus: float,
                    gpus: float, address: str | None) -> None:
    """Each layout that gets a whole CPU (or GPU) per rank on this cluster: median tokens/s over the steps
    after the first, and the validation loss in bits per byte after the last."""
    gpu = gpus > 0
    room = gpus if gpu else cpus
    per_sample = hparams["block"]
    print(f"\nGPT ({task.rsplit('/', 1)[-1]}, {hparams}): batch {batch_size} x {per_sample} bytes, {steps} steps, "
          f"{microbatches} microbatches for pipelines")
    print(f"{'layout':>20} {'ranks':>5} {'step ms':>8} {'tokens/s':>10} {'val bits/byte':>14}")
    with tempfile.TemporaryDirectory(prefix="rayhpc-bench-") as storage:
        for name, (layout, ranks) in GPT_LAYOUTS.items():
            if ranks > room:
                print(f"{name:>20} {ranks:>5}  skipped: {ranks} ranks, the cluster has {room:g} {'GPUs' if gpu else 'CPUs'}")
                continue
            pipeline = {"microbatches": microbatches} if layout.get("pp") else {}
            cfg = ParallelConfig(task=task, hparams=hparams, optim={"optimizer": "adam", "lr": 1e-3}, steps=steps,
                                 global_batch_size=batch_size, storage_path=storage, name=name.replace(" ", "_"),
                                 parallelism={**layout, **pipeline}, address=address,
                                 compute={"gpu": gpu, "cpus_per_worker": 1.0})
            result = run_parallel(cfg, log_level=logging.DEBUG)
            median = statistics.median(result.step_seconds[1:] or result.step_seconds)
            bits = result.validation.get("val_bits_per_byte", float("nan")) if result.validation else float("nan")
            print(f"{name:>20} {ranks:>5} {median * 1e3:>8.1f} {batch_size * per_sample / median:>10,.0f} "
                  f"{bits:>14.3f}", flush=True)
