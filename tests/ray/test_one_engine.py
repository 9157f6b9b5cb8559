"""What a sweep finds is what every job trains. One configuration (the dropout test task, AdamW with weight
decay, a warm-up then a cosine decay to a floor, clipping that bites, 2 micro-batches per step, a seed, a
last batch of each epoch that is partial) trains as plain PyTorch ranks do (`helpers.plain_ranks`: torch's own
optimizer, schedulers, `clip_grad_norm_`, `DistributedSampler`, `DataLoader` and dropout, each rank drawing
its own masks) on every runner of `rayhpc.engine`: an array task, a sweep trial unpacked and as one member of
a pack of 4, a warm worker group's trial, `rayhpc train` on 1 worker and DDP and FSDP2 on 2, `rayhpc parallel`
with dp 2, and the parameter server in sync mode on 1 and 2 workers. Each must end with the reference's
weights of its number of ranks, its validation loss and training loss after every epoch, and, where the job
records them, its loss at every step.

`rayhpc parallel` with tp 2 runs the built-in MLP (a task with a TP plan and no dropout: under tensor
parallelism each rank holds half of the hidden units, so no dropout mask of a plain module can match it)
against one plain process (`helpers.plain_trial`)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from helpers import EPOCHS, FIXED, ROOT, mlp_split, plain_ranks, plain_trial, sweep
from rayhpc.config import validate
from rayhpc.data import DataConfig
from rayhpc.engine.checkpoint import latest_checkpoint, load_full_state_dict
from rayhpc.task import task_for

TASK = f"{ROOT / 'tests' / 'tasks' / 'dropout.py'}:Dropout"
LR, SEED, BATCH = 0.03, 3, FIXED["batch_size"]  # 240 training samples: 7 steps of 32 and one of 16 an epoch
OPTIM = {"optimizer": "adamw", "lr": LR, "weight_decay": FIXED["weight_decay"], "beta1": FIXED["beta1"],
         "clip_grad_norm": FIXED["clip_grad_norm"]}
SCHEDULE = {k: FIXED[k] for k in ("warmup_steps", "decay", "min_lr_ratio")}
SECTIONS = {"optim": OPTIM, "schedule": SCHEDULE, "accumulate": FIXED["accumulate"], "seed": SEED}
HPARAMS = {"width": 16, "p": 0.25, "step_ms": 0.0}


@pytest.fixture(scope="module")
def references():
    """(ranks, the parameter server's seeding) -> the plain run."""
    return {(world, ps): plain_ranks(world, LR, SEED, ps_seed if ps else None) for world in (1, 2) for ps in (0, 1)}


def ps_seed(seed: int, rank: int, step: int) -> int:
    """The parameter server's workers hold no RNG state (a worker replaced mid-epoch must draw what it would
    have): each step's dropout draws from torch's RNG seeded by (seed, worker, step), NumPy's SeedSequence."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


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
    val: list  # each epoch's val_loss (a sweep's table: the best and the last epoch's)
    train: list | None = None  # each epoch's training loss, where the job reports it
    steps: list | None = None  # each step's loss, where the job records it


def epochs_of(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics[metrics["kind"] == "epoch"] if "kind" in metrics else metrics


# each runner: what it trained, in `Got`

def array_task(tmp_path) -> Got:
    from rayhpc.tune.single import train_single

    task, seen = task_for(TASK, DataConfig()), []
    got = train_single(task, hparams(task), EPOCHS, on_epoch=lambda e, values, m: seen.append(values))
    return Got(got["model"].state_dict(), [v["val_loss"] for v in seen], [v["train_loss"] for v in seen])


def sweep_trial(tmp_path, pack: int = 1, runner: dict | None = None) -> Got:
    """The trial of lr LR in a grid of `pack` learning rates packed together (one: unpacked)."""
    from rayhpc.tune.sweep import run_sweep
    from rayhpc.tune.weights import trial_weights

    lrs = [0.005, 0.01, 0.02, LR][-pack:] if pack > 1 else [LR]
    space = {"lr": {"grid": lrs}, **HPARAMS, "batch_size": BATCH, "accumulate": FIXED["accumulate"]}
    name = f"sweep{pack}" + ("-warm" if runner else "")
    optim = {k: v for k, v in OPTIM.items() if k != "lr"}  # lr: the space's
    table = run_sweep(sweep(tmp_path, name=name, task=TASK, search="grid", epochs=EPOCHS, pack=pack, seed=SEED,
                            optim=optim, schedule=SCHEDULE, space=space, **(runner or {})))
    assert set(table["pack_size"]) == {pack if not runner else 1}, table
    row = table[table["config.lr"] == LR].iloc[0]
    if runner:
        folder = next(p for p in (tmp_path / name).iterdir()
                      if row["trial_id"] in p.name and (p / "params.json").exists())
        weights = load_full_state_dict(latest_checkpoint(folder))
    else:
        weights = trial_weights(f"{tmp_path / name}:{row['trial_id']}", ("val_loss", "min")).state
    return Got(weights, [row["best_val_loss"], row["val_loss"]])


def training(tmp_path, workers: int = 1, strategy: str = "ddp") -> Got:
    from rayhpc.train.config import TrainConfig
    from rayhpc.train.trainer import run_training

    run = run_training(job(TrainConfig, tmp_path, f"train{workers}{strategy}", workers, strategy=strategy,
                           metrics_every_steps=1))
    epochs, steps = epochs_of(run.metrics), run.metrics[run.metrics["kind"] != "epoch"]
    return Got(load_full_state_dict(run.checkpoint_dir), epochs["val_loss"].tolist(), epochs["loss"].tolist(),
               steps["loss"].tolist())


def parallel(tmp_path, task: str = TASK, hp: dict = HPARAMS, **degrees) -> Got:
    from rayhpc.parallel.config import ParallelConfig
    from rayhpc.parallel.trainer import run_parallel

    cfg = job(ParallelConfig, tmp_path, "parallel", 2, task=task, hp=hp, parallelism=degrees)
    result = run_parallel(cfg, log_level=logging.DEBUG)
    epochs = epochs_of(pd.read_parquet(cfg.experiment_dir / "metrics.parquet"))
    return Got(result.weights, epochs["val_loss"].tolist(), epochs["loss"].tolist(), result.losses)


def parameter_server(tmp_path, workers: int) -> Got:
    from rayhpc.ps.config import PSConfig
    from rayhpc.ps.driver import run_ps

    result = run_ps(job(PSConfig, tmp_path, f"ps{workers}", workers, mode="sync"))
    epochs = epochs_of(result.metrics)
    return Got(result.weights, epochs["val_loss"].tolist(), epochs["loss"].tolist())


pytestmark = pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers), which balances the two sessions

RUNNERS = {  # name: (ranks, runner)
    "array task": (1, array_task),
    "sweep trial": (1, sweep_trial),
    "pack member": (1, lambda tmp: sweep_trial(tmp, pack=4)),
    "warm group trial": (2, lambda tmp: sweep_trial(tmp, runner={"workers_per_trial": 2, "trial_runner": "warm"})),
    "train 1 worker": (1, training),
    "ddp 2 workers": (2, lambda tmp: training(tmp, 2)),
    "fsdp2 2 workers": (2, lambda tmp: training(tmp, 2, "fsdp")),
    "parallel dp 2": (2, lambda tmp: parallel(tmp, dp=2)),
    "ps sync 1 worker": (1, lambda tmp: parameter_server(tmp, 1)),
    "ps sync 2 workers": (2, lambda tmp: parameter_server(tmp, 2)),
}


@pytest.mark.parametrize("runner", RUNNERS)
def test_one_configuration_trains_the_same_on_every_runner(runner, references, ray_address, tmp_path):
    world, run = RUNNERS[runner]
    got, want = run(tmp_path), references[world, runner.startswith("ps")]
    want_val, want_train = [v for v, _ in want.epochs], [t for _, t in want.epochs]
    if got.train is None:  # a sweep's table: the best and the last epoch's
        want_val = [min(want_val), want_val[-1]]
    close(runner, "val_loss", got.val, want_val)
    if got.train is not None:
        close(runner, "training loss", got.train, want_train)
    if got.steps is not None:
        close(runner, "step loss", got.steps, steps_recorded(runner, want.step_losses))
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


def steps_recorded(runner: str, losses: list) -> list:
    """The steps whose loss the job records: every one, but `rayhpc train`'s epoch row stands for the epoch's
    last step (a row per step: the other steps' rows)."""
    if runner.startswith("parallel"):
        return losses
    per_epoch = len(losses) // EPOCHS
    return [loss for i, loss in enumerate(losses) if (i + 1) % per_epoch]


def close(runner: str, what: str, got: list, want: list) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=1e-7, msg=lambda m: f"{runner}, {what}: {m}")


def same_weights(runner: str, got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (runner, sorted(got), sorted(want))
    for key, value in want.items():
        torch.testing.assert_close(got[key].float(), value.float(), msg=lambda m: f"{runner} {key}: {m}")
