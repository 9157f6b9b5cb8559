"""What a sweep finds is what every job trains. One configuration (the dropout test task, AdamW with weight
decay, a warm-up then a cosine decay to a floor, clipping that bites, 2 micro-batches per step, a seed, a
last batch of each epoch that is partial) trains as plain PyTorch ranks do (`helpers.plain_ranks`: torch's own
optimizer, schedulers, `clip_grad_norm_`, `DistributedSampler`, `DataLoader` and dropout, each rank drawing
its own masks) on every runner of `rayhpc.engine`. Here: an array task (each epoch's val_loss and training
loss) and the parameter server in sync mode on 1 worker. The other runners (a sweep trial unpacked and as one
member of a pack of 4, a warm worker group's trial, `rayhpc train` on 1 worker and DDP and FSDP2 on 2,
`rayhpc parallel` with dp 2, the parameter server on 2 workers) are proven on the same configuration by
test_resume, each started from its command, killed, stopped and resumed, against the same references: a run
that trained otherwise uninterrupted could not end there. Each must end with the reference's weights of its
number of ranks, its validation loss and training loss after every epoch, and, where the job records them,
its loss at every step.

`rayhpc parallel` with tp 2 runs the built-in MLP (a task with a TP plan and no dropout: under tensor
parallelism each rank holds half of the hidden units, so no dropout mask of a plain module can match it)
against one plain process (`helpers.plain_trial`)."""

from __future__ import annotations

import dataclasses
import logging

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from helpers import EPOCHS, FIXED, ROOT, mlp_split, plain_ranks, plain_trial
from rayhpc.config import validate
from rayhpc.data import DataConfig
from rayhpc.task import task_for

TASK = f"{ROOT / 'tests' / 'tasks' / 'dropout.py'}:Dropout"
LR, SEED, BATCH = 0.03, 3, FIXED["batch_size"]  # 240 training samples: 7 steps of 32 and one of 16 an epoch
OPTIM = {"optimizer": "adamw", "lr": LR, "weight_decay": FIXED["weight_decay"], "beta1": FIXED["beta1"],
         "clip_grad_norm": FIXED["clip_grad_norm"]}
SCHEDULE = {k: FIXED[k] for k in ("warmup_steps", "decay", "min_lr_ratio")}
SECTIONS = {"optim": OPTIM, "schedule": SCHEDULE, "accumulate": FIXED["accumulate"], "seed": SEED}
HPARAMS = {"width": 16, "p": 0.25, "step_ms": 0.0}


@pytest.fixture(scope="module")
def reference():
    """The plain run of one rank, which every runner of one rank must equal (the parameter server's too)."""
    return plain_ranks(1, LR, SEED)


def hparams(task, hp: dict = HPARAMS) -> dict:
    """The configuration as one trial's hyperparameters."""
    from rayhpc.task.hparams import full_hparams

    flat = {**OPTIM, **SCHEDULE, "accumulate": FIXED["accumulate"], "seed": SEED}
    return full_hparams(task.hp_model, {**flat, **hp, "batch_size": BATCH})


def job(cls, tmp_path, name: str, workers: int, task: str = TASK, hp: dict = HPARAMS, **kw):
    return validate(cls, {"storage_path": str(tmp_path), "name": name, "epochs": EPOCHS, "hparams": hp, "task": task,
                          "compute": {"num_workers": workers}, "global_batch_size": BATCH, **SECTIONS, **kw})


@dataclasses.dataclass
class Got:
    weights: dict
    val: list  # each epoch's val_loss
    train: list  # each epoch's training loss


def epochs_of(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics[metrics["kind"] == "epoch"] if "kind" in metrics else metrics


# each runner: what it trained, in `Got`

def array_task(tmp_path) -> Got:
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.single import train_alone

    task, seen = task_for(TASK, DataConfig()), []
    got = train_alone(task, hparams(task), SweepConfig(epochs=EPOCHS), folder=tmp_path / "trial",
                      then=lambda values, epoch: seen.append(values))
    return Got(got["model"].state_dict(), [v["val_loss"] for v in seen], [v["train_loss"] for v in seen])


def parallel(tmp_path, task: str = TASK, hp: dict = HPARAMS, **degrees) -> Got:
    from rayhpc.parallel.config import ParallelConfig
    from rayhpc.parallel.trainer import run_parallel

    cfg = job(ParallelConfig, tmp_path, "parallel", 2, task=task, hp=hp, parallelism=degrees)
    result = run_parallel(cfg, log_level=logging.DEBUG)
    epochs = epochs_of(pd.read_parquet(cfg.experiment_dir / "metrics.parquet"))
    return Got(result.weights, epochs["val_loss"].tolist(), epochs["loss"].tolist())


def parameter_server(tmp_path, workers: int) -> Got:
    from rayhpc.ps.config import PSConfig
    from rayhpc.ps.driver import run_ps

    result = run_ps(job(PSConfig, tmp_path, f"ps{workers}", workers, mode="sync"))
    epochs = epochs_of(result.metrics)
    return Got(result.weights, epochs["val_loss"].tolist(), epochs["loss"].tolist())


pytestmark = pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers), which balances the two sessions

RUNNERS = {  # name: (ranks, runner); the others in test_resume
    "array task": (1, array_task),
    "ps sync 1 worker": (1, lambda tmp: parameter_server(tmp, 1)),
}


@pytest.mark.parametrize("runner", RUNNERS)
def test_one_configuration_trains_the_same_on_every_runner(runner, reference, ray_address, tmp_path):
    world, run = RUNNERS[runner]
    got, want = run(tmp_path), reference
    close(runner, "val_loss", got.val, [v for v, _ in want.epochs])
    close(runner, "training loss", got.train, [t for _, t in want.epochs])
    same_weights(runner, got.weights, want.weights)


def test_tensor_parallel_trains_as_one_plain_process(ray_address, tmp_path):
    """tp 2 on the built-in MLP: its final weights and each epoch's val_loss are one plain process's."""
    mlp = task_for("mlp", DataConfig())
    hp = hparams(mlp, {"hidden": 16})
    train, val = mlp_split(mlp)
    weights, history = plain_trial(mlp.initial_model(hp), train, val, hp, EPOCHS, F.mse_loss)
    got = parallel(tmp_path, task="mlp", hp={"hidden": 16}, tp=2)
    close("parallel tp 2", "val_loss", got.val, [float(h[0]) for h in history])
    same_weights("parallel tp 2", got.weights, weights)


def close(runner: str, what: str, got: list, want: list) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7, msg=lambda m: f"{runner}, {what}: {m}")


def same_weights(runner: str, got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (runner, sorted(got), sorted(want))
    for key, value in want.items():
        torch.testing.assert_close(got[key].float(), value.float(), msg=lambda m: f"{runner} {key}: {m}")
