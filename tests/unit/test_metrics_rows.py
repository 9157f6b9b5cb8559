"""A training run's `metrics.parquet` keeps every row across a resume, also where the run was killed after Ray
Train registered a checkpoint but before the recorder had written that report's rows (Ray Train calls the
checkpoint manager first, which prunes the checkpoint before it). (The real runs: tests/ray/test_resume.py.)"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from rayhpc.engine.loop import Best, Diverged
from rayhpc.engine.metrics import EARLIER_ROWS, METRICS_FILE, MetricsRecorder, metrics_row


def step_row(step: int) -> dict:
    return {"kind": "step", "global_step": step, "loss": 1.0 / step}


def report(run, first: int, last: int) -> None:
    """A resumed run's first report (a new recorder, as in a new controller): steps `first`..`last`, the
    earlier ones held back."""
    rows = [step_row(s) for s in range(first, last + 1)]
    MetricsRecorder(run, epochs=None).record({**rows[-1], EARLIER_ROWS: rows[:-1]})


def table(run) -> list[tuple[int, float]]:
    rows = pd.read_parquet(run / METRICS_FILE)
    return list(zip(rows["global_step"], rows["loss"]))


def test_a_resumed_runs_first_report_replaces_the_tables_rows_from_the_checkpoints_on(tmp_path):
    """The resumed run's rank 0 sends its checkpoint's rows again (`rayhpc.train.loop`): where the table lacks
    them (a kill after Ray Train registered the checkpoint) they are added; where it has them, and rows after
    the checkpoint that the resume repeats, they are replaced; a fresh run adds its reports."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    report(fresh, 1, 2)
    assert table(fresh) == [(1, 1.0), (2, 0.5)]
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    pd.DataFrame([step_row(s) for s in (1, 2, 3)]).to_parquet(lacking / METRICS_FILE, index=False)
    report(lacking, 4, 8)  # the checkpoint at 6 held 4-6, never recorded; the resume trained 7 and 8
    assert table(lacking) == [(s, 1.0 / s) for s in range(1, 9)]
    pd.DataFrame([{**step_row(s), "loss": 7.0} if s >= 3 else step_row(s) for s in (1, 2, 3, 4)]).to_parquet(
        tmp_path / METRICS_FILE, index=False)
    report(tmp_path, 3, 5)  # the checkpoint at 3 held its row; 4 (no checkpoint) is repeated
    assert table(tmp_path) == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 0.25), (5, 0.2)]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_val_loss_that_is_not_finite_ends_the_run_at_its_row_naming_the_step_and_the_best_before(value):
    """Every job's epoch row (`metrics_row`): a validation whose val_loss is NaN or inf (weights, or a norm's
    running statistics) is the run's end, with the step, the epoch and the best val_loss so far; a finite one
    is a row."""
    best = Best(("val_loss", "min"))
    row = metrics_row("epoch", 1, 4, 0.5, 10.0, 1.0, (1, 8, 8), values={"val_loss": 0.25}, best=best)
    assert row["val_loss"] == row["best_val_loss"] == 0.25
    with pytest.raises(Diverged) as raised:
        metrics_row("epoch", 2, 8, 0.5, 10.0, 1.0, (1, 8, 8), values={"val_loss": value}, best=best)
    assert str(raised.value).startswith(f"val_loss is {value} after optimizer step 8 (epoch 2), its best before 0.25: "
                                        "the run diverged"), raised.value
