"""rayhpc: Ray-based sweeps and distributed PyTorch training, locally and on Slurm clusters."""

__version__ = "0.1.0"
