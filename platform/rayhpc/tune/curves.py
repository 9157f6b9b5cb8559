"""Each member of a pack its own TensorBoard curves, in the trial's folder beside Ray Tune's events.

A pack reports its members' values as lists (`rayhpc.tune.trainable._metrics`), which Tune keeps no
statistics of; Tune's own TensorBoard logger writes those lists as histograms, so this driver callback
writes each member's values as scalars under the tags Tune would give a nested result
(`ray/tune/members/<j>/<name>`), at Tune's step (the trial's `training_iteration`).
"""

from __future__ import annotations

import math
from numbers import Number

from ray.tune.logger import LoggerCallback

from rayhpc.tune.trainable import member_values


class MemberCurves(LoggerCallback):
    """Tune callback: a TensorBoard writer per running packed trial, closed when the trial ends."""

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
        writer = self._writers.get(trial)
        if writer is None:
            from tensorboardX import SummaryWriter  # Ray Tune's own dependency (its TensorBoard logger)

            trial.init_local_path()  # Tune's logger folder of the trial, synced to the sweep's storage
            # a suffix of its own: Tune's writer in the same folder may open in the same second
            writer = self._writers[trial] = SummaryWriter(trial.local_path, flush_secs=30,
                                                          filename_suffix=".members")
        step = result["training_iteration"]
        for j in range(len(next(iter(members.values())))):
            for name, value in member_values(members, j).items():
                if isinstance(value, Number) and not math.isnan(value):
                    writer.add_scalar(f"ray/tune/members/{j}/{name}", value, global_step=step)

    def log_trial_end(self, trial, failed: bool = False):
        writer = self._writers.pop(trial, None)
        if writer is not None:
            writer.close()

    def on_experiment_end(self, trials, **info):
        for trial in list(self._writers):
            self.log_trial_end(trial)
