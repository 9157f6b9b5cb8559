"""Ray inside a Slurm allocation: cluster configs, the sbatch startup, submit and status."""
