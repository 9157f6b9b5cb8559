"""Data-parallel training on a real local Ray with gloo: DDP and FSDP proven equal to one process."""

import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import (
    CPUS,
    EPOCHS,
    ROOT,
    assert_same_weights,
    run_job,
    run_job_warm,
    tensorboard_scalars,
    too_many_gpu_workers,
    two_ranks,
)
from rayhpc.config import Optim, validate
from rayhpc.data import synthetic_tensors
from rayhpc.engine.checkpoint import complete_checkpoints, latest_checkpoint, load_full_state_dict, load_progress
from rayhpc.models import MLP
from rayhpc.task.batches import epoch_indices
from rayhpc.train.config import TrainConfig
from rayhpc.train.trainer import run_training

# Ray Train runs callbacks in its controller process, which cannot import this test module:
# ship the module's classes by value instead of by reference.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def train_cfg(tmp_path, **kw) -> TrainConfig:
    return validate(TrainConfig, {"storage_path": str(tmp_path), "epochs": EPOCHS, "compute": {"num_workers": 2},
                                  "batch_size_per_worker": 32, "hparams": {"hidden": 16}, **kw})


def one_process(cfg: TrainConfig, batch: int) -> dict:
    """The same model, optimizer and data order in one plain process, `batch` samples per step: the
    mlp task's rows without its 20% hold-out (split by a permutation seeded with split_seed 0)."""
    x, y = synthetic_tensors(cfg.data.synthetic)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    keep = order[round(0.2 * len(x)):]
    torch.manual_seed(cfg.seed)
    model = MLP(6, 16, 2)
    assert cfg.optim == Optim()  # the run takes every job's default optimizer: Adam, lr 0.01
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train = TensorDataset(x[keep], y[keep])
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=batch, sampler=sampler):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.state_dict()




@pytest.fixture(scope="module")
def ddp_run(ray_address, tmp_path_factory):
    cfg = train_cfg(tmp_path_factory.mktemp("ddp"), name="ddp")
    return run_training(cfg)


def test_ddp_equals_one_process_with_the_global_batch(ddp_run):
    assert_same_weights(load_full_state_dict(ddp_run.checkpoint_dir), one_process(ddp_run.cfg, batch=64))
    epochs = ddp_run.metrics[ddp_run.metrics["kind"] == "epoch"]
    assert epochs["epoch"].tolist() == [1, 2, 3] and set(epochs["world_size"]) == {2}
    assert set(epochs["global_batch_size"]) == {64} and set(epochs["batch_size_per_worker"]) == {32}
    assert (epochs["samples_per_s"] > 0).all() and (epochs["step_ms"] > 0).all()
    assert epochs["loss"].iloc[-1] < 0.8 * epochs["loss"].iloc[0]  # the loss went down
    events = tensorboard_scalars(ddp_run.cfg.experiment_dir / "tensorboard")  # `tensorboard --logdir` reads these
    torch.testing.assert_close(events["epoch/loss"], epochs["loss"].tolist())






@pytest.mark.newest  # CI: beside the Slurm tests (pyproject's markers)
def test_a_run_with_dropout_resumed_mid_epoch_after_its_driver_is_killed_equals_two_plain_ranks(ray_address,
                                                                                                tmp_path):
    """The dropout task on 2 DDP ranks with every training option (AdamW, warm-up then cosine, clipping, 2
    micro-batches), a checkpoint every 3 steps (8 a epoch); the driver SIGKILLed once a mid-epoch checkpoint
    is saved, then `--resume`: the run ends with the weights of two plain ranks that never stopped. Each rank's
    dropout masks must go on from its own RNG state at the checkpoint, and the part-done epoch must draw
    nothing new; the epochs finished before the kill are not trained again."""
    args = [sys.executable, str(ROOT / "jobs" / "train_mlp.py"), "--storage-path", str(tmp_path), "--name", "r",
            "--task", f"{ROOT / 'tests' / 'tasks' / 'dropout.py'}:Dropout", "--epochs", str(EPOCHS),
            "--num-workers", "2", "--batch-size-per-worker", "16", "--lr", "0.03", "--optimizer", "adamw",
            "--weight-decay", "0.05", "--beta1", "0.8", "--warmup-steps", "10", "--decay", "cosine",
            "--min-lr-ratio", "0.1", "--clip-grad-norm", "0.5", "--accumulate", "2", "--hp", "step_ms=150",
            "--checkpoint-every", "3", "--address", ray_address]
    driver = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 180
    while (at_kill := registered_mid_epoch(tmp_path / "r")) is None:
        assert driver.poll() is None and time.monotonic() < deadline, "no mid-epoch checkpoint before the deadline"
        time.sleep(0.05)
    driver.kill()
    driver.wait()
    assert at_kill.epoch < EPOCHS, "the run ended before the driver was killed"
    rows = lambda: pd.read_parquet(tmp_path / "r" / "metrics.parquet").sort_values(["global_step", "kind"])
    before = (b := rows())[b["global_step"] <= at_kill.global_step]

    proc = run_job("train_mlp.py", *args[2:], "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    final = latest_checkpoint(tmp_path / "r")
    assert load_progress(final).epoch == EPOCHS
    assert_same_weights(load_full_state_dict(final), two_ranks(0.03))
    after = rows()
    assert after.loc[after["kind"] == "epoch", "epoch"].tolist() == [1, 2, 3]
    # the steps up to the checkpoint were not trained again: their rows (timings included) are unchanged
    pd.testing.assert_frame_equal(after.iloc[:len(before)][before.columns], before)


def registered_mid_epoch(run: Path):
    """The progress of a mid-epoch checkpoint once Ray Train has registered it (its snapshot names it, which
    a resume starts from) and its row is recorded; None before."""
    snapshot = run / "checkpoint_manager_snapshot.json"
    if not snapshot.exists() or not (run / "metrics.parquet").exists():
        return None
    named = [c for c in complete_checkpoints(run) if c.name in snapshot.read_text()]
    recorded = set(pd.read_parquet(run / "metrics.parquet")["global_step"])
    return next((p for p in map(load_progress, named) if p.step_in_epoch and p.global_step in recorded), None)


def test_shards_partition_the_data_and_reshuffle_every_epoch():
    """Every rank's order is torch's DistributedSampler's (seed, epoch): the shards partition the data."""
    n, world = 41, 2
    for epoch in (0, 1):
        shards = [epoch_indices(n, 5, epoch, rank, world) for rank in range(world)]
        for rank, shard in enumerate(shards):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5)
            sampler.set_epoch(epoch)
            assert shard == list(sampler)
        assert len(shards[0]) == len(shards[1]) == 21 and set(shards[0] + shards[1]) == set(range(n))
    assert epoch_indices(n, 5, 0, 0, world) != epoch_indices(n, 5, 1, 0, world), "no reshuffle between epochs"


@pytest.mark.parametrize("args, expected", [
    (["--num-workers", str(CPUS + 1), "--cpus-per-worker", "1"],
     f"error: compute.num_workers (--num-workers) {CPUS + 1}: the cluster can place {CPUS} worker(s) of 1 CPU each"),
    too_many_gpu_workers("--num-workers"),
    (["--global-batch-size", "65"], "error: global_batch_size (--global-batch-size) 65: not divisible by "
                                    "compute.num_workers (--num-workers) 2"),
    (["--hp", "hidden=wide"], "error: hparams.hidden (--hp): Input should be a valid integer"),
    (["--hp", "lr=0.1"], "error: hparams.lr (--hp): a platform hyperparameter; set it with --lr"),
    (["--strategy", "zero3"], "error: strategy (--strategy): Input should be 'ddp' or 'fsdp' (got 'zero3')"),
    (["--global-batch-size", "64", "--batch-size-per-worker", "32"], "error: global_batch_size (--global-batch-size) "
                                                                    "and batch_size_per_worker"),
    (["--init-from", "/"], "error: init_from (--init-from) /: / is not a sweep's folder (it has no sweep.yaml)"),
])
def test_bad_input_exits_2_within_seconds(args, expected, tmp_path):
    started = time.monotonic()
    proc = run_job_warm("train_mlp.py", "--storage-path", str(tmp_path), *args,
                        env={"RAY_TMPDIR": str(tmp_path / "ray")})
    assert proc.returncode == 2 and proc.stderr.strip().startswith(expected), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert time.monotonic() - started < 30 and not (tmp_path / "ray").exists()


def test_a_run_started_from_a_sweep_trial_begins_with_its_weights(ray_address, tmp_path):
    """`--init-from SWEEP_DIR[:TRIAL_ID]`: a FuncPack member named by id (the padded pack's members:
    tests/unit/test_packed.py) starts the run with its weights and its own task hyperparameters. Proof
    independent of the extraction: at lr 1e-12 the run's first val_loss is the one the sweep's pack
    computed for that member. `SWEEP_DIR` alone names the best trial. Checked: the member index off by
    one, the weights not loaded, or the best taken by the wrong order fail here."""
    from rayhpc.tune.config import SweepConfig
    from rayhpc.tune.sweep import run_sweep
    from rayhpc.tune.weights import trial_weights

    space = {"depth": {"choice": [2, 3]}, "hidden": {"choice": [8, 16]}, "lr": {"loguniform": [0.01, 0.1]}}
    table = run_sweep(validate(SweepConfig, {"storage_path": str(tmp_path), "name": "s", "num_samples": 8,
                                             "epochs": 2, "space": space}))
    best = table.sort_values("best_val_loss").iloc[0]["trial_id"]
    assert trial_weights(str(tmp_path / "s"), ("val_loss", "min")).trial_id == best
    row = table[(table["config.depth"] == 3) & (table["pack_size"] > 1)].iloc[-1]
    cfg = validate(TrainConfig, {"storage_path": str(tmp_path), "name": "t", "epochs": 1, "compute": {"num_workers": 1},
                                 "init_from": f"{tmp_path / 's'}:{row['trial_id']}", "optim": {"lr": 1e-12}})
    result = run_training(cfg)
    assert result.cfg.hparams == {"depth": 3, "hidden": row["config.hidden"]}
    torch.testing.assert_close(float(result.metrics["val_loss"].iloc[0]), float(row["val_loss"]), rtol=1e-5, atol=0)
