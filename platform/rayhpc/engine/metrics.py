"""Every job's metrics row (`metrics_row`) and the run's own record of them: `metrics.parquet`, one row per epoch
(and per K steps).

Ray Train 2.60 keeps in `Result.metrics` only what was reported with a
checkpoint, and nothing of earlier epochs, so the platform records every
report itself. The recorder runs in Ray Train's controller process, which
outlives worker-group restarts; a restarted group repeats the steps after its
checkpoint, and their new rows replace the old ones. Ray Train registers a
checkpoint (and prunes the one before) before it calls the recorder, so a
controller killed in between leaves a checkpoint whose rows the table lacks: a
resumed run's rank 0 sends them again with its first report (the checkpoint's
extra state holds them), and they replace the table's rows from their first on.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pandas as pd

from rayhpc import log as rayhpc_log
from rayhpc.engine.loop import DIVERGED_FIX, Best, Diverged
from rayhpc.private import replace_whole

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.parquet"
TENSORBOARD_DIR = "tensorboard"  # `tensorboard --logdir <run_dir>/tensorboard`
EARLIER_ROWS = "earlier_rows"  # a report's key: the step rows held back since the last report, in order
EVENT_SCALARS = ("loss", "best_val_loss", "samples_per_s", "step_ms", "lr")  # and every val_* value


def metrics_row(kind: str, epoch: int, step: int, loss: float, samples_per_s: float, step_ms: float,
                batch: tuple[int, int, int], lr: float | None = None, values: dict | None = None,
                best: Best | None = None, **own) -> dict:
    """Every job's metrics row (`kind` "epoch" at each epoch's end, "step" every K steps), in one order: its epoch
    (1-based) and global step, the mean loss over its samples, the rates over every worker, the batch (`batch`:
    workers, the global batch, each worker's share), the lr of its last step (None: the task's own scheduler sets
    it), the validation `values`, the best so far of the task's objective and of val_loss (`best`, updated with
    them), then the job's own columns (`own`)."""
    values = values or {}
    if not math.isfinite(values.get("val_loss", 0.0)):  # the weights, or a norm's running statistics
        best = "" if best is None or "val_loss" not in best.so_far else \
            f", its best before {best.so_far['val_loss']:.6g}"
        raise Diverged(f"val_loss is {values['val_loss']} after optimizer step {step} (epoch {epoch}){best}: "
                       f"{DIVERGED_FIX}")
    world, global_batch, per_worker = batch
    return {"kind": kind, "epoch": epoch, "global_step": step, "loss": loss, "samples_per_s": samples_per_s,
            "step_ms": step_ms, "world_size": world, "global_batch_size": global_batch,
            "batch_size_per_worker": per_worker, **({} if lr is None else {"lr": lr}), **values,
            **(best.update(values) if best is not None and "val_loss" in values else {}), **own}


def report_rows(metrics: dict) -> list[dict]:
    """A report's metrics rows in order: the step rows held back since the last report, then its own."""
    row = dict(metrics)
    return [*row.pop(EARLIER_ROWS, []), row]


class MetricsRecorder:
    """Appends rank 0's metrics of every report to `metrics.parquet` and TensorBoard events, and
    logs one line per epoch at `log_level` (under Ray Train in its controller process, whose output shows the
    platform's INFO lines: `rayhpc.train.trainer.RecordReports`)."""

    def __init__(self, run_dir: Path, epochs: int | None, log_level: int = logging.INFO):
        self.path = Path(run_dir) / METRICS_FILE
        self.epochs, self.log_level = epochs, log_level
        self.rows: list[dict] | None = None  # loaded lazily: a resumed run keeps its earlier rows
        self.tensorboard = Path(run_dir) / TENSORBOARD_DIR

    def record(self, metrics: dict) -> None:
        """Rank 0's report, and the step rows it carries (held back: `rayhpc.train.loop.Worker.report`)."""
        rows = report_rows(metrics)
        row = rows[-1]
        if self.rows is None:
            self.rows = pd.read_parquet(self.path).to_dict("records") if self.path.exists() else []
        self._add(rows)
        replace_whole(self.path, lambda tmp: pd.DataFrame(self.rows).to_parquet(tmp, index=False))
        if row["kind"] == "epoch":
            if self.log_level >= logging.INFO:
                rayhpc_log.show()
            values = "".join(f", {k} {v:.4g}" for k, v in row.items() if k.startswith("val_") and v is not None)
            of = f"/{self.epochs}" if self.epochs else ""  # None: a run of `steps`
            log.log(self.log_level, f"epoch {row['epoch']}{of}: loss {row['loss']:.4g}{values}, "
                     f"{row['samples_per_s']:,.0f} samples/s, {row['step_ms']:.2f} ms/step "
                     f"({row['world_size']} workers, {row['global_batch_size']} samples a step)")

    def _add(self, rows: list[dict]) -> None:
        """`rows` in place of the table's from their first on (a restarted group's repeated steps replace the
        rows it wrote before), each also as TensorBoard events."""
        if not rows:
            return
        step, kind = rows[0]["global_step"], rows[0]["kind"]
        self.rows = [r for r in self.rows if r["global_step"] < step or (r["global_step"] == step and r["kind"] != kind)]
        for new in rows:
            self.rows.append(new)
            self._write_events(new)

    def _write_events(self, row: dict) -> None:
        """The report's scalars as TensorBoard events (tensorboardX ships with Ray Tune), in a file of their own.

        Written before the report returns: SummaryWriter queues events for a background thread that only
        `close` waits for, and Ray Train ends the controller right after the last report, losing what was
        queued. So each report's writer is closed at once (TensorBoard reads every event file of the folder).
        """
        from tensorboardX import SummaryWriter  # TensorBoard events only

        self.tensorboard.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(self.tensorboard), filename_suffix=f".{row['global_step']}.{row['kind']}")
        try:
            for key in (*EVENT_SCALARS, *(k for k in row if k.startswith("val_"))):
                if row.get(key) is not None:
                    writer.add_scalar(f"{row['kind']}/{key}", row[key], row["global_step"], walltime=time.time())
        finally:
            writer.close()

