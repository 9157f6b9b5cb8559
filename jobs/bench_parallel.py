"""Model-parallel benchmark: the pipeline bubble of every schedule against its formula, and the
example GPT's tokens/s under each layout, in one run.

    python jobs/bench_parallel.py                          # p = 2 pipeline ranks, m = 1, 2, 4, 8
    python jobs/bench_parallel.py --pp 4 --microbatches 4,8,16 --address auto
    python jobs/bench_parallel.py --only gpt --gpt-hp dim=256,layers=8

Each pipeline rank should have its own core(s) (or GPU): the formulas assume ranks run
concurrently, so on a 2-core machine p = 2. Idle = 1 - (time in the stages' forward and backward
chunks) / (step time). GPT layouts with more ranks than the cluster has CPUs (GPUs) are skipped.
"""

import argparse
from pathlib import Path

from bench.parallel_layouts import bubble_configs, print_bubble_table, print_gpt_table

from rayhpc import cluster
from rayhpc.cli import key_value_pairs
from rayhpc.parallel.trainer import make_recipe

GPT = f"{Path(__file__).resolve().parent / 'tasks' / 'gpt.py'}:GPT"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("bubble", "gpt"), default=None, help="one of the two tables")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", default="1,2,4,8", help="comma-separated microbatch counts")
    p.add_argument("--microbatch-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="MLP width: sets the compute per microbatch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting (median)")
    p.add_argument("--gpt-hp", default="dim=128,layers=4,block=64", help="the GPT task's hyperparameters")
    p.add_argument("--gpt-steps", type=int, default=12)
    p.add_argument("--gpt-batch-size", type=int, default=32)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--address", default=None)
    a = p.parse_args()
    address = cluster.resolve_address(a.address)
    res = cluster.connect(address)
    if a.only in (None, "bubble"):
        import ray

        counts = [int(m) for m in a.microbatches.split(",")]
        cfgs = bubble_configs(a.pp, counts, a.microbatch_size, a.hidden, a.steps, a.gpu)
        print(f"{a.pp} pipeline ranks, an MLP of {4 * a.pp} Linear layers (width {a.hidden}) split into p x v "
              f"stages, microbatches of {a.microbatch_size} samples, median of {a.steps} steps\n")
        print_bubble_table(cfgs, ray.put(make_recipe(cfgs[-1])[1]), a.gpu)
    if a.only in (None, "gpt"):
        hp = {"block": 64, **key_value_pairs("--gpt-hp", [a.gpt_hp])}
        print_gpt_table(GPT, hp, a.gpt_steps, a.gpt_batch_size, 2, res.cpus, res.gpus if a.gpu else 0, address)


if __name__ == "__main__":
    main()
