"""Sweep benchmark: the same short trials run three ways on this machine, side by side.

    python jobs/bench_sweep.py [--trials 16] [--epochs 30] [--cpus 2]
    python jobs/bench_sweep.py --adaptive --trials 128     # random, ASHA, Optuna: packed and unpacked
    python jobs/bench_sweep.py --scale [--sizes 16,128,1024,10000] [--kill-after 120] [--study]
        # the default sweep at each size, one fresh driver each: wall, driver CPU per trial, peak driver
        # memory, files and bytes per trial, the results table's write; --kill-after: a sweep of the
        # largest size whose driver is SIGKILLed that many seconds in, then resumed
    python jobs/bench_sweep.py --tracking [--trials 128] [--epochs 10] [--repeats 2] [--samples 2048]
        # the default sweep untracked, to an MLflow file store and to W&B offline, each in a fresh driver,
        # alternated: wall, driver CPU, and the driver CPU tracking adds per trial-epoch (its writing thread's)
    python jobs/bench_sweep.py --seeds 5 [--trials 128] [--epochs 10] [--repeats 2]
        # the default sweep with one seed per configuration and with --seeds seeds (repeats), each in a fresh
        # driver, alternated: wall and its ratio (goal: 5 seeds x 128 configurations in <= 1.3x one seed's)
    python jobs/bench_sweep.py --pack-choice mlp,jobs/tasks/digits.py:DigitsCNN,jobs/tasks/gpt.py:GPT [--trials 4]
        # each task's sweep the default way (packed only where a measured packed step is faster), unpacked
        # (--pack 1) and packed (--pack trials/cpus), side by side: wall, and the default's over the faster other
    python jobs/bench_sweep.py --distributed [--trials 16] [--workers 2] [--epochs 5]
    python jobs/bench_sweep.py --first-result [--repeats 2]
        # the default sweep (`python jobs/tune_mlp.py`) and the 16-trial reference sweep below (30 epochs), each
        # cold (its own Ray) and with the user's cluster up (`rayhpc up`): wall, ideal / wall, and where the
        # wall goes (imports and config, task check, Ray, first result, work, shutdown, exit)
        # trials of 2 workers each, on warm worker groups

(a) array job: one fresh Python process per trial, `--cpus` at a time (what
    `sbatch --array=0-15%2` does), each running the plain PyTorch loop;
(b) plain Ray Tune: `Tuner.fit()` with default settings over the same loop,
    reporting and checkpointing every epoch;
(c) rayhpc: `run_sweep` on the same configs.
(b) and (c) run on one already-started local Ray; its start time is printed
apart. ideal = the trials' summed in-trial seconds, each trained alone in one
warm process with one thread, / CPUs: the makespan of a perfect scheduler with
no process start, imports, bookkeeping or contention at all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from rayhpc.cluster import disconnect, start_local
from rayhpc.task import task_for
from rayhpc.tune.config import SweepConfig, bind_sweep
from rayhpc.tune.plan import save_plan


def reference_seconds(cfg: SweepConfig, configs: list[dict]) -> float:
    """Summed in-trial seconds of every trial trained alone, in this warm process, one thread."""
    import torch

    from rayhpc.tune.single import train_alone

    torch.set_num_threads(1)
    task = task_for(cfg.task, cfg.data)
    # warm-up: first-call costs are not the trial's
    train_alone(task, configs[0], cfg.model_copy(update={"epochs": 1, "steps": None}))
    return sum(train_alone(task, hp, cfg)["train_seconds"] for hp in configs)


def array_style(cfg_file: Path, n: int, cpus: int, out: Path) -> tuple[float, float]:
    """Makespan and summed in-trial seconds of n fresh processes, cpus at a time."""
    cmd = [sys.executable, "-m", "rayhpc.tune.single", "--config", str(cfg_file), "--out", str(out)]
    start = time.perf_counter()
    with ThreadPoolExecutor(cpus) as pool:
        list(pool.map(lambda i: subprocess.run(cmd + ["--index", str(i)], check=True), range(n)))
    makespan = time.perf_counter() - start
    return makespan, sum(json.loads(f.read_text())["train_seconds"] for f in out.glob("*.json"))


def plain_tune(cfg: SweepConfig, configs: list[dict], storage: Path) -> tuple[float, float]:
    """Ray Tune with its defaults: one actor per trial, report + checkpoint per epoch."""
    from bench.plain_tuner import plain_trainable
    from ray import tune

    trainable = plain_trainable(task_for(cfg.task, cfg.data), cfg)
    tuner = tune.Tuner(trainable, param_space={"members": tune.grid_search([[hp] for hp in configs])},
                       run_config=tune.RunConfig(name="plain", storage_path=str(storage), verbose=0))
    start = time.perf_counter()
    grid = tuner.fit()
    makespan = time.perf_counter() - start
    return makespan, float(grid.get_dataframe()["train_seconds"].sum())


def rayhpc_sweep(cfg: SweepConfig) -> tuple[float, float, int]:
    from rayhpc.tune.sweep import run_sweep

    start = time.perf_counter()
    table = run_sweep(cfg)
    makespan = time.perf_counter() - start
    per_pack = table.groupby(table["trial_id"].str.split("-").str[0])["train_seconds"].first()
    return makespan, float(per_pack.sum()), len(per_pack)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16, help="trials (a grid of hidden x lr)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--adaptive", action="store_true", help="instead: random, ASHA and Optuna sweeps of "
                        "--trials trials (default sweep, --epochs, default 10 here), packed and unpacked")
    parser.add_argument("--no-unpacked", action="store_true", help="with --adaptive: packed rows only")
    parser.add_argument("--scale", action="store_true", help="instead: the default sweep at --sizes trials "
                        "(--epochs, default 10 here), each from a fresh driver")
    parser.add_argument("--sizes", default="16,128,1024,10000", help="with --scale: comma-separated trial counts")
    parser.add_argument("--study", action="store_true", help="with --scale: each sweep as the one slice of a study "
                        "(its packs checkpoint in the study folder, not in Tune's)")
    parser.add_argument("--kill-after", type=float, help="with --scale: also kill the largest sweep's driver this "
                        "many seconds in and resume it")
    parser.add_argument("--distributed", action="store_true", help="instead: --trials trials of --workers workers "
                        "(--epochs, default 5 here), on warm worker groups")
    parser.add_argument("--workers", type=int, default=2, help="with --distributed: workers per trial")
    parser.add_argument("--first-result", action="store_true", help="instead: time to first result, cold and "
                        "with the user's cluster up, of the default sweep and of the --trials reference sweep")
    parser.add_argument("--repeats", type=int, default=2, help="with --first-result or --tracking: runs of each "
                        "(medians)")
    parser.add_argument("--tracking", action="store_true", help="instead: the default sweep untracked, to MLflow "
                        "(file store) and to W&B (offline), side by side")
    parser.add_argument("--seeds", type=int, help="instead: the default sweep with one seed per configuration and "
                        "with this many (repeats), alternated")
    parser.add_argument("--samples", type=int, default=2048, help="with --tracking: rows of the synthetic data "
                        "(longer epochs)")
    parser.add_argument("--pack-choice", metavar="TASK[,TASK...]", help="instead: each task's sweep of --trials "
                        "trials the default way, unpacked and packed, side by side")
    args = parser.parse_args()
    if args.pack_choice:
        from bench.pack_choice import pack_choice_rows, print_pack_choice, step_ratios

        step_ratios(args.pack_choice.split(","))
        start_local(num_cpus=args.cpus, logging_level="WARNING", log_to_driver=False)
        rows = pack_choice_rows(args.pack_choice.split(","), args.trials, args.epochs, args.cpus)
        return print_pack_choice(rows, args.trials, args.epochs)
    if args.tracking:
        return tracking(args)
    if args.seeds:
        return seeds(args)
    if args.first_result:
        return first_result(args)
    if args.scale:
        return scale(args)
    if args.distributed:
        return distributed(args)
    if args.adaptive:
        from bench.adaptive_sweeps import adaptive_rows, print_adaptive

        epochs = args.epochs if "--epochs" in sys.argv else 10
        start_local(num_cpus=args.cpus, logging_level="WARNING", log_to_driver=False)
        print_adaptive(adaptive_rows(args.trials, epochs, not args.no_unpacked), args.trials, epochs)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    cfg, configs, cfg_file = reference_sweep(args, work)
    save_plan([[c] for c in configs], work)
    n = len(configs)
    print(f"sweep benchmark: {n} trials, {args.epochs} epochs each, {args.cpus} CPUs, work dir {work}", flush=True)

    ideal = reference_seconds(cfg, configs) / args.cpus
    rows = [("(a) array job, one process per trial", *array_style(cfg_file, n, args.cpus, work / "array"))]

    t = time.perf_counter()
    start_local(num_cpus=args.cpus, logging_level="WARNING", log_to_driver=False)
    ray_start = time.perf_counter() - t
    rows.append(("(b) plain Ray Tune (defaults)", *plain_tune(cfg, configs, work)))
    ours, in_trial, packs = rayhpc_sweep(cfg)
    rows.append((f"(c) rayhpc sweep ({packs} packs)", ours, in_trial))
    disconnect()

    print(f"\nray start: {ray_start:.1f} s (before (b) and (c), not in their makespans)")
    print(f"ideal: {ideal:.2f} s = summed in-trial seconds of the trials run alone / {args.cpus} CPUs\n")
    print(f"{'approach':42s} {'makespan':>9s} {'in-trial sum':>13s} {'makespan/ideal':>15s}")
    for name, makespan, summed in rows:
        print(f"{name:42s} {makespan:8.1f}s {summed:12.1f}s {makespan / ideal:14.2f}x")


def reference_sweep(args, work: Path, name: str = "ours") -> tuple[SweepConfig, list[dict], Path]:
    """The reference sweep (a grid of 4 widths x --trials/4 learning rates, --epochs), its trials, and its
    config file (what an array task, or `tune_mlp.py --config`, reads)."""
    lrs = [0.001 * 3 ** (i / 2) for i in range(args.trials // 4)]
    cfg = SweepConfig(name=name, storage_path=work, num_samples=1, search="grid", epochs=args.epochs,
                      space={"hidden": {"grid": [8, 16, 32, 64]}, "lr": {"grid": lrs}})
    task = task_for(cfg.task, cfg.data)
    cfg, _ = bind_sweep(cfg, task)
    cfg_file = work / f"{name}.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    return cfg, cfg.configs(task.hp_model), cfg_file


def first_result(args) -> None:
    """The default sweep and the reference sweep, cold and with the user's cluster up, side by side."""
    from bench.first_result import breakdown, cluster_up, cold, median, timed, timed_plain_tuner

    work = Path(tempfile.mkdtemp(prefix="bench_first_"))
    default_cfg = SweepConfig(storage_path=work)
    default_cfg, _ = bind_sweep(default_cfg, task_for(default_cfg.task, default_cfg.data))
    default_file = work / "default.yaml"
    default_file.write_text(yaml.safe_dump(default_cfg.model_dump(mode="json", exclude_none=True)))
    ref_cfg, ref_configs, ref_file = reference_sweep(args, work, "reference")
    sweeps = {"default sweep": (default_cfg, default_cfg.configs(task_for(default_cfg.task, default_cfg.data).hp_model),
                                [], default_file),
              f"{len(ref_configs)}-trial reference sweep": (ref_cfg, ref_configs, ["--config", str(ref_file)],
                                                            ref_file)}
    ideal = {name: reference_seconds(cfg, configs) / args.cpus for name, (cfg, configs, _, _) in sweeps.items()}
    script = [sys.executable, str(Path(__file__).with_name("tune_mlp.py"))]

    # the same sweep on your cluster however it is started: the script, the command, the module
    commands = {"cluster up": script, "up, rayhpc tune": [str(Path(sys.executable).with_name("rayhpc")), "tune"],
                "up, -m rayhpc tune": [sys.executable, "-m", "rayhpc", "tune"]}

    def run(name: str, how: str, i: int, env: dict | None) -> dict:
        flags, config = sweeps[name][2:]
        if env is None:  # plain Ray Tune
            return timed_plain_tuner(config, work, f"{how}-{len(flags)}-{i}")
        tag = f"{how.replace(' ', '').replace(',', '')}{len(flags)}-{i}"
        return timed([*commands.get(how, script), *flags, "--storage-path", str(work / tag)], env, work, tag)

    # alternating: each repeat runs every way once, so a machine that gets busier loads them alike; the user's
    # cluster is up only for its own runs (idle, it would load the machine under the others)
    hows = {"cold": cold(work), "plain Tuner": None}
    measured: dict[str, dict[str, list]] = {how: {name: [] for name in sweeps} for how in (*hows, *commands)}
    for i in range(args.repeats):
        for how, env in hows.items():
            for name in sweeps:
                measured[how][name].append(run(name, how, i, env))
        with cluster_up(work, args.cpus) as up_env:
            for how in commands:
                for name in sweeps:
                    measured[how][name].append(run(name, how, i, up_env))
    rows = {how: {name: median(results) for name, results in by_sweep.items()} for how, by_sweep in measured.items()}
    print(f"time to first result: {args.cpus} CPUs, medians of {args.repeats} alternating run(s); plain Tuner: "
          f"Ray Tune's defaults, a trial per configuration (jobs/bench/plain_tuner.py); ideal = the trials' summed "
          f"in-trial seconds alone / CPUs\n\n{'sweep':28s} {'how':18s} {'wall':>7s} {'ideal':>6s} {'ideal/wall':>11s}  "
          f"where the wall goes (s)")
    for name in sweeps:
        for how, measured in rows.items():
            r = measured[name]
            print(f"{name:28s} {how:18s} {r['wall']:6.1f}s {ideal[name]:5.1f}s {ideal[name] / r['wall']:10.2f}   "
                  f"{breakdown(r)}")
    for name in sweeps:  # the goal: the default sweep on your cluster at most 0.75x its wall cold
        print(f"\n{name}, wall on your cluster / cold: " + ", ".join(
            f"{how} {rows[how][name]['wall'] / rows['cold'][name]['wall']:.2f}x" for how in commands), end="")
    print()


def distributed(args) -> None:
    from bench.warm_sweeps import HEADER, distributed_row, print_row

    epochs = args.epochs if "--epochs" in sys.argv else 5
    start_local(num_cpus=args.cpus, logging_level="WARNING", log_to_driver=False)
    print(f"distributed trials: the default sweep, {args.trials} trials of {args.workers} workers (1 CPU each), "
          f"{epochs} epochs, {args.cpus} CPUs\n\n{HEADER}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_warm_") as work:
        print_row(distributed_row("warm", args.trials, epochs, args.workers, Path(work)))


def scale(args) -> None:
    from bench.scale_sweeps import HEADER, print_row, resumed_row, scale_rows

    epochs = args.epochs if "--epochs" in sys.argv else 10
    sizes = [int(n) for n in args.sizes.split(",")]
    ctx = start_local(num_cpus=args.cpus, logging_level="WARNING", log_to_driver=False)
    how = " as the one slice of a study" if args.study else ""
    print(f"scale: the default sweep{how} at {sizes} trials, {epochs} epochs each, {args.cpus} CPUs\n\n{HEADER}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as work:
        rows = scale_rows(sizes, epochs, ctx.address_info["gcs_address"], Path(work), study=args.study)
        # a plain sweep's goal: the largest's per-trial wall within 1.2x of each smaller one's
        b, per = max(rows, key=lambda r: r["trials"]), lambda r, key: r[key] / r["trials"]
        for a in (r for r in rows if r["trials"] < b["trials"]):
            print(f"\nper trial at {b['trials']:,} vs {a['trials']:,} trials: wall {per(b, 'wall_s') / per(a, 'wall_s'):.2f}x, "
                  f"driver CPU {per(b, 'driver_cpu_s') / per(a, 'driver_cpu_s'):.2f}x (goal <= 1.2x)", flush=True)
        if args.kill_after:
            r = resumed_row(sizes[-1], epochs, ctx.address_info["gcs_address"], Path(work) / "killed", args.kill_after)
            print(f"\nkilled after {r['killed_after_s']:g} s with {r['finished_before_kill']:,} trials finished; resumed: "
                  f"{r['kept']:,} of them kept (same train_seconds), {r['finished']:,} of {r['trials']:,} finished; "
                  f"the resumed driver:\n{HEADER}")
            print_row(r, epochs)


TRACKED = {"untracked": {}, "MLflow (file store)": {"mlflow": "file"}, "W&B (offline)": {"wandb": "bench"}}


def tracking(args) -> None:
    """The default sweep (`--trials`, default 128; `--epochs`, default 10) untracked and tracked, each way
    `--repeats` times in turn, each in a fresh driver process on one local Ray: medians side by side."""
    from statistics import median

    from bench.scale_sweeps import run_driver

    trials = args.trials if "--trials" in sys.argv else 128
    epochs = args.epochs if "--epochs" in sys.argv else 10
    ctx = start_local(num_cpus=args.cpus, logging_level="WARNING", log_to_driver=False)
    print(f"tracking: the default sweep, {trials} trials x {epochs} epochs of {args.samples} samples, {args.cpus} "
          f"CPUs, {args.repeats} runs of each, alternated (medians)", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in TRACKED}
    with tempfile.TemporaryDirectory(prefix="bench_tracking_") as work:
        for i in range(args.repeats):
            for name, section in TRACKED.items():
                sweep_name = f"{name.split()[0].lower().replace('&', '')}-{i}"
                runs[name].append(run_driver(trials, epochs, ctx.address_info["gcs_address"], Path(work),
                                             "--tracking", json.dumps(section), "--name", sweep_name,
                                             "--samples", str(args.samples)))
    disconnect()
    base = {k: median(r[k] for r in runs["untracked"]) for k in ("wall_s", "driver_cpu_s", "children_cpu_s")}
    n = trials * epochs
    print(f"\n{'':20s} {'wall':>7s} {'vs untracked':>12s} {'driver CPU':>10s} {'added/trial-epoch':>17s} "
          f"{'writer CPU':>10s} {'per trial-epoch':>15s}")
    for name, rows in runs.items():
        wall, cpu = median(r["wall_s"] for r in rows), median(r["driver_cpu_s"] for r in rows)
        writer = median(r["children_cpu_s"] for r in rows) - base["children_cpu_s"]
        print(f"{name:20s} {wall:6.1f}s {wall / base['wall_s']:11.3f}x {cpu:9.1f}s "
              f"{1000 * (cpu - base['driver_cpu_s']) / n:14.3f} ms {writer:9.1f}s {1000 * writer / n:12.3f} ms")
    print("\ngoal: added driver CPU <= 2 ms per trial-epoch, wall within 5% of untracked (1.050x); the writer "
          "process's CPU is beside it")


def seeds(args) -> None:
    """The default sweep (`--trials` configurations, default 128; `--epochs`, default 10) with one seed and with
    `--seeds` seeds per configuration, each `--repeats` times in turn in a fresh driver: medians side by side."""
    from statistics import median

    from bench.scale_sweeps import run_driver

    trials = args.trials if "--trials" in sys.argv else 128
    epochs = args.epochs if "--epochs" in sys.argv else 10
    ctx = start_local(num_cpus=args.cpus, logging_level="WARNING", log_to_driver=False)
    print(f"seeds: the default sweep, {trials} configurations x {epochs} epochs, {args.cpus} CPUs, 1 and "
          f"{args.seeds} seeds each, {args.repeats} runs of each, alternated (medians)", flush=True)
    runs: dict[int, list[dict]] = {1: [], args.seeds: []}
    with tempfile.TemporaryDirectory(prefix="bench_seeds_") as work:
        for i in range(args.repeats):
            for n in runs:
                runs[n].append(run_driver(trials, epochs, ctx.address_info["gcs_address"], Path(work),
                                          "--seeds", str(n), "--name", f"seeds{n}-{i}"))
    disconnect()
    base = median(r["wall_s"] for r in runs[1])
    print(f"\n{'seeds':>5s} {'runs':>6s} {'wall':>7s} {'vs 1 seed':>9s} {'per run':>9s}")
    for n, rows in runs.items():
        wall = median(r["wall_s"] for r in rows)
        print(f"{n:5d} {rows[0]['trials']:6d} {wall:6.1f}s {wall / base:8.3f}x {1000 * wall / rows[0]['trials']:6.1f} ms")
    print(f"\ngoal: {args.seeds} seeds in <= 1.3x the wall of one seed")


if __name__ == "__main__":
    main()
