"""What a parameter-server run has done: the workers' step records, `metrics.parquet` rows per epoch
(through the training job's recorder: the same columns, TensorBoard events and log line), `steps.parquet`
(one row per worker step: the staleness actually seen, pull and push times, bytes), and its checkpoints."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import pandas as pd

from rayhpc.config import Optim, Schedule
from rayhpc.engine import checkpoint
from rayhpc.engine.loop import Best
from rayhpc.engine.metrics import METRICS_FILE, MetricsRecorder, metrics_row
from rayhpc.optim import lr_factor
from rayhpc.private import replace_whole

log = logging.getLogger(__name__)
STEPS_FILE = "steps.parquet"
# the record of a step whose worker died before reporting it (see `Progress.mark_lost`)
LOST = dict.fromkeys(("time", "pull_s", "compute_s", "push_s", "wait_s", "loss", "staleness", "bytes"),
                     float("nan")) | {"versions": [], "zero_copy": True, "lost": True}


def checkpoint_steps(cfg, steps_per_epoch: int, total_steps: int) -> list[int]:
    """The steps after which the servers save: each epoch's end, every `checkpoint.every`, and the last."""
    every = cfg.checkpoint.every or steps_per_epoch
    return sorted({*range(steps_per_epoch, total_steps + 1, steps_per_epoch), *range(every, total_steps + 1, every),
                   total_steps})


def mark_complete(cfg) -> Path:
    """Give every checkpoint folder that holds all the servers' shards the progress file that marks a
    checkpoint complete (`rayhpc.engine.checkpoint`, whose finder then finds it); returns the run's folder."""
    for folder in cfg.experiment_dir.glob("checkpoint_*"):
        shards = [folder / checkpoint.SERVER_DIR.format(index=j) for j in range(cfg.compute.num_servers)]
        if not (folder / checkpoint.PROGRESS_FILE).exists() and all((s / checkpoint.PROGRESS_FILE).exists()
                                                                    for s in shards):
            checkpoint.write_progress(folder, checkpoint.Progress(global_step=checkpoint_step(folder)))
    return cfg.experiment_dir


def latest_checkpoint(cfg) -> Path | None:
    """The complete checkpoint furthest into training (None before the first)."""
    return checkpoint.latest_checkpoint(mark_complete(cfg))


def checkpoint_step(folder: Path | None) -> int:
    return int(folder.name.removeprefix("checkpoint_")) if folder is not None else 0


def epoch_loss(folder: Path | None) -> tuple[float, int]:
    """(loss x samples, samples) over every worker, of the checkpoint's epoch up to its step (server 0 keeps
    them: `rayhpc.ps.server`)."""
    if folder is None:
        return 0.0, 0
    kept = checkpoint.load_extra(folder / checkpoint.SERVER_DIR.format(index=0))["losses"]
    return sum(total for _, total, _ in kept), sum(n for *_, n in kept)


class Progress:
    def __init__(self, cfg, made: dict, started: float, objective: tuple[str, str] = ("val_loss", "min")):
        """`made`: the run's plan (`rayhpc.ps.driver.plan_run`); `objective`: the task's (name, mode), whose
        best so far every epoch's row holds, as every job's does."""
        self.cfg, self.per_epoch, self.validates, self.started = cfg, made["steps_per_epoch"], made["validates"], started
        self.total, self.epochs = made["total_steps"], made["epochs"]
        self.optim, self.schedule = Optim.of(made["hp"]), Schedule.of(made["hp"])
        self.records: dict[tuple[int, int], dict] = {}  # (worker, step) -> record
        self.val: dict[int, dict] = {}  # epoch -> validation metrics
        self.recorder = MetricsRecorder(cfg.experiment_dir, self.epochs)
        self.steps_path = cfg.experiment_dir / STEPS_FILE
        self.next_epoch = 0  # the first epoch without a metrics row
        self.objective = objective
        self.best = Best(objective)
        self.restored, self.before = 0, (0.0, 0)
        self.epoch_ended: float | None = None  # unix time; None: from the first step of this session
        self.track: Callable[[int, dict], None] | None = None  # the job's tracked run's log (`tracking:`)

    def restart_at(self, step: int, before: tuple[float, int] = (0.0, 0)) -> None:
        """Forget what comes after `step` (restored from a checkpoint): it will be computed again. Epochs
        that ended by `step` without a row (a driver killed between the checkpoint and the row) get one;
        the validation of an epoch that ended before `step` is gone with its weights. `before`: the loss x
        samples and samples of the epoch of step `step` - 1 up to `step` (`epoch_loss`)."""
        self.records = {k: r for k, r in self.records.items() if k[1] < step}
        self.restored = step  # steps before it count as done, recorded or not (a killed driver's last steps)
        self.before = before
        rows = pd.DataFrame()
        if self.cfg.experiment_dir.joinpath(METRICS_FILE).exists():
            rows = pd.read_parquet(self.cfg.experiment_dir / METRICS_FILE)
            rows = rows[rows["global_step"] <= step]
        self.next_epoch = min(step // self.per_epoch, int(rows["epoch"].max()) if len(rows) else 0)
        self.val = {e: v for e, v in self.val.items() if e < self.next_epoch}
        self.val.update({e: {} for e in range(self.next_epoch, step // self.per_epoch) if self.end_of(e) < step})
        if len(rows):  # the best so far of the rows kept (the ones after `step` are computed again)
            pick = {"min": min, "max": max}
            modes = {"val_loss": "min", self.objective[0]: self.objective[1]}
            self.best = Best(self.objective, {name: float(pick[mode](rows[f"best_{name}"]))
                                              for name, mode in modes.items() if f"best_{name}" in rows})
        if self.steps_path.exists() and not self.records:  # a resumed job: the records of earlier sessions
            done = pd.read_parquet(self.steps_path)
            self.records = {(r["worker"], r["step"]): r for r in done[done["step"] < step].to_dict("records")}

    def end_of(self, epoch: int) -> int:
        """The global step that ends `epoch` (the last one may be cut short by `steps`)."""
        return min((epoch + 1) * self.per_epoch, self.total)

    def validations_due(self, step: int) -> list[int]:
        """The epochs whose validation is still to come after a (re)start at `step`."""
        return [e for e in range(self.next_epoch, self.epochs) if e not in self.val and self.end_of(e) >= step]

    def add(self, result: dict) -> None:
        """One worker's `run_epoch` result, or the evaluator's (`val`); writes the rows of every epoch
        now complete."""
        for record in result.get("records", ()):
            self.records[(record["worker"], record["step"])] = record
        if "val" in result:
            self.val[result["epoch"]] = result["val"]
        while self.next_epoch < self.epochs and self._complete(self.next_epoch):
            self._write_row(self.next_epoch)
            self.next_epoch += 1

    def mark_lost(self, worker: int, before: int, samples_of: Callable[[int], int]) -> list[int]:
        """The steps before `before` that `worker` pushed to every server but died before reporting (its
        records went with its process): kept as `lost` rows, counted in the epoch's samples, not its means."""
        lost = [s for s in range(self.restored, before) if (worker, s) not in self.records]
        for s in lost:
            self.records[(worker, s)] = dict(LOST, worker=worker, step=s, samples=samples_of(s))
        return lost

    def _complete(self, epoch: int) -> bool:
        steps = range(max(epoch * self.per_epoch, self.restored), self.end_of(epoch))
        return all((w, s) in self.records for w in range(self.cfg.compute.num_workers) for s in steps) \
            and (epoch in self.val or not self.validates)

    def _write_row(self, epoch: int) -> None:
        cfg, per_epoch = self.cfg, self.per_epoch
        every = [r for (w, s), r in self.records.items() if epoch * per_epoch <= s < self.end_of(epoch)]
        # timings and losses from the steps measured; without any (every step of it was run by a driver
        # killed before recording it, or by workers that died), NaN
        recs = [r for r in every if not r["lost"]] or [dict(LOST, samples=0)]
        ended = max(r["time"] for r in recs)
        began = self.epoch_ended or min(r["time"] - r["pull_s"] - r["compute_s"] - r["push_s"] for r in recs)
        seconds = max(ended - began, 1e-9)
        self.epoch_ended = ended if ended == ended else self.epoch_ended
        samples = sum(r["samples"] for r in every)
        mean = lambda key: sum(r[key] for r in recs) / len(recs)  # noqa: E731
        pull, compute, push = (1000 * mean(key) for key in ("pull_s", "compute_s", "push_s"))
        row = metrics_row("epoch", epoch + 1, self.end_of(epoch), self._loss(epoch, recs), samples / seconds,
                          pull + compute + push, (cfg.compute.num_workers, cfg.global_batch, cfg.per_worker_batch),
                          self.optim.lr * lr_factor(self.schedule, self.end_of(epoch) - 1, self.total),
                          self.val.get(epoch, {}), self.best, pull_ms=pull, push_ms=push, compute_ms=compute,
                          staleness_max=max(r["staleness"] for r in recs), staleness_mean=mean("staleness"),
                          bytes_per_step=mean("bytes"), zero_copy=all(r["zero_copy"] for r in recs),
                          train_seconds=ended - self.started, num_servers=cfg.compute.num_servers, mode=cfg.mode)
        self.recorder.record(row)
        if self.track is not None:
            self.track(row["global_step"], row)
        if not self.records:  # every step so far ran in a session killed before it recorded them
            return
        # whole or not at all: a job stopped while it writes (Ctrl-C, a preemption) must leave a table its
        # resume can read
        table = pd.DataFrame(sorted(self.records.values(), key=lambda r: (r["step"], r["worker"])))
        replace_whole(self.steps_path, lambda tmp: table.to_parquet(tmp, index=False))

    def _loss(self, epoch: int, recs: list[dict]) -> float:
        """The epoch's mean loss per sample: the epoch a restart fell into counts what its checkpoint kept of
        the steps before the restart (whether this driver still holds their records or not) and its records
        after; any other epoch, the steps measured."""
        total, n = self.before if epoch * self.per_epoch < self.restored <= self.end_of(epoch) else (0.0, 0)
        counted = [r for r in recs if not n or r.get("step", -1) >= self.restored]
        n += sum(r["samples"] for r in counted)
        return (total + sum(r["loss"] * r["samples"] for r in counted)) / n if n else float("nan")

    def table(self) -> pd.DataFrame:
        path = self.cfg.experiment_dir / METRICS_FILE
        return pd.read_parquet(path) if path.exists() else pd.DataFrame()

    def steps_table(self) -> pd.DataFrame:
        return pd.read_parquet(self.steps_path) if self.steps_path.exists() else pd.DataFrame()

    def prune(self) -> None:
        """Keep the newest `checkpoint.keep` complete checkpoints (and anything newer, being written)."""
        checkpoint.prune(mark_complete(self.cfg), self.cfg.checkpoint.keep)
