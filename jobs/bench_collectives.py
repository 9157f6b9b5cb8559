"""Collective-primitive benchmark on the platform's worker group: broadcast, scatter, gather,
all_gather, reduce, all_reduce, reduce_scatter, all_to_all and send/recv, 1 KiB .. --max-size.

    python jobs/bench_collectives.py                                   # 2 CPU ranks, gloo, up to 4 MiB
    python jobs/bench_collectives.py --num-workers 3 --primitives all_reduce,all_gather
    python jobs/bench_collectives.py --gpu --num-workers 8 --max-size 1GiB   # NCCL, one GPU per rank

Each primitive is checked against the expected values before it is timed (a wrong one is reported,
not timed). Time is the slowest rank's mean; algbw = size / time; busbw = algbw x the nccl-tests
factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all, scatter, gather (n-1)/n;
broadcast, reduce, send/recv 1). Writes <storage-path>/<name>/collectives.parquet and a busbw plot.
"""

from rayhpc.cli import collectives_main
from rayhpc.entry import run_main

if __name__ == "__main__":
    run_main(collectives_main)
