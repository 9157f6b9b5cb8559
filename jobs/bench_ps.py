"""Parameter server against all-reduce: PS sync, PS async (Downpour) and DDP on the same task, data order
and epochs, for 2 and 4 workers (and on GPUs when present), in one run.

    python jobs/bench_ps.py                                  # the built-in MLP, hidden 256, 2 and 4 workers
    python jobs/bench_ps.py --hp hidden=1024,depth=4 --servers 2 --staleness 2
    python jobs/bench_ps.py --address auto --workers 2,4,8

Per run: median samples/s, seconds of training to a target validation loss (default: the worst of the
runs' best, so that every run reaches it), and the bytes each worker moves per step, measured for the
parameter server, beside the formulas: PS 2 x model; ring all-reduce 2 (n - 1) / n x model.
"""

import argparse

from bench.ps_compare import compare, format_table

from rayhpc import cluster
from rayhpc.cli import key_value_pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    p.add_argument("--servers", type=int, default=1, help="parameter servers")
    p.add_argument("--staleness", type=int, default=None, help="async bound K (default: unbounded)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size-per-worker", type=int, default=32)
    p.add_argument("--optimizer", default="sgd", help="the optimizer of both runs (SGD: Downpour's)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hp", default="hidden=256,depth=3", help="the task's hyperparameters")
    p.add_argument("--task", default="mlp")
    p.add_argument("--target", type=float, default=None, help="validation loss to reach")
    p.add_argument("--address", default=None)
    a = p.parse_args()
    address = cluster.resolve_address(a.address)
    res = cluster.connect(address)
    workers = [int(n) for n in a.workers.split(",")]
    gpu_counts = [n for n in workers if n <= res.gpus]
    base = {"task": a.task, "epochs": a.epochs, "batch_size_per_worker": a.batch_size_per_worker,
            "optim": {"optimizer": a.optimizer, "lr": a.lr}, "hparams": key_value_pairs("--hp", [a.hp]), "address": address}
    table, target = compare(workers, base, a.servers, a.staleness, gpu_counts, a.target)
    print(f"{res.describe()}; task {a.task} {a.hp}, {a.epochs} epochs of {a.batch_size_per_worker} samples per "
          f"worker per step, {a.servers} server(s), async staleness {a.staleness if a.staleness is not None else 'unbounded'}")
    print(format_table(table, target))


if __name__ == "__main__":
    main()
