"""A training run's `metrics.parquet` keeps every row across a resume, also where the run was killed after Ray
Train registered a checkpoint but before the recorder had written that report's rows (Ray Train calls the
checkpoint manager first). (The real runs: tests/ray/test_resume.py.)"""

from __future__ import annotations

import pandas as pd
import torch

from rayhpc.engine.checkpoint import EXTRA_FILE, Progress, write_progress
from rayhpc.engine.metrics import EARLIER_ROWS, METRICS_FILE, MetricsRecorder


def step_row(step: int) -> dict:
    return {"kind": "step", "global_step": step, "loss": 1.0 / step}


def checkpoint(run, name: str, step: int, rows: list[dict]) -> None:
    """A complete checkpoint folder as a training run's report leaves it: its rows, then its progress."""
    folder = run / name
    folder.mkdir()
    torch.save({"rows": rows}, folder / EXTRA_FILE)
    write_progress(folder, Progress(global_step=step))


def report(run, first: int, last: int) -> None:
    """A resumed run's first report (a new recorder, as in a new controller): steps `first`..`last`, the
    earlier ones held back."""
    rows = [step_row(s) for s in range(first, last + 1)]
    MetricsRecorder(run, epochs=None).record({**rows[-1], EARLIER_ROWS: rows[:-1]})


def table(run) -> list[tuple[int, float]]:
    rows = pd.read_parquet(run / METRICS_FILE)
    return list(zip(rows["global_step"], rows["loss"]))


def test_a_resume_takes_the_rows_the_table_lacks_from_the_checkpoint_it_resumed_from(tmp_path):
    pd.DataFrame([step_row(s) for s in (1, 2, 3)]).to_parquet(tmp_path / METRICS_FILE, index=False)
    checkpoint(tmp_path, "checkpoint_000000", 3, [step_row(s) for s in (1, 2, 3)])
    checkpoint(tmp_path, "checkpoint_000001", 6, [step_row(s) for s in (4, 5, 6)])  # registered, not recorded
    # saved, never registered: the resume starts from step 6, so its rows do not count
    checkpoint(tmp_path, "checkpoint_000002", 9, [{**step_row(s), "loss": -1.0} for s in (7, 8, 9)])
    report(tmp_path, 7, 8)
    assert table(tmp_path) == [(s, 1.0 / s) for s in range(1, 9)]


def test_a_resume_whose_table_has_its_checkpoints_rows_and_a_fresh_run_add_only_their_reports(tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    report(fresh, 1, 2)
    assert table(fresh) == [(1, 1.0), (2, 0.5)]
    # the table has the checkpoint's rows, and a later report's (4, with no checkpoint) that the resume repeats
    pd.DataFrame([{**step_row(s), "loss": 7.0} if s == 2 else step_row(s) for s in (1, 2, 3, 4)]).to_parquet(
        tmp_path / METRICS_FILE, index=False)
    checkpoint(tmp_path, "checkpoint_000000", 3, [step_row(s) for s in (1, 2, 3)])
    report(tmp_path, 4, 5)
    assert table(tmp_path) == [(1, 1.0), (2, 7.0), (3, 1 / 3), (4, 0.25), (5, 0.2)]  # its rows left as they were
