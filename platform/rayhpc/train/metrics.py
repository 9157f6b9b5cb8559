"""The training run's own metrics record: `metrics.parquet`, one row per epoch (and per K steps).

Ray Train 2.60 keeps in `Result.metrics` only what was reported with a
checkpoint, and nothing of earlier epochs, so the platform records every
report itself. The recorder runs in Ray Train's controller process, which
outlives worker-group restarts; a restarted group repeats the steps after its
checkpoint, and their new rows replace the old ones.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from ray.train import UserCallback

METRICS_FILE = "metrics.parquet"


class MetricsRecorder(UserCallback):
    """Appends rank 0's metrics of every report to `metrics.parquet` and prints one line per epoch."""

    def __init__(self, run_dir: Path, epochs: int, verbose: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self.epochs, self.verbose = epochs, verbose
        self.rows: list[dict] | None = None  # loaded lazily: a resumed run keeps its earlier rows

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        row = dict(metrics[0])
        if self.rows is None:
            self.rows = pd.read_parquet(self.path).to_dict("records") if self.path.exists() else []
        step, kind = row["global_step"], row["kind"]
        self.rows = [r for r in self.rows
                     if r["global_step"] < step or (r["global_step"] == step and r["kind"] != kind)]
        self.rows.append(row)
        tmp = self.path.with_suffix(".tmp")
        pd.DataFrame(self.rows).to_parquet(tmp, index=False)
        tmp.replace(self.path)
        if kind == "epoch" and self.verbose:
            print(f"epoch {row['epoch']}/{self.epochs}: loss {row['loss']:.4g}, val_loss {row['val_loss']:.4g}, "
                  f"{row['samples_per_s']:,.0f} samples/s, {row['step_ms']:.2f} ms/step "
                  f"({row['world_size']} workers x {row['batch_size_per_worker']} samples)", flush=True)
