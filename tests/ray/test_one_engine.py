"""What a sweep finds is what every job trains. One configuration (AdamW with weight decay, a warm-up then a
cosine decay to a floor, clipping that bites, 2 micro-batches per step, a seed, a last batch of each epoch
that is partial) ends with the weights and the per-epoch validation losses of one plain PyTorch loop
(`helpers.plain_trial`: torch's own optimizer, schedulers, `clip_grad_norm_`, a `DistributedSampler` of one
replica, one full batch a step) on every runner of `rayhpc.engine`: an array task, a sweep trial unpacked and
as one member of a pack of 4, a warm worker group's trial, `rayhpc train` on 1 worker and DDP and FSDP2 on 2,
`rayhpc parallel` with dp 2 and tp 2, and the parameter server in sync mode on 1 and 2 workers.

The built-in MLP task has no dropout: its result is a function of the weights and the data order alone,
so one and two ranks can be compared with one reference (dropout on two ranks draws two streams; each
runner's resume with dropout is tested beside it: test_train, test_parallel, test_ps, test_sweep_warm)."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from helpers import mlp_split, plain_trial, sweep
from rayhpc.config import validate
from rayhpc.data import DataConfig
from rayhpc.engine.checkpoint import latest_checkpoint, load_full_state_dict
from rayhpc.task import task_for

EPOCHS = 2
BATCH = 64  # 1,638 training samples: 25 steps of 64 and one of 38 an epoch (19 a rank on two)
SECTIONS = {"optim": {"optimizer": "adamw", "lr": 0.02, "weight_decay": 0.1, "beta1": 0.8, "clip_grad_norm": 0.3},
            "schedule": {"warmup_steps": 10, "decay": "cosine", "min_lr_ratio": 0.1}, "accumulate": 2, "seed": 3}
HIDDEN = 16
LR = SECTIONS["optim"]["lr"]


@pytest.fixture(scope="module")
def mlp():
    return task_for("mlp", DataConfig())


@pytest.fixture(scope="module")
def reference(mlp):
    """(the final weights, each epoch's validation loss) of the plain loop."""
    hp = hparams(mlp)
    train, val = mlp_split(mlp)
    weights, history = plain_trial(mlp.initial_model(hp), train, val, hp, EPOCHS, F.mse_loss)
    return weights, [float(h[0]) for h in history]


def hparams(mlp) -> dict:
    from rayhpc.task.hparams import full_hparams

    flat = {**SECTIONS["optim"], **SECTIONS["schedule"], "accumulate": 2, "seed": SECTIONS["seed"]}
    return full_hparams(mlp.hp_model, {**flat, "hidden": HIDDEN, "batch_size": BATCH})


def job(cls, tmp_path, name: str, workers: int, **kw):
    return validate(cls, {"storage_path": str(tmp_path), "name": name, "epochs": EPOCHS, "hparams": {"hidden": HIDDEN},
                          "compute": {"num_workers": workers}, "global_batch_size": BATCH, **SECTIONS, **kw})


def epoch_val_losses(metrics: pd.DataFrame) -> list[float]:
    epochs = metrics[metrics["kind"] == "epoch"] if "kind" in metrics else metrics
    return epochs["val_loss"].tolist()


# each runner: (its final weights, each epoch's val_loss)

def array_task(mlp, tmp_path):
    from rayhpc.tune.single import train_single

    seen = []
    got = train_single(mlp, hparams(mlp), EPOCHS, mlp.obj.data_cfg, on_epoch=lambda e, values, m: seen.append(values))
    return got["model"].state_dict(), [v["val_loss"] for v in seen]


def sweep_trial(mlp, tmp_path, pack: int = 1, runner: dict | None = None):
    """The trial of lr 0.02 in a grid of `pack` learning rates packed together (one: unpacked)."""
    from rayhpc.tune.sweep import run_sweep
    from rayhpc.tune.weights import trial_weights

    lrs = [0.005, 0.01, LR, 0.04][-pack:] if pack > 1 else [LR]
    space = {"lr": {"grid": lrs}, "hidden": HIDDEN, "batch_size": BATCH, "accumulate": SECTIONS["accumulate"]}
    name = f"sweep{pack}" + ("-warm" if runner else "")
    optim = {k: v for k, v in SECTIONS["optim"].items() if k != "lr"}  # lr: the space's
    table = run_sweep(sweep(tmp_path, name=name, search="grid", epochs=EPOCHS, pack=pack, seed=SECTIONS["seed"],
                            optim=optim, schedule=SECTIONS["schedule"], space=space, **(runner or {})))
    assert set(table["pack_size"]) == {pack if not runner else 1}, table
    row = table[table["config.lr"] == LR].iloc[0]
    if runner:
        folder = next(p for p in (tmp_path / name).iterdir()
                      if row["trial_id"] in p.name and (p / "params.json").exists())
        weights = load_full_state_dict(latest_checkpoint(folder))
    else:
        weights = trial_weights(f"{tmp_path / name}:{row['trial_id']}", ("val_loss", "min")).state
    return weights, [row["best_val_loss"], row["val_loss"]]


def training(mlp, tmp_path, workers: int = 1, strategy: str = "ddp"):
    from rayhpc.train.config import TrainConfig
    from rayhpc.train.trainer import run_training

    run = run_training(job(TrainConfig, tmp_path, f"train{workers}{strategy}", workers, strategy=strategy))
    return load_full_state_dict(run.checkpoint_dir), epoch_val_losses(run.metrics)


def parallel(mlp, tmp_path, **degrees):
    from rayhpc.parallel.config import ParallelConfig
    from rayhpc.parallel.trainer import run_parallel

    cfg = job(ParallelConfig, tmp_path, "parallel", 2, parallelism=degrees)
    result = run_parallel(cfg, log_level=logging.DEBUG)
    return result.weights, epoch_val_losses(pd.read_parquet(cfg.experiment_dir / "metrics.parquet"))


def parameter_server(mlp, tmp_path, workers: int):
    from rayhpc.ps.config import PSConfig
    from rayhpc.ps.driver import run_ps

    result = run_ps(job(PSConfig, tmp_path, f"ps{workers}", workers, mode="sync"))
    return result.weights, epoch_val_losses(result.metrics)


pytestmark = pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers), which balances the two sessions

RUNNERS = {
    "array task": array_task,
    "sweep trial": sweep_trial,
    "pack member": lambda mlp, tmp: sweep_trial(mlp, tmp, pack=4),
    "warm group trial": lambda mlp, tmp: sweep_trial(mlp, tmp, runner={"workers_per_trial": 2,
                                                                       "trial_runner": "warm"}),
    "train 1 worker": training,
    "ddp 2 workers": lambda mlp, tmp: training(mlp, tmp, 2),
    "fsdp2 2 workers": lambda mlp, tmp: training(mlp, tmp, 2, "fsdp"),
    "parallel dp 2": lambda mlp, tmp: parallel(mlp, tmp, dp=2),
    "parallel tp 2": lambda mlp, tmp: parallel(mlp, tmp, tp=2),
    "ps sync 1 worker": lambda mlp, tmp: parameter_server(mlp, tmp, 1),
    "ps sync 2 workers": lambda mlp, tmp: parameter_server(mlp, tmp, 2),
}


@pytest.mark.parametrize("runner", RUNNERS)
def test_one_configuration_trains_the_same_on_every_runner(runner, mlp, reference, ray_address, tmp_path):
    weights, val_losses = RUNNERS[runner](mlp, tmp_path)
    want_weights, want_val = reference
    if runner in ("sweep trial", "pack member", "warm group trial"):  # the table: the best and the last epoch's
        want_val = [min(want_val), want_val[-1]]
    torch.testing.assert_close(torch.tensor(val_losses, dtype=torch.float64),
                               torch.tensor(want_val, dtype=torch.float64), rtol=1e-5, atol=1e-7)
    assert weights.keys() == want_weights.keys(), (sorted(weights), sorted(want_weights))
    for key, want in want_weights.items():
        torch.testing.assert_close(weights[key].float(), want.float(), msg=lambda m: f"{runner} {key}: {m}")
