"""A sweep's runs: one per trial, each member of a pack its own (a Tune trial is a whole pack, so Tune's
own MLflow and W&B callbacks would log packs). A Tune callback in the driver: each report's values per
member go to the tracker's queue (`rayhpc.tracking.runs`), and a run ends with its row's status in the
results table (finished, early-stopped, error; interrupted when a stop signal ended the sweep)."""

from __future__ import annotations

import functools
from pathlib import Path

from ray.tune import Callback

from rayhpc.tracking.runs import INTERRUPTED, RunInfo, start_tracker, tracking_home
from rayhpc.tune.results import trial_rows
from rayhpc.tune.trainable import member_values, members_of

# what a trial reports besides its values: progress and Tune's own bookkeeping
NOT_VALUES = {"epoch", "train_seconds", "resumed_from_epoch", "pack_size", "active_members", "stopped_epoch",
              "training_iteration", "time_this_iter_s", "time_total_s", "timestamp", "time_since_restore",
              "iterations_since_restore", "pid", "done", "trial_process_time", "trial_entered_time", "trial_ready_time"}


class SweepTracking(Callback):
    """Tune callback: every trial of the sweep as a tracked run (see the module)."""

    def __init__(self, cfg, packs, defaults: dict, tags: dict, columns: list[str], objective: tuple[str, str]):
        self.tracking, self.packs, self.defaults, self.epochs = cfg.tracking, packs, defaults, cfg.epochs
        self.name, self.storage, self.exp_dir = tracking_home(cfg)
        self.tags, self.columns, self.objective = tags, columns, objective
        self._reset()

    def _reset(self) -> None:
        self._tracker = None
        self._open: set[str] = set()  # runs started and not ended
        self._stopped: set[str] = set()  # members ASHA stopped: their values stay as they were

    def __getstate__(self):  # pickled with the tuner for --resume: the writer and runs start again
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def setup(self, **info):
        # its writer in a process of its own: the driver's event loop, which schedules every trial, only queues
        self._tracker = start_tracker(self.tracking, self.name, self.storage, self.exp_dir, process=True)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        members = members_of(trial.config, self.packs)
        per_member = result.get("members") or {}
        step = int(result.get("epoch", result.get("training_iteration", 0)))
        for j, hp in enumerate(members):
            key = run_key(trial.trial_id, j, len(members))
            if key in self._stopped:
                continue
            if key not in self._open:
                self._open.add(key)
                node = {"rayhpc.node": result["node"]} if "node" in result else {}
                self._tracker.open(RunInfo(key, f"{self.name}/{key}", {**self.defaults, **hp},
                                           {**self.tags, **node, "rayhpc.trial": key}))
            values = member_values(per_member, j) if per_member else result if len(members) == 1 else {}
            self._tracker.log(key, step, {k: v for k, v in values.items() if k not in NOT_VALUES})
            if values.get("stopped_epoch"):
                self._stopped.add(key)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._end(trial, "TERMINATED")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._end(trial, "ERROR")

    def _end(self, trial, tune_status: str, interrupted: bool = False) -> None:
        rows = trial_rows(trial, self.packs, self.epochs, [], self.columns, tune_status=tune_status)
        for j, row in enumerate(rows):
            key = run_key(trial.trial_id, j, len(rows))
            if key in self._open:
                self._open.discard(key)
                self._tracker.close(key, INTERRUPTED if interrupted else row["status"],
                                    self._artifact(trial, j) if self.tracking.log_checkpoint != "none" else None)

    def _artifact(self, trial, member: int):
        """The member's weights (last, or its best kept checkpoint), written to a folder when the writer asks."""
        from rayhpc.tune.export import write_checkpoint_artifact  # torch: only when checkpoints are logged

        folder, which, objective = Path(trial.path), self.tracking.log_checkpoint, self.objective
        hp = {**self.defaults, **members_of(trial.config, self.packs)[member]}
        return functools.partial(write_checkpoint_artifact, folder, member, hp, which, objective)

    def on_experiment_end(self, trials, **info):
        for trial in trials:  # trials a stop signal ended: a resumed sweep opens their runs again
            n = len(members_of(trial.config, self.packs))
            if any(run_key(trial.trial_id, j, n) in self._open for j in range(n)):
                self._end(trial, "TERMINATED", interrupted=True)
        if self._tracker is not None:
            self._tracker.shutdown()


def run_key(trial_id: str, member: int, members: int) -> str:
    """A run's key: the results table's trial id (`<tune trial>-<member>` in packs)."""
    return trial_id if members == 1 else f"{trial_id}-{member}"


def sweep_tracking(job, packs, columns: list[str]) -> list:
    """The sweep's tracking callback, or none."""
    cfg = job.cfg
    if not cfg.tracking.enabled:
        return []
    from rayhpc.tracking.runs import system_tags

    return [SweepTracking(cfg, packs, cfg.defaults(job.task.hp_model), system_tags(cfg.task, "sweep"), columns,
                          job.info.objective)]
