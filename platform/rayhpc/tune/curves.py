"""Each member of a pack its own TensorBoard curves, in the trial's folder beside Ray Tune's events.

A pack reports its members' values as lists (`rayhpc.tune.trainable._metrics`), which Tune keeps no
statistics of; Tune's own TensorBoard logger writes those lists as histograms, so this driver callback
writes each member's values as scalars under the tags Tune would give a nested result
(`ray/tune/members/<j>/<name>`), at Tune's step (the trial's `training_iteration`).

Each result is one event holding every member's values: a scalar per event (`SummaryWriter.add_scalar`)
took 21.6 s of a 4,096-trial sweep's 112 s in the driver, which writes every trial's curves, and one event a
result took 8x less in a micro-benchmark (2,000 results of 32 values: 5.5 s against 0.7 s).
"""

from __future__ import annotations

import math
from numbers import Number

from ray.tune.logger import LoggerCallback

from rayhpc.tune.trainable import member_values


class MemberCurves(LoggerCallback):
    """Tune callback: a TensorBoard event file writer per running packed trial, closed when the trial ends."""

    def __init__(self):
        self._writers: dict = {}

    def __getstate__(self):  # pickled with the tuner for --resume: writers open again
        return {}

    def __setstate__(self, state):
        self._writers = {}

    def log_trial_result(self, iteration: int, trial, result: dict):
        members = result.get("members")
        if not members:  # a trial that is not a pack (Tune over Train)
            return
        # Ray Tune's own dependency (its TensorBoard logger)
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary

        writer = self._writers.get(trial)
        if writer is None:
            trial.init_local_path()  # Tune's logger folder of the trial, synced to the sweep's storage
            # a suffix of its own: Tune's writer in the same folder may open in the same second
            writer = self._writers[trial] = FileWriter(trial.local_path, flush_secs=30, filename_suffix=".members")
        values = [Summary.Value(tag=f"ray/tune/members/{j}/{name}", simple_value=value)
                  for j in range(len(next(iter(members.values()))))
                  for name, value in member_values(members, j).items()
                  if isinstance(value, Number) and not math.isnan(value)]
        writer.add_summary(Summary(value=values), global_step=result["training_iteration"])

    def log_trial_end(self, trial, failed: bool = False):
        writer = self._writers.pop(trial, None)
        if writer is not None:
            writer.close()

    def on_experiment_end(self, trials, **info):
        for trial in list(self._writers):
            self.log_trial_end(trial)
