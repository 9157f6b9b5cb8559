"""rayhpc: Ray-based sweeps and distributed PyTorch training, locally and on Slurm clusters.

What to import (each name has its own help):

    from rayhpc.task import Task                    # optional base class of a task: model(hp), data(hp), loss(...)
    from rayhpc.tune import SweepConfig, run_sweep  # a sweep of a task; run_sweep returns its results table
    from rayhpc.train import TrainConfig, run_training          # DDP / FSDP2 training with Ray Train
    from rayhpc.parallel import ParallelConfig, run_parallel    # TP, PP and sharded DP on the worker group
    from rayhpc.ps.config import PSConfig                       # the parameter server's config ...
    from rayhpc.ps.driver import run_ps                         # ... and its run
    from rayhpc.engine.checkpoint import load_full_state_dict    # any job's checkpoint as one state dict

A config is the same tree as the job's YAML file (every command-line flag is one of its keys) and is checked
when it is built; every run starts a local Ray of its own unless the config names a cluster (`address`) or
`RAY_ADDRESS` does. The command line: `rayhpc --help`.
"""

__version__ = "0.1.0"
