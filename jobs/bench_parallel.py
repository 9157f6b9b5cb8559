"""Pipeline-bubble benchmark: measured idle share per stage for GPipe and 1F1B at several
microbatch counts, beside the formula (p - 1) / (m + p - 1).

    python jobs/bench_parallel.py                          # p = 2 stages, m = 1, 2, 4, 8
    python jobs/bench_parallel.py --pp 4 --microbatches 4,8,16 --address auto

Each stage should have its own core(s): the formula assumes stages run concurrently, so on
this 2-core machine p = 2. Idle = 1 - (time in the stage's forward/backward) / (step time).
"""

import argparse

from rayhpc import cluster
from rayhpc.bench.bubble import measure_bubble
from rayhpc.parallel import ParallelConfig
from rayhpc.parallel.trainer import make_recipe
from rayhpc.workers import WorkerGroup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", default="1,2,4,8", help="comma-separated microbatch counts")
    p.add_argument("--microbatch-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096, help="MLP width: sets the compute per microbatch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting (median)")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--address", default=None)
    a = p.parse_args()
    counts = [int(m) for m in a.microbatches.split(",")]
    base = dict(pp=a.pp, steps=a.steps, compute={"gpu": a.gpu}, model={"hidden": a.hidden, "depth": 2 * a.pp},
                data={"synthetic": {"num_samples": 2 * a.microbatch_size * max(counts) + 8}})
    cfgs = [ParallelConfig(schedule=s, microbatches=m, batch_size=m * a.microbatch_size, **base)
            for s in ("gpipe", "1f1b") for m in counts if s == "gpipe" or m >= a.pp]  # 1F1B needs m >= p
    cluster.connect(cluster.resolve_address(a.address))
    import ray

    data = ray.put(make_recipe(cfgs[-1])[1])
    print(f"{a.pp} stages of 2 Linear layers (width {a.hidden}), microbatches of {a.microbatch_size} samples, "
          f"median of {a.steps} steps\n")
    print(f"{'schedule':>8} {'m':>3} {'step ms':>8} {'idle by stage':>20} {'idle':>6} {'formula':>8} {'diff':>7}")
    with WorkerGroup(a.pp, cpus_per_worker=1.0, gpus_per_worker=float(a.gpu), timeout_s=300) as group:
        for cfg in cfgs:
            r = measure_bubble(group, cfg, data)
            stages = " ".join(f"{v:.3f}" for v in r["idle"].values())
            rel = (r["mean_idle"] - r["formula"]) / r["formula"] if r["formula"] else float("nan")
            print(f"{cfg.schedule:>8} {cfg.n_microbatches:>3} {r['step_s'] * 1e3:>8.1f} {stages:>20} "
                  f"{r['mean_idle']:>6.3f} {r['formula']:>8.3f} {rel:>+7.1%}", flush=True)


if __name__ == "__main__":
    main()
