"""The training engine every runner calls: `fit` (the loop: a run's steps epoch by epoch, resumed where it
stopped, its reports, checkpoints and validations at the cadence it asks, the best so far) and `train_step`
(one optimizer step over micro-batches, for anything trained: a module, a pack, pipeline stages on a mesh,
a parameter server's gradient sink), and beside them `checkpoint` (every job's checkpoint folders: save,
load, latest, prune, RNG states), `metrics` (the run's `metrics.parquet`) and `parallelize` (DDP, FSDP2,
compile and activation checkpointing)."""

from rayhpc.engine.loop import Best, Diverged, Plan, Runner, Window, fit
from rayhpc.engine.step import Module, Trained, split_batch, train_step

__all__ = ["Best", "Diverged", "Module", "Plan", "Runner", "Trained", "Window", "fit", "split_batch", "train_step"]
