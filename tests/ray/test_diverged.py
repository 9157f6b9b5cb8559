"""A run whose loss stops being finite: a training job (Ray Train, the model-parallel worker group, the
parameter server) ends at the step it diverged at with one `error:` line naming that step and the last finite
loss, nothing of that step reported or saved; a sweep marks the member `diverged` and its pack trains on.
The step and the losses are a plain PyTorch loop's, written here (tests/tasks/diverging.py)."""

import math

import pandas as pd
import pytest
import torch

from helpers import ROOT, run_job, sweep
from rayhpc.engine.checkpoint import latest_checkpoint, load_progress
from rayhpc.tune.sweep import run_sweep

pytestmark = pytest.mark.newest  # CI: beside the Slurm tests, to balance its two sessions (pyproject's markers)
TASK = f"{ROOT}/tests/tasks/diverging.py:Diverging"
STEPS_PER_EPOCH = 4  # 32 training samples, 8 a step


def plain_losses(lr: float, steps: int) -> list[float]:
    """Each step's loss, SGD on the task's one weight (its loss w^2 whatever the batch), in float32."""
    w = torch.ones(1, 1, requires_grad=True)
    opt, losses = torch.optim.SGD([w], lr=lr), []
    for _ in range(steps):
        opt.zero_grad()
        loss = w.pow(2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


JOBS = {
    "train": ("train_mlp.py", "--num-workers", "2", "--batch-size-per-worker", "4"),
    "parallel": ("train_parallel.py", "--global-batch-size", "8"),
    "ps": ("train_ps.py", "--num-workers", "1", "--num-servers", "1", "--batch-size-per-worker", "8"),
}


@pytest.mark.parametrize("job", JOBS)
def test_a_training_job_whose_loss_is_not_finite_ends_there_with_one_line(job, ray_address, tmp_path):
    """SGD at lr 500.5 over 3 epochs of 4 steps: the plain loop's first loss that is not finite is at step 8,
    the last of epoch 2. The job exits 1 with one line naming step 8 and step 7's loss; its metrics hold epoch 1
    alone and its last checkpoint is step 4's (Ray Train's retries, from that checkpoint, diverge alike)."""
    losses = plain_losses(500.5, 3 * STEPS_PER_EPOCH)
    first = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    assert first + 1 == 8 and math.isfinite(losses[first - 1])
    script, *args = JOBS[job]
    proc = run_job(script, "--task", TASK, *args, "--optimizer", "sgd", "--lr", "500.5", "--epochs", "3",
                   "--name", "diverged", "--storage-path", str(tmp_path), "--address", ray_address)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], proc.stderr
    named = (f"error: {'worker 0: ' if job == 'ps' else ''}the loss is not finite (nan or inf) at optimizer step "
             f"{first + 1}, its last finite loss {losses[first - 1]:.6g} at step {first}: the run diverged; ")
    assert errors[0].startswith(named), (named, errors[0])
    if job != "ps":  # (the parameter server keeps its rows and checkpoints in its servers' terms)
        rows = pd.read_parquet(tmp_path / "diverged" / "metrics.parquet")
        assert list(rows["global_step"]) == [STEPS_PER_EPOCH], rows
        assert load_progress(latest_checkpoint(tmp_path / "diverged")).global_step == STEPS_PER_EPOCH


@pytest.mark.parametrize("pack, workers", [(1, 1), (2, 1), (1, 2)])
def test_a_sweep_marks_a_diverged_trial_and_trains_the_others_on(pack, workers, ray_address, tmp_path):
    """A grid of lr 0.01 and 500.5, packed or not, or each trial on 2 workers (a warm group): the second is
    `diverged` at epoch 2 (its loss inf at step 8), its values not finite; the first finishes its 3 epochs, its
    val_loss the plain loop's weight's after 12 steps (the loss of a 13th)."""
    table = run_sweep(sweep(tmp_path, name="grid", task=TASK, search="grid", epochs=3, pack=pack,
                            workers_per_trial=workers, cpus_per_trial=1 / workers,
                            global_batch_size=8, optim={"optimizer": "sgd"}, space={"lr": {"grid": [0.01, 500.5]}}))
    rows = table.set_index("config.lr")
    assert rows.loc[500.5, "status"] == "diverged" and rows.loc[500.5, "iterations"] == 2, table
    assert not math.isfinite(rows.loc[500.5, "val_loss"])
    assert rows.loc[0.01, "status"] == "finished" and rows.loc[0.01, "iterations"] == 3, table
    torch.testing.assert_close(rows.loc[0.01, "val_loss"], plain_losses(0.01, 3 * STEPS_PER_EPOCH + 1)[-1],
                               rtol=1e-5, atol=0)
    assert set(table["pack_size"]) == {pack}
