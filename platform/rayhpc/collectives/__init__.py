"""Collective-primitive benchmark on the platform's worker group (gloo on CPU, NCCL on GPU):
each primitive checked for correctness, then timed; bandwidths by the nccl-tests conventions.

    python jobs/bench_collectives.py --num-workers 2 --max-size 16MiB
"""
