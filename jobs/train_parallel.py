"""Tensor-, pipeline- and data-parallel training on the platform's own group of Ray actors.

    python jobs/train_parallel.py --tp 2 --pp 2 --microbatches 8 --hp hidden=32,depth=4   # 4 ranks, the MLP
    python jobs/train_parallel.py --pp 2 --microbatches 8 --schedule 1f1b --hp depth=4
    python jobs/train_parallel.py --dp 2 --tp 2 --cpus-per-worker 0.5 --optimizer adamw --lr 1e-3 \
        --warmup-steps 5 --decay cosine --clip-grad-norm 1.0 --accumulate 2
    python jobs/train_parallel.py --task jobs/tasks/gpt.py:GPT --tp 2 --gpu
    python jobs/train_parallel.py --tp 2 --checkpoint-every 10 --name run1
    python jobs/train_parallel.py --name run1 --resume    # continue from the latest sharded checkpoint

World size = dp * pp * tp (TP innermost on the mesh). Checkpoints: <storage-path>/<name>/checkpoint_<step>/.
"""

from rayhpc.cli import parallel_main
from rayhpc.entry import run_main

if __name__ == "__main__":
    run_main(parallel_main)
