"""Data-parallel training of the MLP with Ray Train: DDP or FSDP2, on CPUs (gloo) or GPUs (NCCL).

    python jobs/train_mlp.py --strategy ddp --num-workers 2
    python jobs/train_mlp.py --strategy fsdp --num-workers 4 --gpu --hidden 8192 --depth 4
    python jobs/train_mlp.py --global-batch-size 256 --scale-lr --epochs 20 --name run1
    python jobs/train_mlp.py --name run1 --resume          # continue from the latest checkpoint

Checkpoints and metrics.parquet: <storage-path>/<name>/.
"""

from rayhpc.cli import train_main
from rayhpc.entry import run_main

if __name__ == "__main__":
    run_main(train_main)
