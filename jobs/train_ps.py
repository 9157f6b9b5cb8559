"""Training with a parameter server on Ray actors: parameters sharded over servers, workers pull and push.

    python jobs/train_ps.py --mode sync --num-workers 2 --num-servers 2         # equals DDP
    python jobs/train_ps.py --mode async --num-workers 4 --staleness 2           # Downpour, bounded staleness
    python jobs/train_ps.py --task jobs/tasks/digits.py:Digits --mode async --gpu
    python jobs/train_ps.py --name run1 --resume                                 # from the latest checkpoint

metrics.parquet (per epoch), steps.parquet (per worker step: staleness, pull/push ms, bytes) and the
servers' checkpoints: <storage-path>/<name>/.
"""

from rayhpc.cli import ps_main
from rayhpc.entry import run_main

if __name__ == "__main__":
    run_main(ps_main)
