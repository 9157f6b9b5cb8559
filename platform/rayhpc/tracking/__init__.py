"""Experiment tracking: every trial of a sweep (each member of a pack, warm-group and array trials too) and
every training run becomes a run in MLflow or Weights & Biases, written off the training path
(`rayhpc.tracking.runs`). Sweeps log from the driver (`rayhpc.tune.tracking`), training jobs from rank 0.
W&B writes offline by default (compute nodes seldom reach the internet); `rayhpc sync` uploads later."""
