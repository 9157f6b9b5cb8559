"""Every job's epoch rows are one row (`rayhpc.engine.metrics.metrics_row`: the same columns first, in one order)
and hold the best so far of the task's objective and of val_loss (`rayhpc.engine.loop.Best`): here `rayhpc train`,
the parameter server and the model-parallel job, for a task whose objective is a metric to maximise, as sweeps
report theirs (test_sweep)."""

import pandas as pd
import pytest

from helpers import run_job

pytestmark = pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)

SCORED = '''
import torch.nn.functional as F

from rayhpc.task.mlp import MLPTask


class Scored(MLPTask):
    objective = ("val_score", "max")

    def metrics(self, model, batch):
        x, y = batch
        return {"score": -F.mse_loss(model(x), y)}
'''


# every job's row begins so (then the job's own columns)
COLUMNS = ["kind", "epoch", "global_step", "loss", "samples_per_s", "step_ms", "world_size", "global_batch_size",
           "batch_size_per_worker", "lr", "val_loss", "val_score", "best_val_score", "best_val_loss"]


@pytest.mark.parametrize("script, args", [("train_mlp.py", ["--num-workers", "1"]),
                                          ("train_ps.py", ["--num-workers", "1"]),
                                          ("train_parallel.py", ["--dp", "1"])])
def test_epoch_rows_hold_the_best_so_far_of_the_objective_and_of_val_loss(script, args, ray_address, tmp_path):
    task = tmp_path / "scored.py"
    task.write_text(SCORED)
    proc = run_job(script, "--task", f"{task}:Scored", "--epochs", "4", "--address", ray_address,
                   "--storage-path", str(tmp_path), "--name", "scored", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = pd.read_parquet(tmp_path / "scored" / "metrics.parquet")
    assert list(rows.columns[:len(COLUMNS)]) == COLUMNS, list(rows.columns)
    rows = rows[rows["kind"] == "epoch"]
    assert rows["epoch"].tolist() == [1, 2, 3, 4] and (rows["world_size"] == 1).all(), rows
    assert len(rows) == 4 and rows["val_score"].nunique() == 4, rows
    assert rows["best_val_score"].tolist() == rows["val_score"].cummax().tolist(), rows
    assert rows["best_val_loss"].tolist() == rows["val_loss"].cummin().tolist(), rows
