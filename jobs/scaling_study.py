"""Strong and weak scaling of DDP training, before choosing a process count.

    python jobs/scaling_study.py                                   # 1 and 2 CPU workers, local Ray
    python jobs/scaling_study.py --workers 1,2,4,8 --gpu           # one GPU per worker
    rayhpc submit --cluster cluster_configs/X.yaml --nodes 2 -- python -u jobs/scaling_study.py --workers 1,2,4

Strong: a fixed global batch (--global-batch-size) split over the workers; weak: a fixed batch per
worker (--batch-size-per-worker). Each (mode, workers) is one run of the training job; throughput
is the median samples/s over the epochs after the first. Writes <storage-path>/<name>/scaling.parquet
and scaling.png (throughput and efficiency; a dashed line where the workers spanned several nodes).
"""

from rayhpc.cli import scaling_main
from rayhpc.entry import run_main

if __name__ == "__main__":
    run_main(scaling_main)
